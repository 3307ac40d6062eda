"""The tests' oracle: what to_device does to a batch, written again from DESIGN.md's rules.

A plain recursive mover and comparator that import nothing from devicekit, so a test
that compares devicekit with them cannot pass by running the code it tests twice.
It covers the containers the property tests generate and the rules they check:
exact container types, keys paired with their values, aliasing, dtype casts of
floating-point tensors, scalars and strings left as they are.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch


def reference_move(data: Any, device: torch.device, *, dtype: torch.dtype | None = None) -> Any:
    """``data`` moved to ``device`` by the rules, each tensor once."""
    memo: dict[int, Any] = {}

    def move(obj: Any) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        if isinstance(obj, torch.Tensor):
            cast = dtype if dtype is not None and obj.is_floating_point() else None
            result = obj.to(device, dtype=cast) if cast is not None else obj.to(device)
            memo[id(obj)] = result
            return result
        return rebuild(obj, move)

    return move(data)


def rebuild(obj: Any, move: Any) -> Any:
    """``obj`` with ``move`` applied to its children, as devicekit's rules rebuild it."""
    kind = type(obj)
    if kind is dict:
        return {key: move(value) for key, value in obj.items()}
    if isinstance(obj, dict):  # OrderedDict, defaultdict, other dict subclasses
        clone = copy.copy(obj)
        for key in dict.keys(obj):
            dict.__setitem__(clone, key, move(dict.__getitem__(obj, key)))
        return clone
    if isinstance(obj, collections.UserDict):
        clone = copy.copy(obj)
        clone.data = {key: move(value) for key, value in obj.data.items()}
        return clone
    if kind is list:
        return [move(value) for value in obj]
    if kind is tuple:
        return tuple(move(value) for value in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return kind(*(move(value) for value in obj))
    if isinstance(obj, collections.deque):
        return collections.deque((move(value) for value in obj), maxlen=obj.maxlen)
    if isinstance(obj, collections.UserList):
        clone = copy.copy(obj)
        clone.data = [move(value) for value in obj.data]
        return clone
    if isinstance(obj, set | frozenset):
        return kind(move(value) for value in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        clone = object.__new__(kind)
        for name, value in vars(obj).items():
            object.__setattr__(clone, name, move(value))
        return clone
    return obj  # scalars, strings and other leaves stay as they are


def tensors_of(data: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``data``, in the order of its containers' own iteration."""
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, dict):
        for key in dict.keys(data):
            yield from tensors_of(dict.__getitem__(data, key))
    elif isinstance(data, collections.UserDict):
        for value in data.data.values():
            yield from tensors_of(value)
    elif isinstance(
        data, list | tuple | collections.deque | collections.UserList | set | frozenset
    ):
        for value in data:
            yield from tensors_of(value)
    elif dataclasses.is_dataclass(data) and not isinstance(data, type):
        for value in vars(data).values():
            yield from tensors_of(value)


def assert_moved_like(actual: Any, expected: Any, path: str = "data") -> None:
    """``actual`` is ``expected``: same types, keys, lengths, scalars, and tensors of the
    same device, dtype and shape (values compared where they have data)."""
    _compare(actual, expected, path, {}, {})


def _compare(
    actual: Any,
    expected: Any,
    path: str,
    seen_actual: dict[int, str],
    seen_expected: dict[int, str],
) -> None:
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        # Aliasing: a tensor met twice in one is met twice, at the same place, in the other.
        first_actual = seen_actual.setdefault(id(actual), path)
        first_expected = seen_expected.setdefault(id(expected), path)
        assert first_actual == first_expected, f"{path}: aliasing differs"
        assert actual.device == expected.device, f"{path}: {actual.device} != {expected.device}"
        assert actual.dtype == expected.dtype, f"{path}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: {actual.shape} != {expected.shape}"
        if not expected.is_meta:
            assert torch.equal(actual, expected), f"{path}: values differ"
        return
    if isinstance(expected, dict):
        assert list(dict.keys(actual)) == list(dict.keys(expected)), f"{path}: keys differ"
        if isinstance(expected, collections.defaultdict):
            assert actual.default_factory is expected.default_factory, f"{path}: factory"
        for key in dict.keys(expected):
            _compare(
                dict.__getitem__(actual, key),
                dict.__getitem__(expected, key),
                f"{path}[{key!r}]",
                seen_actual,
                seen_expected,
            )
        return
    if isinstance(expected, collections.UserDict):
        _compare(actual.data, expected.data, f"{path}.data", seen_actual, seen_expected)
        return
    if isinstance(expected, set | frozenset):
        assert len(actual) == len(expected), f"{path}: sizes differ"
        return  # members have no order to pair them by
    if isinstance(expected, list | tuple | collections.deque | collections.UserList):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        if isinstance(expected, collections.deque):
            assert actual.maxlen == expected.maxlen, f"{path}: maxlen differs"
        for index, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
            _compare(mine, theirs, f"{path}[{index}]", seen_actual, seen_expected)
        return
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        assert vars(actual).keys() == vars(expected).keys(), f"{path}: attributes differ"
        for name in vars(expected):
            _compare(
                getattr(actual, name),
                getattr(expected, name),
                f"{path}.{name}",
                seen_actual,
                seen_expected,
            )
        return
    both_nan = isinstance(actual, float) and math.isnan(actual) and math.isnan(expected)
    same = actual == expected or both_nan
    assert same, f"{path}: {actual!r} != {expected!r}"
