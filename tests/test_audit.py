"""track_transfers on the CPU, with meta as the second device: what it counts, says and refuses."""

from __future__ import annotations

import inspect
import re
import threading

import pytest
import torch

import devicekit as dk

from .helpers import CPU, META


def test_track_transfers_counts_exactly_the_copies_inside_it() -> None:
    torch.ones(3).to("meta")  # outside: not counted
    with dk.track_transfers() as log:
        dk.to_device({"a": torch.ones(4), "b": [torch.ones(2, dtype=torch.float64)]}, "meta")
        target = torch.empty(3, device="meta")
        target.copy_(torch.ones(3))
        torch.ones(2).to("cpu")  # same device: no transfer
    torch.ones(3).to("meta")
    assert log.count == 3
    assert log.bytes == 16 + 16 + 12
    assert [(e.source, e.target, e.operation) for e in log.events] == [
        (CPU, META, "to"),
        (CPU, META, "to"),
        (CPU, META, "copy_"),
    ]
    assert all(e.filename == __file__ for e in log.events)


def test_track_transfers_watches_its_own_thread_as_documented() -> None:
    assert "Only the calling thread is watched" in (dk.track_transfers.__doc__ or "")
    with dk.track_transfers() as log:
        worker = threading.Thread(target=lambda: torch.ones(2).to("meta"))
        worker.start()
        worker.join()
        torch.ones(3).to("meta")
    assert log.count == 1  # this thread's copy, not the worker's


def test_the_summary_groups_by_direction() -> None:
    with dk.track_transfers() as log:
        torch.ones(256).to("meta")
    line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    assert str(log) == (
        "1 transfer(s) between devices, 1.0 KiB in all:\n"
        f"  cpu -> meta: 1 (1.0 KiB), first at test_audit.py:{line} in "
        "test_the_summary_groups_by_direction"
    )
    with dk.track_transfers() as empty:
        pass
    assert str(empty) == "No transfers between devices."


def test_strict_mode_points_at_the_line() -> None:
    def step() -> None:
        torch.ones(2).to("meta")

    line = inspect.getsourcelines(step)[1] + 1
    msg = f"but test_audit.py:{line} in step copies 8 bytes from cpu to meta (to)."
    with pytest.raises(dk.TransferError, match=re.escape(msg)), dk.track_transfers(strict=True):
        step()
