"""The containers :func:`~devicekit.testing.batches` generates, and their kinds' names."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

__all__ = ["CONTAINER_KINDS", "FrozenRecord", "Pair", "Record"]


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
"""The container kinds ``batches()`` generates (documented in :mod:`devicekit.testing`)."""
