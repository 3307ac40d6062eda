"""Hypothesis strategies for nested batches: every container kind to_device keeps."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import torch
from hypothesis import strategies as st

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Sample:
    """A mutable dataclass container."""

    features: Any
    target: Any


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    """A frozen dataclass container, rebuilt through dataclasses.replace."""

    features: Any
    target: Any


DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A small CPU tensor of a drawn dtype and shape, scalars and empty ones included."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-100, 100, shape, generator=generator)
    return values.to(dtype) if dtype is not torch.bool else values > 0


def scalar_leaves() -> st.SearchStrategy[Any]:
    return st.none() | st.integers(-5, 5) | st.text(max_size=3) | st.booleans()


def batches(leaves: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Any]:
    """Nested batches over dict, OrderedDict, list, tuple, namedtuple and dataclasses."""
    base = leaves if leaves is not None else tensors() | scalar_leaves()

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        keys = st.text(min_size=1, max_size=4)
        return st.one_of(
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(keys, children, max_size=3).map(OrderedDict),
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.builds(Pair, children, children),
            st.builds(Sample, children, children),
            st.builds(FrozenSample, children, children),
        )

    return st.recursive(base, extend, max_leaves=12)
