"""Property-based testing of data pipelines: Hypothesis strategies and assertions.

Needs Hypothesis: the ``testing`` extra (``python -m pip install -e ".[testing]"`` from
a clone). A collate function, a batch transform or a custom transfer rule can then be
tested against nested batches of the container kinds in :data:`CONTAINER_KINDS`, with
tensors of six dtypes (float32, float64, float16, int64, int32, bool) and of shapes
that include scalars and empty tensors, on every device this machine has::

    import devicekit as dk
    from hypothesis import given
    from devicekit.testing import batches, devices, assert_batches_equal

    @given(batches(), devices())
    def test_round_trip(batch, device):
        assert_batches_equal(dk.to_device(dk.to_device(batch, device), "cpu"), batch)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from devicekit._checks import describe_devices, find_devices
from devicekit._devices import DeviceLike, available_devices, resolve_device
from devicekit._kinds import mapping_items
from devicekit._tree import flatten, paths

__all__ = [
    "CONTAINER_KINDS",
    "FrozenRecord",
    "Pair",
    "Record",
    "assert_batches_equal",
    "assert_on_device",
    "assert_same_structure",
    "batches",
    "devices",
    "tensors",
]


class Pair(NamedTuple):
    """The namedtuple container :func:`batches` generates.

    >>> import torch
    >>> from devicekit.testing import Pair
    >>> Pair(torch.zeros(2), "label")
    Pair(first=tensor([0., 0.]), second='label')
    """

    first: Any
    second: Any


@dataclasses.dataclass
class Record:
    """The dataclass container :func:`batches` generates.

    >>> import torch
    >>> from devicekit.testing import Record
    >>> Record(features=torch.ones(1), target=3)
    Record(features=tensor([1.]), target=3)
    """

    features: Any
    target: Any


@dataclasses.dataclass(frozen=True)
class FrozenRecord:
    """The frozen dataclass container :func:`batches` generates: rebuilt, never changed.

    >>> import torch
    >>> from devicekit.testing import FrozenRecord
    >>> FrozenRecord(features=torch.ones(1), target=None)
    FrozenRecord(features=tensor([1.]), target=None)
    """

    features: Any
    target: Any


CONTAINER_KINDS = (
    "dict",
    "OrderedDict",
    "defaultdict",
    "list",
    "tuple",
    "namedtuple",
    "dataclass",
    "frozen dataclass",
)
"""The container kinds :func:`batches` can generate, by the names ``containers=`` takes.

>>> from hypothesis import given
>>> from devicekit.testing import CONTAINER_KINDS, batches
>>> CONTAINER_KINDS[:3]
('dict', 'OrderedDict', 'defaultdict')
>>> @given(batches(containers=("namedtuple", "frozen dataclass")))
... def test_my_collate(batch):
...     ...
>>> test_my_collate()
"""

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool)


_SHAPES = st.lists(st.integers(0, 4), max_size=3).map(tuple)


def _checked_dtypes(dtypes: object) -> tuple[torch.dtype, ...]:
    found = tuple(dtypes) if isinstance(dtypes, Sequence) and not isinstance(dtypes, str) else ()
    if not found or not all(isinstance(dtype, torch.dtype) for dtype in found):
        msg = f"Expected dtypes to be a non-empty sequence of torch.dtype, got {dtypes!r}."
        raise InvalidArgument(msg)
    return found


def _checked_shapes(shapes: object) -> st.SearchStrategy[tuple[int, ...]]:
    if isinstance(shapes, st.SearchStrategy):
        return shapes
    if isinstance(shapes, tuple) and all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shapes
    ):
        return st.just(shapes)  # one shape, given as is
    msg = (
        "Expected shapes to be a strategy of shapes or one shape as a tuple of sizes of 0 or "
        f"more, such as (2, 3), got {type(shapes).__name__} {shapes!r}."
    )
    raise InvalidArgument(msg)


@st.composite
def _tensors(
    draw: st.DrawFn, dtypes: Sequence[torch.dtype], shapes: st.SearchStrategy[tuple[int, ...]]
) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    values = torch.randint(-100, 100, shape, generator=generator)
    return values > 0 if dtype is torch.bool else values.to(dtype)


def tensors(
    *,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    shapes: st.SearchStrategy[tuple[int, ...]] | tuple[int, ...] = _SHAPES,
) -> st.SearchStrategy[torch.Tensor]:
    """Small host tensors of the given dtypes and shapes, with whole-number values.

    >>> from hypothesis import given, strategies as st
    >>> from devicekit.testing import tensors
    >>> @given(tensors(shapes=st.just((2, 3))))
    ... def test_shape(tensor):
    ...     assert tensor.shape == (2, 3)
    >>> test_shape()

    Args:
        dtypes: Drawn from these.
        shapes: Drawn from this strategy, or one shape given as a tuple; by default up to
            3 dimensions of 0 to 4, so scalars and empty tensors come up.

    Returns:
        The strategy.

    Raises:
        hypothesis.errors.InvalidArgument: ``dtypes`` or ``shapes`` is not of the kinds
            above, when the strategy is made, as Hypothesis's own strategies do.
    """
    return _tensors(_checked_dtypes(dtypes), _checked_shapes(shapes))


def _container(kind: str, children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text(min_size=1, max_size=4)
    if kind == "dict":
        return st.dictionaries(keys, children, max_size=4)
    if kind == "OrderedDict":
        return st.dictionaries(keys, children, max_size=3).map(collections.OrderedDict)
    if kind == "defaultdict":
        return st.dictionaries(keys, children, max_size=3).map(
            lambda items: collections.defaultdict(list, items)
        )
    if kind == "list":
        return st.lists(children, max_size=4)
    if kind == "tuple":
        return st.lists(children, max_size=4).map(tuple)
    if kind == "namedtuple":
        return st.builds(Pair, children, children)
    if kind == "dataclass":
        return st.builds(Record, children, children)
    return st.builds(FrozenRecord, children, children)


def batches(
    *,
    leaves: st.SearchStrategy[Any] | None = None,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    shapes: st.SearchStrategy[tuple[int, ...]] | tuple[int, ...] | None = None,
    containers: Sequence[str] | str = CONTAINER_KINDS,
    max_leaves: int = 12,
) -> st.SearchStrategy[Any]:
    """Nested batches: containers of the :data:`CONTAINER_KINDS`, around tensors and scalars.

    Every argument is optional: ``batches()`` just works.

    >>> import devicekit as dk
    >>> from hypothesis import given
    >>> from devicekit.testing import assert_same_structure, batches
    >>> @given(batches())
    ... def test_to_meta_keeps_structure(batch):
    ...     assert_same_structure(dk.to_device(batch, "meta"), batch)
    >>> test_to_meta_keeps_structure()

    Args:
        leaves: What the leaves are; by default small host tensors of ``dtypes`` and
            ``shapes``, and None, ints, short strings and bools.
        dtypes: The tensors' dtypes.
        shapes: The tensors' shapes; by default up to 3 dimensions of 0 to 4, scalars
            and empty tensors included.
        containers: Which of :data:`CONTAINER_KINDS` to nest (one may be named alone).
        max_leaves: Roughly how many leaves a batch has at most.

    Returns:
        The strategy.

    Raises:
        ValueError: ``containers`` names a kind not in :data:`CONTAINER_KINDS`.
        hypothesis.errors.InvalidArgument: Another argument is not of the kind above, when
            the strategy is made, as Hypothesis's own strategies do.
    """
    kinds = (containers,) if isinstance(containers, str) else tuple(containers)  # one kind alone
    unknown = sorted(set(kinds) - set(CONTAINER_KINDS))
    if unknown or not kinds:
        msg = f"Expected containers among {CONTAINER_KINDS}, got {kinds!r}."
        raise ValueError(msg)
    if not isinstance(max_leaves, int) or isinstance(max_leaves, bool) or max_leaves < 1:
        msg = f"Expected max_leaves to be a whole number of 1 or more, got {max_leaves!r}."
        raise InvalidArgument(msg)
    if leaves is not None and not isinstance(leaves, st.SearchStrategy):  # untyped callers
        msg = (  # type: ignore[unreachable]
            "Expected leaves to be a Hypothesis strategy such as devicekit.testing.tensors(), "
            f"got {type(leaves).__name__} {leaves!r}."
        )
        raise InvalidArgument(msg)
    if leaves is None:
        scalars = st.none() | st.integers(-5, 5) | st.text(max_size=3) | st.booleans()
        leaves = tensors(dtypes=dtypes, shapes=_SHAPES if shapes is None else shapes) | scalars
    else:  # checked all the same: a mistake in them is one still
        _checked_dtypes(dtypes)
        if shapes is not None:
            _checked_shapes(shapes)

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of([_container(kind, children) for kind in kinds])

    return st.recursive(leaves, extend, max_leaves=max_leaves)


def devices(*, meta: bool = True, host: bool = True) -> st.SearchStrategy[torch.device]:
    """The devices this machine can test on: the CPU, meta, and every accelerator found.

    >>> from hypothesis import given
    >>> from devicekit.testing import devices
    >>> @given(devices())
    ... def test_known_device(device):
    ...     assert device.type in ("cpu", "meta", "cuda", "xpu", "mps")
    >>> test_known_device()

    Args:
        meta: Include ``meta``, which has shapes but no data: values cannot be compared
            there, but every move and structure can.
        host: Include the CPU and meta; False draws accelerators only, for tests that
            need one (on a machine without, the strategy draws nothing and Hypothesis
            says the test cannot be satisfied: mark such tests to skip there).

    Returns:
        The strategy.

    Raises:
        hypothesis.errors.InvalidArgument: ``meta`` or ``host`` is not True or False.
    """
    for name, value in (("meta", meta), ("host", host)):
        if value is not True and value is not False:  # for untyped callers
            msg = f"Expected {name} to be True or False, got {value!r}."  # type: ignore[unreachable]
            raise InvalidArgument(msg)
    found = [torch.device(name) for name in available_devices()]
    wanted = [
        device
        for device in found
        if (meta or device.type != "meta") and (host or device.type not in ("cpu", "meta"))
    ]
    return st.sampled_from(wanted) if wanted else st.nothing()


def assert_on_device(data: Any, device: DeviceLike, /) -> None:
    """Assert every tensor in ``data`` is on ``device`` (``"cuda"``: the current one).

    >>> import torch
    >>> from devicekit.testing import assert_on_device
    >>> assert_on_device({"x": torch.ones(1)}, "cpu")

    Raises:
        AssertionError: Naming each tensor elsewhere and its device.
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
    order. Tensor values are not compared.

    >>> import torch
    >>> from devicekit.testing import assert_same_structure
    >>> assert_same_structure({"x": [torch.ones(2)]}, {"x": [torch.zeros(2)]})

    Raises:
        AssertionError: Naming the first path where they differ.
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

    Raises:
        AssertionError: Naming the first path where they differ, and how.
    """
    _compare(actual, expected, values=True)


class _Shape(NamedTuple):
    """Data as to_device's walk takes it apart, every part by its path."""

    parts: dict[str, Any]
    """Every container and leaf."""
    counts: dict[str, int]
    """How many children each container has."""
    order: list[tuple[str, Any]]
    """The containers, parents first, then the leaves in walk order."""
    leaves: frozenset[str]
    """The paths of the leaves."""


def _shape(data: Any) -> _Shape:
    flat = flatten(data)
    leaf_paths, container_paths = paths(flat)
    containers = [(path, entry[2]) for path, entry in zip(container_paths, flat.spec, strict=True)]
    containers.reverse()  # the spec closes children first
    leaves = list(zip(leaf_paths, flat.leaves, strict=True))
    counts = {path: entry[3] for path, entry in zip(container_paths, flat.spec, strict=True)}
    return _Shape(dict(containers + leaves), counts, containers + leaves, frozenset(leaf_paths))


def _compare(actual: Any, expected: Any, *, values: bool) -> None:
    mine, theirs = _shape(actual), _shape(expected)
    compared_whole: list[str] = []  # sets: their members matched as a whole, unordered
    for path, want in theirs.order:
        if any(path.startswith(whole + "{") for whole in compared_whole):
            continue
        where = "data" + path
        got: Any = mine.parts.get(path)
        if type(got) is not type(want):
            msg = f"{where}: expected a {type(want).__name__}, got a {type(got).__name__}."
            raise AssertionError(msg)
        if isinstance(want, torch.Tensor):
            _compare_tensors(got, want, where, values=values)
        elif isinstance(want, set | frozenset):
            compared_whole.append(path)
            _compare_members(got, want, where, values=values)
        elif path in theirs.leaves:
            if not _equal_leaves(got, want):
                msg = f"{where}: expected {want!r}, got {got!r}."
                raise AssertionError(msg)
        elif isinstance(want, Mapping):
            keys, got_keys = [k for k, _ in mapping_items(want)], [k for k, _ in mapping_items(got)]
            # Python's dicts compare equal in any order; OrderedDicts do not.
            ordered = isinstance(want, collections.OrderedDict)
            if keys != got_keys if ordered else _differ_unordered(keys, got_keys):
                msg = f"{where}: expected keys {keys!r}, got {got_keys!r}."
                raise AssertionError(msg)
        elif theirs.counts[path] != mine.counts[path]:
            msg = f"{where}: expected {theirs.counts[path]} items, got {mine.counts[path]}."
            raise AssertionError(msg)


def _differ_unordered(keys: list[Any], got_keys: list[Any]) -> bool:
    return len(keys) != len(got_keys) or any(key not in got_keys for key in keys)


def _equal_leaves(got: Any, want: Any) -> bool:
    """``got == want`` for leaves, numpy arrays (equal shape, dtype and values) included."""
    if isinstance(want, np.ndarray):
        return (
            got.shape == want.shape
            and got.dtype == want.dtype
            and bool(np.array_equal(got, want, equal_nan=want.dtype.kind in "fc"))
        )
    return bool(got == want)


def _compare_members(got: Any, want: Any, where: str, *, values: bool) -> None:
    """Sets: each expected member matched by one actual member, in any order.

    Tensors hash by identity, so a moved set of tensors holds new members: they are
    matched by what is compared elsewhere (shape, dtype, values), not by ``==``.
    """
    if len(got) != len(want):
        msg = f"{where}: expected {len(want)} members, got {len(got)}."
        raise AssertionError(msg)
    left = list(got)
    for member in want:
        match = next((g for g in left if _matches(g, member, values=values)), _NO_MATCH)
        if match is _NO_MATCH:
            msg = f"{where}: expected a member like {member!r}, found none among {got!r}."
            raise AssertionError(msg)
        left.remove(match)


_NO_MATCH: Any = object()


def _matches(got: Any, want: Any, *, values: bool) -> bool:
    try:
        _compare(got, want, values=values)
    except AssertionError:
        return False
    return True


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
    same = torch.equal(mine, theirs)
    if not same and mine.is_floating_point() | mine.is_complex():  # NaN is equal to NaN here
        same = bool(torch.isclose(mine, theirs, rtol=0, atol=0, equal_nan=True).all())
    if not same:
        msg = f"{path}: values differ: expected {theirs.tolist()!r}, got {mine.tolist()!r}."
        raise AssertionError(msg)


def _layout(tensor: torch.Tensor) -> str:
    return str(tensor.layout).removeprefix("torch.")
