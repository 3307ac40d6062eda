"""Assertions over nested data, through the type table: no Hypothesis needed.

They take data apart as to_device does (the CAST view of devicekit._core._kinds), so what
they compare is what devicekit moves: containers by type and keys, objects that move
themselves by what they hold, leaves as their kind compares (tensors by shape, dtype
and values on any device, numpy arrays by value, the rest by ``==``).
"""

from __future__ import annotations

import collections
from collections.abc import Generator
from typing import Any, Final, NamedTuple, TypeAlias

import torch

from devicekit._base import DeviceLike, resolve_device, shown
from devicekit._checks import describe_devices, find_devices
from devicekit._core import CAST, SET, Leaf, decide, flatten, leaf_how, mapping_items, paths
from devicekit.testing._stand_in._tensor import StandInTensor

__all__ = ["assert_batches_equal", "assert_on_device", "assert_same_structure"]


def assert_on_device(data: Any, device: DeviceLike, /) -> None:
    """Assert every tensor in ``data`` is on ``device`` (``"cuda"``: the current one).

    >>> import torch
    >>> from devicekit.testing import assert_on_device
    >>> assert_on_device({"x": torch.ones(1)}, "cpu")

    Args:
        data: Tensors, modules, optimizers, and containers of them.
        device: The device every tensor must be on.

    Raises:
        AssertionError: Naming each tensor elsewhere and its device.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
        TypeError: ``device`` is no string, torch.device or index.
        TransferError: ``data`` holds a cycle or nests too deep, as in
            :func:`~devicekit.find_devices`.
    """
    expected = resolve_device(device)
    found = find_devices(data)
    stray = {
        found_device: paths for found_device, paths in found.items() if found_device != expected
    }
    if stray:
        where = describe_devices(stray)
        msg = f"Expected every tensor on {expected}, but {where}."
        raise AssertionError(msg)


def assert_same_structure(actual: Any, expected: Any, /) -> None:
    """Assert both have the same containers, keys, tensor shapes and dtypes, and other leaves.

    Containers must be of the same exact types. A dict's keys may come in any order, as
    Python's ``==`` has it (an OrderedDict's may not); a set's members are matched in any
    order. Objects that move themselves (a PackedSequence, a TensorDict, a graph) are
    compared by what they hold, as the type table sees it. Tensor values are not compared.

    >>> import torch
    >>> from devicekit.testing import assert_same_structure
    >>> assert_same_structure({"x": [torch.ones(2)]}, {"x": [torch.zeros(2)]})

    Args:
        actual: The data to check, such as a collate function's output.
        expected: The data it must match in structure.

    Raises:
        AssertionError: Naming the first path where they differ.
        TransferError: Either holds a cycle or nests too deep, as in
            :func:`~devicekit.to_device`.
    """
    _compare(actual, expected, values=False)


def assert_batches_equal(actual: Any, expected: Any, /) -> None:
    """Assert same structure and equal values; tensors may be on different devices.

    Meta tensors hold no values: where either side is on meta, shapes and dtypes must
    match and values are not compared. Sparse tensors compare by the values they stand
    for, numpy arrays by shape, dtype and values; NaN equals NaN in both.

    >>> import torch
    >>> from devicekit.testing import assert_batches_equal
    >>> assert_batches_equal([torch.arange(3)], [torch.arange(3)])

    Args:
        actual: The data to check, such as a batch after a round trip to a device.
        expected: The data it must equal, on any device.

    Raises:
        AssertionError: Naming the first path where they differ, and how.
        TransferError: Either holds a cycle or nests too deep, as in
            :func:`~devicekit.to_device`.
    """
    _compare(actual, expected, values=True)


class _Shape(NamedTuple):
    """Data as the type table takes it apart (the CAST view), every part by its path."""

    parts: dict[str, Any]
    """Every container and leaf."""
    counts: dict[str, int]
    """How many children each container has."""
    order: list[tuple[str, Any]]
    """The containers, parents first, then the leaves in walk order."""
    leaves: frozenset[str]
    """The paths of the leaves."""


def _shape(data: Any) -> _Shape:
    # CAST: containers as to_device rebuilds them, and objects that move themselves by
    # what they hold (a PackedSequence's fields, a TensorDict's items), never by their ==.
    flat = flatten(data, view=CAST)
    leaf_paths, container_paths = paths(flat)
    named = list(zip(container_paths, flat.spec, strict=True))
    containers = [(path, container) for path, (_, _, container, _) in named]
    containers.reverse()  # the spec closes children first
    leaves = list(zip(leaf_paths, flat.leaves, strict=True))
    counts = {path: children for path, (_, _, _, children) in named}
    return _Shape(dict(containers + leaves), counts, containers + leaves, frozenset(leaf_paths))


# A comparison: a generator that raises AssertionError where the two differ, and yields
# the pairs whose comparison it needs (a set's members, matched one by one) to receive
# whether they match. One loop runs them all, from a stack: no recursion, however deep
# sets nest in sets.
_Comparison: TypeAlias = Generator[tuple[Any, Any], bool, None]


def _compare(actual: Any, expected: Any, *, values: bool) -> None:
    """Compare, raising the outermost difference: comparisons asked for run on a stack."""
    running: list[_Comparison] = [_comparison(actual, expected, values=values)]
    answer: bool | None = None
    while running:
        try:
            asked = running[-1].send(answer)  # type: ignore[arg-type] # None to start it
        except StopIteration:  # noqa: PERF203 - the loop is the comparisons' stack
            running.pop()
            answer = True
        except AssertionError:
            running.pop()
            if not running:
                raise
            answer = False
        else:
            running.append(_comparison(*asked, values=values))
            answer = None


def _comparison(actual: Any, expected: Any, *, values: bool) -> _Comparison:
    mine, theirs = _shape(actual), _shape(expected)
    compared_whole: list[str] = []  # sets: their members matched as a whole, unordered
    for path, want in theirs.order:
        if any(path.startswith(whole + "{") for whole in compared_whole):
            continue
        where = "data" + path
        got: Any = mine.parts.get(path)
        if _kind(got) is not _kind(want):
            msg = f"{where}: expected a {_kind(want).__name__}, got a {_kind(got).__name__}."
            raise AssertionError(msg)
        if path in theirs.leaves:
            _compare_leaves(got, want, where, values=values)
            continue
        node = decide(_kind(want)).cast
        if node is SET:
            compared_whole.append(path)
            yield from _compare_members(got, want, where, values=values)
        elif node.mapping:
            keys, got_keys = [k for k, _ in mapping_items(want)], [k for k, _ in mapping_items(got)]
            # Python's dicts compare equal in any order; OrderedDicts do not.
            ordered = isinstance(want, collections.OrderedDict)
            if keys != got_keys if ordered else _differ_unordered(keys, got_keys):
                expected, found = shown(keys, limit=200), shown(got_keys, limit=200)
                msg = f"{where}: expected keys {expected}, got {found}."
                raise AssertionError(msg)
        elif theirs.counts[path] != mine.counts[path]:
            msg = f"{where}: expected {theirs.counts[path]} items, got {mine.counts[path]}."
            raise AssertionError(msg)


def _kind(value: object) -> type:
    """A value's type, as the comparison has it.

    A stand-in tensor is a plain tensor, or a Parameter where it is one (the stand-in's
    parameters keep their wrapper's type).
    """
    if isinstance(value, StandInTensor):
        return torch.nn.Parameter if isinstance(value, torch.nn.Parameter) else torch.Tensor
    return type(value)


def _compare_leaves(got: Any, want: Any, where: str, *, values: bool) -> None:
    """Two leaves of one type, compared as the table says their kind is."""
    how = leaf_how(_kind(want)).leaf
    if how is Leaf.TENSOR or how is Leaf.PARAMETER:
        _compare_tensors(got, want, where, values=values)
        return
    if not (_equal_arrays(got, want) if how is Leaf.ARRAY else got is want or _equal(got, want)):
        msg = f"{where}: expected {shown(want, limit=200)}, got {shown(got, limit=200)}."
        raise AssertionError(msg)


def _equal(got: Any, want: Any) -> bool:
    """``got == want``, where that says yes or no (a module's, an object's own ``==``)."""
    try:
        return bool(got == want)
    except (RuntimeError, ValueError, TypeError):  # no single truth value: not equal here
        return False


def _equal_arrays(got: Any, want: Any) -> bool:
    """Two numpy arrays: equal shape, dtype and values, NaN equal to NaN."""
    import numpy  # noqa: PLC0415 - only where arrays are compared: numpy is optional

    return (
        got.shape == want.shape
        and got.dtype == want.dtype
        and bool(numpy.array_equal(got, want, equal_nan=want.dtype.kind in "fc"))
    )


def _differ_unordered(keys: list[Any], got_keys: list[Any]) -> bool:
    return len(keys) != len(got_keys) or any(key not in got_keys for key in keys)


def _compare_members(got: Any, want: Any, where: str, *, values: bool) -> _Comparison:
    """Sets: each expected member matched by one actual member, in any order.

    Tensors hash by identity, so a moved set of tensors holds new members: members are
    matched by a digest of what is compared (a tensor's shape, dtype and bytes, another
    member itself), in linear time; those without an equal digest (a NaN written two
    ways, a member that cannot be hashed) are then matched one by one.
    """
    if len(got) != len(want):
        msg = f"{where}: expected {len(want)} members, got {len(got)}."
        raise AssertionError(msg)
    waiting: dict[Any, list[Any]] = collections.defaultdict(list)
    for member in got:
        waiting[_digest(member, values=values)].append(member)
    unmatched = []
    for member in want:
        bucket = waiting.get(_digest(member, values=values))
        if bucket:
            bucket.pop()
        else:
            unmatched.append(member)
    left = [member for bucket in waiting.values() for member in bucket]
    for member in unmatched:
        match = _NO_MATCH
        for candidate in left:
            if (yield candidate, member):  # compared by the loop in _compare
                match = candidate
                break
        if match is _NO_MATCH:
            like, among = shown(member, limit=200), shown(got, limit=200)
            msg = f"{where}: expected a member like {like}, found none among {among}."
            raise AssertionError(msg)
        left.remove(match)


def _digest(member: Any, *, values: bool) -> Any:
    """What two members equal as the comparison has it share, hashable; else something unique."""
    if isinstance(member, torch.Tensor):
        described = (_kind(member), tuple(member.shape), member.dtype, member.layout)
        if not values or member.is_meta:
            return described
        host = member.detach().cpu()
        host = host.to_dense() if host.layout != torch.strided else host
        return (*described, bytes(host.contiguous().reshape(-1).view(torch.uint8).numpy()))
    try:
        hash(member)
    except TypeError:
        return object()  # matched one by one
    return (type(member), member)


_NO_MATCH: Any = object()


def _compare_tensors(
    actual: torch.Tensor, expected: torch.Tensor, path: str, *, values: bool
) -> None:
    if (
        actual.shape != expected.shape
        or actual.dtype != expected.dtype
        or actual.layout != expected.layout
    ):
        layouts = (
            ("", "")
            if actual.layout == expected.layout
            else (f" {_layout(expected)}", f" {_layout(actual)}")
        )
        msg = (
            f"{path}: expected a{layouts[0]} {expected.dtype} tensor of shape "
            f"{tuple(expected.shape)}, got{layouts[1]} {actual.dtype} of shape "
            f"{tuple(actual.shape)}."
        )
        raise AssertionError(msg)
    if not values or actual.is_meta or expected.is_meta:
        return
    mine, theirs = actual.cpu(), expected.cpu()
    if mine.layout != torch.strided:  # sparse: the values it stands for, however stored
        mine, theirs = mine.to_dense(), theirs.to_dense()
    if torch.equal(mine, theirs):
        return
    if mine.is_floating_point() or mine.is_complex():  # NaN is equal to NaN here
        differ = ~torch.isclose(mine, theirs, rtol=0, atol=0, equal_nan=True)
    else:
        differ = mine != theirs
    if differ.any():
        raise AssertionError(_values_differ(path, mine, theirs, differ))


_SHOWN_WHOLE: Final = 16
"""Tensors of at most this many elements are shown whole where their values differ."""
_DIFFERENCES_SHOWN: Final = 3
"""Differing elements a message shows for larger ones, after their count."""


def _values_differ(
    path: str, mine: torch.Tensor, theirs: torch.Tensor, differ: torch.Tensor
) -> str:
    """How two host tensors of one shape differ (where ``differ``), in a message of bounded length.

    A 5-million-element tensor is described in a line, not in 50 MB of values.

    >>> print(_values_differ("data", torch.tensor([1, 5]), torch.tensor([1, 2]), None))
    data: values differ: expected [1, 2], got [1, 5].
    >>> got, expected = torch.zeros(10, 10), torch.zeros(10, 10)
    >>> got[2, 3], got[9, 9] = 0.5, float("nan")
    >>> print(_values_differ("data['x']", got, expected, got.isnan() | (got != expected)))
    ... # doctest: +NORMALIZE_WHITESPACE
    data['x']: values differ at 2 of 100 elements (the largest absolute difference 0.5):
    at [2, 3] expected 0.0, got 0.5; at [9, 9] expected 0.0, got nan.
    """
    if theirs.numel() <= _SHOWN_WHOLE:
        return f"{path}: values differ: expected {theirs.tolist()!r}, got {mine.tolist()!r}."
    count = int(torch.count_nonzero(differ))
    flat_mine, flat_theirs = mine.reshape(-1), theirs.reshape(-1)
    shown = [
        f"at {_index(at, mine.shape)} expected {flat_theirs[at].item()!r}, "
        f"got {flat_mine[at].item()!r}"
        for at in _first_true(differ.reshape(-1), _DIFFERENCES_SHOWN)
    ]
    largest = ""
    if mine.dtype != torch.bool:
        wide = torch.complex128 if mine.is_complex() else torch.float64  # no overflow
        gaps = (mine[differ].to(wide) - theirs[differ].to(wide)).abs()
        gaps = gaps[~gaps.isnan()]
        if gaps.numel():
            largest = f" (the largest absolute difference {gaps.max().item()!r})"
    first = f"; the first {len(shown)}: " if count > len(shown) else ": "
    return (
        f"{path}: values differ at {count:,} of {mine.numel():,} elements{largest}"
        f"{first}{'; '.join(shown)}."
    )


def _first_true(flat: torch.Tensor, count: int) -> list[int]:
    """The first ``count`` indices where ``flat`` is True, found a block at a time."""
    found: list[int] = []
    block = 1 << 16  # every index of a block that differs throughout: 0.5 MiB
    for start in range(0, flat.numel(), block):
        found += (flat[start : start + block].nonzero().reshape(-1) + start).tolist()
        if len(found) >= count:
            return found[:count]
    return found


def _index(flat: int, shape: torch.Size) -> list[int]:
    """The index of element ``flat`` of a tensor of ``shape``, one number a dimension."""
    index = []
    for size in reversed(shape):
        flat, at = divmod(flat, size)
        index.append(at)
    return index[::-1]


def _layout(tensor: torch.Tensor) -> str:
    return str(tensor.layout).removeprefix("torch.")
