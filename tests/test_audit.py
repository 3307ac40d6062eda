"""track_transfers on the CPU, with meta as the second device: what it counts, says and refuses."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch

import devicekit as dk
from devicekit._base import _frames

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
