"""track_transfers on the CPU, with meta as the second device: what it counts, says and refuses."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import re
import sysconfig
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._base import DispatchMode, _frames
from devicekit._checks import _audit

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


# A system Python (Debian's /usr/lib/python3.11, a conda base) keeps installed packages
# beneath the standard library's folder: their copies are theirs, not the caller's.


def _module_at(path: Path) -> ModuleType:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("def step(tensor):\n    return tensor.to('meta')\n")
    spec = importlib.util.spec_from_file_location(f"copies_{path.parent.name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("packages", ["site-packages", "dist-packages", "vendored"])
def test_copies_in_packages_beneath_the_standard_library_are_blamed_on_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packages: str
) -> None:
    stdlib = tmp_path / "lib" / "python3.11"  # a system Python's layout, simulated
    monkeypatch.setattr(_frames, "_OWN_FOLDERS", (*_frames._OWN_FOLDERS, f"{stdlib}{os.sep}"))
    if packages == "vendored":  # a folder of packages known by sysconfig or site, not by name
        folders = (*_frames._PACKAGE_FOLDERS, f"{stdlib / packages}{os.sep}")
        monkeypatch.setattr(_frames, "_PACKAGE_FOLDERS", folders, raising=False)
    standard = _module_at(stdlib / "standard" / "copies.py")
    installed = _module_at(stdlib / packages / "installed" / "copies.py")
    with dk.track_transfers() as log:
        standard.step(torch.ones(1))  # the standard library's frame: the caller is blamed
        installed.step(torch.ones(1))
    assert [event.filename for event in log.events] == [
        __file__,
        str(stdlib / packages / "installed" / "copies.py"),
    ]
    assert log.events[1].where == "copies.py:2 in step"


def test_the_folders_of_installed_packages_are_never_skipped() -> None:
    for kind in ("purelib", "platlib"):
        assert not _frames.is_library(os.path.join(sysconfig.get_path(kind), "pkg", "mod.py"))
    assert _frames.is_library(os.path.join(os.path.dirname(torch.__file__), "nn", "mod.py"))
    assert _frames.is_library(os.path.join(os.path.dirname(re.__file__), "re", "mod.py"))


# Copies asked to be non-blocking that block, and host results read before their copy
# finished: classified by a pure rule, then seen end to end through stand-ins for the
# machine (meta as the accelerator, pinned memory known by its address, a stream whose
# events finish when it is synchronized).

H2D, D2H = False, True


@pytest.mark.parametrize(
    ("to_host", "non_blocking", "pinned", "as_it_lies", "expected"),
    [
        (H2D, False, False, True, None),  # blocking asked: nothing to mark
        (H2D, False, True, False, None),
        (H2D, True, False, True, _audit.PAGEABLE),
        (H2D, True, False, False, _audit.PAGEABLE),  # pinning it makes it contiguous too
        (H2D, True, True, False, _audit.NON_CONTIGUOUS),
        (H2D, True, True, True, None),  # overlaps, as asked
        (D2H, False, False, True, None),
        (D2H, False, True, True, None),
        (D2H, True, False, True, _audit.PAGEABLE),  # into pageable memory the host waits
        (D2H, True, True, False, _audit.NON_CONTIGUOUS),
        (D2H, True, True, True, _audit.UNFINISHED),  # returns before its result is there
    ],
)
def test_a_copy_is_classified_by_its_direction_and_its_host_memory(
    to_host: bool, non_blocking: bool, pinned: bool, as_it_lies: bool, expected: str | None
) -> None:
    got = _audit.classify(to_host, non_blocking=non_blocking, pinned=pinned, as_it_lies=as_it_lies)
    assert got == expected


class Pinned:
    """Stands in for pinned memory where nothing can be pinned: known by its address."""

    def __init__(self) -> None:
        self.addresses: set[int] = set()
        self.kept: list[torch.Tensor] = []  # alive, so that no address is reused

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.clone()
        self.kept.append(pinned)
        self.addresses.add(pinned.untyped_storage().data_ptr())
        return pinned

    def result(self, tensor: torch.Tensor) -> torch.Tensor:
        """Take ``tensor`` as pinned while it lives: a copy's result, which must not be kept."""
        address = tensor.untyped_storage().data_ptr()
        self.addresses.add(address)
        weakref.finalize(tensor, self.addresses.discard, address)
        return tensor

    def __call__(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.addresses  # views of it too


class Stream:
    """Stands in for the device's stream: an event recorded on it is passed at a synchronize."""

    def __init__(self) -> None:
        self.recorded = 0
        self.passed = 0

    def record_event(self, device: torch.device) -> Callable[[], bool]:
        self.recorded += 1
        mark = self.recorded
        return lambda: self.passed >= mark

    def synchronize(self) -> None:
        self.passed = self.recorded


class MetaMemory(DispatchMode):  # type: ignore[misc, no-untyped-call]  # an untyped base
    """Stands in for device memory beneath track_transfers: meta copied to the host reads zeros.

    A non-blocking copy's result is pinned, as PyTorch pins that of ``.to("cpu",
    non_blocking=True)`` from CUDA.
    """

    def __init__(self, pinned: Pinned) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.pinned = pinned

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        to_host = kwargs.get("device") == CPU
        if func is torch.ops.aten._to_copy.default and args[0].is_meta and to_host:
            zeros = torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            return self.pinned.result(zeros) if kwargs.get("non_blocking") else zeros
        if func is torch.ops.aten.copy_.default and args[0].is_cpu and args[1].is_meta:
            return args[0].zero_()
        return func(*args, **kwargs)


@pytest.fixture
def machine() -> Iterator[tuple[Pinned, Stream]]:
    """Meta as an accelerator with streams, stand-ins for pinned memory and the stream."""
    pinned, stream = Pinned(), Stream()
    stand_in = _audit.Machine(
        pinned=pinned,
        streamed=lambda device: device.type == "meta",
        record_event=stream.record_event,
    )
    with MetaMemory(pinned), _audit.stand_in(stand_in):
        yield pinned, stream


def test_copies_to_the_device_asked_to_be_non_blocking_that_block_are_marked(
    machine: tuple[Pinned, Stream],
) -> None:
    pinned, _ = machine
    pageable = torch.ones(4, 6)
    host = pinned.pin(pageable)
    target = torch.empty(4, 3, device="meta")
    with dk.track_transfers() as log:
        pageable.to(META, non_blocking=True)  # pageable
        host.to(META, non_blocking=True)  # pinned, contiguous: overlaps
        host.t().to(META, non_blocking=True)  # dense: .to() keeps its strides
        host[:, ::2].to(META, non_blocking=True)  # a view with gaps: staged
        target.copy_(host[:, ::2], non_blocking=True)
        alike = torch.empty(3, 4, device="meta").t()
        alike.copy_(pinned.pin(torch.ones(3, 4)).t(), non_blocking=True)  # dense and alike
        pageable.to(META)  # blocking asked: it blocks, as asked
        dk.to_device(pageable, META, non_blocking=True)
    assert [(event.operation, event.blocked) for event in log.events] == [
        ("to", "pageable"),
        ("to", None),
        ("to", None),
        ("to", "non-contiguous"),
        ("copy_", "non-contiguous"),
        ("copy_", None),
        ("to", None),
        ("to", "pageable"),
    ]
    assert log.early_reads == []


def test_the_summary_names_the_first_blocked_copy_and_the_fix(
    machine: tuple[Pinned, Stream],
) -> None:
    pinned, _ = machine
    with dk.track_transfers() as log:
        pinned.pin(torch.ones(2, 4))[:, ::2].to(META, non_blocking=True)
    line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    name = "test_the_summary_names_the_first_blocked_copy_and_the_fix"
    assert str(log).splitlines()[-1] == (
        f"1 copies asked to be non-blocking blocked: first at test_audit.py:{line} in {name} "
        "(its host memory is a non-contiguous view of pinned memory, which PyTorch first "
        "copies into pageable memory, so the host waits for it: call .contiguous() before "
        "pinning)."
    )


def test_strict_mode_says_why_a_copy_asked_to_be_non_blocking_blocks(
    machine: tuple[Pinned, Stream],
) -> None:
    msg = (
        "copies 8 bytes from cpu to meta (to). Inside a training step such copies (.item(), "
        ".cpu(), printing a tensor) stall the device: move them out, or batch them. It was "
        "asked to be non-blocking, yet blocks: its host memory is pageable, not pinned, so "
        "the host waits for it: pin it (tensor.pin_memory(), torch.empty(..., "
        "pin_memory=True), or let dk.DeviceDataLoader pin the batches)."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)), dk.track_transfers(strict=True):
        torch.ones(2).to(META, non_blocking=True)


def test_a_host_result_read_before_its_copy_finished_is_marked_at_the_read(
    machine: tuple[Pinned, Stream],
) -> None:
    _, stream = machine
    on_device = torch.empty(3, device="meta")
    with dk.track_transfers() as log:
        early = on_device.to(CPU, non_blocking=True)
        early + 1  # read at once: the copy may not have landed
        read = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
        early + 1  # marked once, at the first read
        waited = on_device.to(CPU, non_blocking=True)
        stream.synchronize()
        waited + 1
        blocking = on_device.to(CPU)
        blocking + 1
    assert [(e.operation, e.lineno, e.blocked) for e in log.early_reads] == [
        ("add", read, "read early")
    ]
    assert (log.early_reads[0].source, log.early_reads[0].nbytes) == (META, 12)
    assert log.count == 3  # the reads are no transfers
    assert str(log).splitlines()[-1] == (
        "1 results of non-blocking copies read before the copy finished: first at "
        f"test_audit.py:{read} in "
        "test_a_host_result_read_before_its_copy_finished_is_marked_at_the_read (the copy "
        "returns at once and its result lands later, so this read may see unfinished data: "
        "synchronize (torch.cuda.synchronize(), or an event recorded after the copy) before "
        "reading the result)."
    )


@pytest.mark.parametrize(
    ("read", "operation"),
    [
        (lambda host: host.sum().item(), "sum"),
        (lambda host: host[0].item(), "item"),  # taking the view reads nothing; item does
        (lambda host: torch.cat([torch.ones(1), host]), "cat"),  # a list of inputs
        (lambda host: host.numpy(), "detach"),  # numpy reads through a detach, its only trace
        (lambda host: float(host[0]), "item"),
    ],
)
def test_each_way_of_reading_the_result_is_seen(
    machine: tuple[Pinned, Stream], read: Callable[[torch.Tensor], Any], operation: str
) -> None:
    with dk.track_transfers() as log:
        read(torch.empty(3, device="meta").to(CPU, non_blocking=True))
    assert [event.operation for event in log.early_reads] == [operation]


def test_an_item_read_early_is_named_as_users_write_it(machine: tuple[Pinned, Stream]) -> None:
    with dk.track_transfers() as log:
        torch.empty((), device="meta").to(CPU, non_blocking=True).item()
    assert [event.operation for event in log.early_reads] == ["item"]


def test_a_copy_into_host_memory_is_watched_only_where_it_is_asynchronous(
    machine: tuple[Pinned, Stream],
) -> None:
    pinned, stream = machine
    on_device = torch.empty(2, 3, device="meta")
    buffer = pinned.pin(torch.empty(2, 3))
    pageable = torch.empty(2, 3)
    strided = pinned.pin(torch.empty(3, 2)).t()  # pinned, laid out unlike the source
    with dk.track_transfers() as log:
        buffer.copy_(on_device, non_blocking=True)
        pageable.copy_(on_device, non_blocking=True)  # the host waits: safe, and marked
        strided.copy_(on_device, non_blocking=True)
        buffer.sum(), pageable.sum(), strided.sum()
        stream.synchronize()
    assert [event.blocked for event in log.events] == [None, "pageable", "non-contiguous"]
    assert [event.operation for event in log.early_reads] == ["sum"]


def test_copies_from_or_into_a_watched_result_are_the_device_s_not_reads(
    machine: tuple[Pinned, Stream],
) -> None:
    pinned, stream = machine
    on_device = torch.empty(3, device="meta")
    buffer = pinned.pin(torch.empty(3))
    with dk.track_transfers() as log:
        buffer.copy_(on_device, non_blocking=True)
        buffer.copy_(on_device, non_blocking=True)  # the buffer reused: after, on the stream
        buffer.to(META, non_blocking=True)  # sent back: read by the device, on the stream
        buffer.to(torch.float64)  # the host reads it
    assert [(event.operation, event.blocked) for event in log.early_reads] == [("to", "read early")]
    assert stream.recorded == 2


def test_a_read_through_a_view_taken_before_the_copy_is_marked(
    machine: tuple[Pinned, Stream],
) -> None:
    pinned, stream = machine
    on_device = torch.empty(2, 3, device="meta")
    buffer = pinned.pin(torch.empty(2, 3))
    row = buffer[1]  # taken before the copy: it shares the memory the copy writes
    with dk.track_transfers() as log:
        buffer.copy_(on_device, non_blocking=True)
        row.sum()  # reads the destination before synchronising
        read = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
        stream.synchronize()
    assert [(e.operation, e.lineno, e.blocked) for e in log.early_reads] == [
        ("sum", read, "read early")
    ]


def test_views_taken_before_the_synchronize_and_read_after_it_are_not_marked(
    machine: tuple[Pinned, Stream],
) -> None:
    pinned, stream = machine
    on_device = torch.empty(2, 3, device="meta")
    buffer = pinned.pin(torch.empty(2, 3))
    with dk.track_transfers() as log:
        result = on_device.to(CPU, non_blocking=True)
        first, flat, rows, last = result[0], result.view(-1), result.unbind(0), result[1, 2]
        buffer.copy_(on_device, non_blocking=True)
        column = buffer[:, 1].t()
        stream.synchronize()  # every view is read after this: all correct
        first.sum(), flat.sum(), rows[1].sum(), last.item(), column.sum()
    assert log.early_reads == []
    assert stream.recorded == 2


def test_a_copy_refused_by_strict_mode_stays_in_the_log_when_the_error_is_caught() -> None:
    with dk.track_transfers(strict=True) as log:
        with contextlib.suppress(dk.TransferError):  # a caller that catches it and goes on
            torch.ones(2).to(META)
        line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    name = "test_a_copy_refused_by_strict_mode_stays_in_the_log_when_the_error_is_caught"
    assert [(e.operation, e.refused, e.lineno) for e in log.events] == [("to", True, line)]
    assert str(log) == (
        "1 transfer(s) between devices, 8 bytes in all:\n"
        f"  cpu -> meta: 1 (8 bytes), first at test_audit.py:{line} in {name}\n"
        f"1 refused by strict=True, each raising TransferError: first at test_audit.py:{line} "
        f"in {name}."
    )


def test_a_watched_result_is_not_kept_alive(machine: tuple[Pinned, Stream]) -> None:
    with dk.track_transfers() as log:
        result = torch.empty(3, device="meta").to(CPU, non_blocking=True)
        alive = weakref.ref(result)
        del result
        assert alive() is None
        torch.ones(3) + 1  # nothing watched is read: an id reused is no read either
    assert log.count == 1
    assert log.early_reads == []


def test_strict_mode_says_a_non_blocking_copy_to_the_host_must_be_waited_for(
    machine: tuple[Pinned, Stream],
) -> None:
    msg = (
        "copies 12 bytes from meta to cpu (to). Inside a training step such copies (.item(), "
        ".cpu(), printing a tensor) stall the device: move them out, or batch them. It was "
        "asked to be non-blocking: the copy returns at once and its result lands later, so "
        "this read may see unfinished data; synchronize (torch.cuda.synchronize(), or an event "
        "recorded after the copy) before reading the result."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)), dk.track_transfers(strict=True):
        torch.empty(3, device="meta").to(CPU, non_blocking=True)


def test_without_streams_nothing_is_marked() -> None:
    with dk.track_transfers() as log:  # meta is no accelerator here, nor pinned anything
        torch.ones(2).to(META, non_blocking=True)
    assert [event.blocked for event in log.events] == [None]
    assert "blocked" not in str(log)
