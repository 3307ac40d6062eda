"""guard and track_transfers on a real CUDA model."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

import devicekit as dk

pytestmark = pytest.mark.cuda


def test_guard_names_a_host_input_to_a_cuda_model() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    msg = "input is on cpu but the parameters of Sequential (e.g. 0.weight, 0.bias) are on cuda:"
    with dk.guard(model), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        model(torch.ones(1, 8))


def test_cuda_compares_as_the_current_device() -> None:
    tensor = torch.ones(1, device="cuda")
    assert dk.check_same_device(tensor, device="cuda") == tensor.device


def test_item_in_a_loop_is_caught_by_strict_mode() -> None:
    losses = [torch.rand((), device="cuda") for _ in range(3)]

    def log_losses() -> float:
        total = 0.0
        for loss in losses:
            total += loss.item()
        return total

    line = inspect.getsourcelines(log_losses)[1] + 3
    msg = f"but test_checks_cuda.py:{line} in log_losses copies 4 bytes from cuda:"
    with pytest.raises(dk.TransferError, match=re.escape(msg)), dk.track_transfers(strict=True):
        log_losses()


def test_track_transfers_counts_host_to_device_and_back() -> None:
    with dk.track_transfers() as log:
        on_device = dk.to_device({"x": torch.ones(256), "y": torch.ones(64)}, "cuda")
        on_device["x"].sum().item()
    directions = [(e.source.type, e.target.type, e.operation) for e in log.events]
    assert ("cuda", "cpu", "item") in directions
    assert any(source == "cpu" and target == "cuda" for source, target, _ in directions)
