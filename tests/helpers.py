"""Constants, structural comparisons and small helpers shared across the tests."""

from __future__ import annotations

import importlib
import os
from collections import namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import devicekit as dk

from .reference import tensors_of

META = torch.device("meta")
"""The second device on CPU machines: tensors with a shape and no data."""
CPU = torch.device("cpu")
GiB = 2**30

Pair = namedtuple("Pair", ["x", "y"])
"""A plain namedtuple, as users write them."""


def require_package(name: str) -> Any:
    """Import an optional package the test needs, or skip the test where it is missing.

    Unless DEVICEKIT_REQUIRE_INTEROP is set, as CI and ``nox -s interop`` set it: there a
    missing package fails the run instead of passing it by skipping.
    """
    if os.environ.get("DEVICEKIT_REQUIRE_INTEROP"):
        return importlib.import_module(name)
    return pytest.importorskip(name)


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


class PinRecorder:
    """Stands in for Tensor.pin_memory where nothing can be pinned: a copy, recorded."""

    def __init__(self) -> None:
        self.pinned: list[torch.Tensor] = []

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.pinned.append(tensor)
        return tensor.clone()


class HostCopies:
    """A Prefetcher (the loader's seam) that copies each batch on the host as it is issued.

    As a device copy does, it reads the batch's host memory when it is issued, so a
    source that refilled that memory earlier would change what arrives. Each copy "takes"
    1 ms, known at once.
    """

    def __init__(self, device: torch.device, non_blocking: object) -> None:
        pass

    def start(self, batch: Any) -> Any:
        return dk.to_device(batch, "cpu", copy=True)

    def hand_over(self, ticket: Any) -> Any:
        return ticket

    def consumer_done(self) -> None:
        pass

    def timer(self, ticket: Any) -> Callable[[bool], float | None]:
        return lambda wait: 0.001


def tensor_leaves(data: Any) -> Iterator[torch.Tensor]:
    """Every tensor in the data, in its containers' order, repeats included.

    Found by the tests' own reference walk, not by the code under test.
    """
    return tensors_of(data)


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


@pytest.fixture
def own_safe_globals() -> Iterator[None]:
    """PyTorch's default allowlist only, for the length of a test.

    Importing torch_geometric adds classes (defaultdict among them) to the process's
    safe globals: what a weights-only load refuses depends on what the process imported.
    """
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(added)
