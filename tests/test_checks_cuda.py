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


@pytest.mark.usefixtures("watchdog")
def test_copies_asked_to_be_non_blocking_that_block_are_marked() -> None:
    pageable = torch.ones(1024, 1024)
    pinned = torch.ones(1024, 1024).pin_memory()
    target = torch.empty(1024, 512, device="cuda")
    with dk.track_transfers() as log:
        pageable.to("cuda", non_blocking=True)  # staged by the driver: the host waits
        pinned.to("cuda", non_blocking=True)  # overlaps
        pinned[:, ::2].to("cuda", non_blocking=True)  # made contiguous, pageable, first
        target.copy_(pinned[:, ::2], non_blocking=True)
        pinned.t().to("cuda", non_blocking=True)  # dense: copied as it lies
    torch.cuda.synchronize()
    assert [event.blocked for event in log.events] == [
        "pageable",
        None,
        "non-contiguous",
        "non-contiguous",
        None,
    ]


@pytest.mark.usefixtures("watchdog")
def test_a_host_result_read_before_its_copy_finished_is_marked() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    with dk.track_transfers() as log:
        for _ in range(40):  # some 100 ms of work on an H100, queued ahead of the copies
            y = x @ x
        early = y[0].to("cpu", non_blocking=True)  # small: pinning it takes no time
        early.sum()  # read while the device is still multiplying
        read = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
        late = y[0].to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        late.sum()  # read after a synchronize: fine
        waited = y[0].to("cpu", non_blocking=True)
        done = torch.Event(device=y.device)
        done.record()
        done.synchronize()
        waited.sum()
    assert [(e.operation, e.lineno, e.blocked) for e in log.early_reads] == [
        ("sum", read, "read early")
    ]
    assert log.early_reads[0].source == y.device
