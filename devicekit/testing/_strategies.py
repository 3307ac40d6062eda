"""Hypothesis strategies: nested batches, tensors, and the devices of this machine.

Needs Hypothesis (the ``testing`` extra); devicekit.testing imports this module on the
first use of a strategy, so its assertions work without it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from devicekit._base import HOST_TYPES, available_devices, flag, whole_number
from devicekit.testing._containers import CONTAINER_KINDS, FrozenRecord, Pair, Record

__all__ = ["batches", "devices", "tensors"]

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
    try:
        max_leaves = whole_number(max_leaves, 1, "max_leaves")
    except (TypeError, ValueError) as err:  # as Hypothesis's own strategies say it
        raise InvalidArgument(str(err)) from None
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
    try:
        meta, host = flag(meta, "meta"), flag(host, "host")
    except TypeError as err:  # as Hypothesis's own strategies say it
        raise InvalidArgument(str(err)) from None
    found = [torch.device(name) for name in available_devices()]
    wanted = [
        device
        for device in found
        if (meta or device.type != "meta") and (host or device.type not in HOST_TYPES)
    ]
    return st.sampled_from(wanted) if wanted else st.nothing()
