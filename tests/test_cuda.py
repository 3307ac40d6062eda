"""to_device on a real CUDA device: packing, non_blocking safety, modules and optimizers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk

from .helpers import tensor_leaves

pytestmark = pytest.mark.cuda


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _per_image_batch() -> list[dict[str, Any]]:
    return [
        {
            "image": torch.randn(3, 8, 8),
            "boxes": torch.rand(4, 4),
            "labels": torch.arange(4),
            "id": i,
        }
        for i in range(64)
    ]


def test_small_tensors_travel_packed_with_their_values(cuda: torch.device) -> None:
    batch = _per_image_batch()
    moved = dk.to_device(batch, cuda)
    assert all(t.device == cuda for t in tensor_leaves(moved))
    for before, after in zip(tensor_leaves(batch), tensor_leaves(moved), strict=True):
        assert after.dtype == before.dtype
        assert torch.equal(after.cpu(), before)
    # The packed tensors are views of one device buffer.
    storages = {t.untyped_storage().data_ptr() for t in tensor_leaves(moved)}
    assert len(storages) == 1


def test_packing_keeps_aliasing_and_casts_dtype(cuda: torch.device) -> None:
    shared = torch.randn(5)
    moved = dk.to_device({"a": shared, "b": [shared, torch.arange(3)]}, cuda, dtype=torch.float16)
    assert moved["a"] is moved["b"][0]
    assert moved["a"].dtype == torch.float16
    assert moved["b"][1].dtype == torch.int64
    assert torch.equal(moved["a"].cpu(), shared.half())


def test_a_thousand_small_tensors_arrive_intact(cuda: torch.device) -> None:
    leaves = [torch.full((1024,), float(i)) for i in range(1000)]
    moved = dk.to_device(leaves, cuda)
    torch.testing.assert_close(torch.stack(moved).cpu(), torch.stack(leaves))


def test_device_to_host_auto_is_safe_to_read_at_once(cuda: torch.device) -> None:
    # The hazard of the PyTorch pinning tutorial: a non_blocking device->host copy read
    # before it completes. "auto" must wait once before returning.
    for trial in range(1000):
        source = torch.full((1 << 16,), float(trial), device=cuda)
        torch.cuda._sleep(10_000)  # keep the stream busy so an early read would see garbage
        moved = dk.to_device({"x": source}, "cpu")["x"]
        assert bool((moved == trial).all()), trial


def test_modules_and_optimizers_move_to_cuda(cuda: torch.device) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    dk.to_device(model, cuda)
    dk.to_device(optimizer, cuda)
    state = optimizer.state[model.weight]
    assert model.weight.device == cuda
    assert state["exp_avg"].device == cuda
    assert state["step"].device == torch.device("cpu")
    optimizer.step()  # the classic resume bug would raise here


def test_requires_grad_tensors_keep_their_graph(cuda: torch.device) -> None:
    weight = torch.ones(3, requires_grad=True)
    moved = dk.to_device([weight, torch.ones(3)], cuda)
    moved[0].sum().backward()
    assert weight.grad is not None
