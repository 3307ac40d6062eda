"""Structural comparisons used across the tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from devicekit._transfer import _walker


def tensor_leaves(data: Any) -> Iterator[torch.Tensor]:
    """Every tensor in the data, in walk order, repeats included."""
    return (leaf for leaf in _walker.leaves(data) if isinstance(leaf, torch.Tensor))


def assert_same_structure(actual: Any, expected: Any, path: str = "data") -> None:
    """Both have the same containers, of the same exact types, with the same keys."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape, path
        return
    if isinstance(expected, Mapping):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same_structure(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_structure(a, e, f"{path}[{index}]")
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            name = field.name
            assert_same_structure(getattr(actual, name), getattr(expected, name), f"{path}.{name}")
    else:
        assert actual == expected, path


def snapshot(data: Any) -> list[tuple[int, torch.device, torch.Tensor | None]]:
    """Identity, device and value (where readable) of every tensor, to prove nothing changed."""
    return [(id(t), t.device, None if t.is_meta else t.clone()) for t in tensor_leaves(data)]


def assert_unchanged(
    data: Any, before: list[tuple[int, torch.device, torch.Tensor | None]]
) -> None:
    after = list(tensor_leaves(data))
    assert [id(t) for t in after] == [entry[0] for entry in before]
    for tensor, (_, device, value) in zip(after, before, strict=True):
        assert tensor.device == device
        if value is not None:
            assert torch.equal(tensor, value)
