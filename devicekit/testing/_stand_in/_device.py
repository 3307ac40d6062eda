"""What the stand-in is once started: its name, its devices, and each thread's current one."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

__all__ = ["Started", "current_index", "index_of", "set_current_index", "started"]


@dataclasses.dataclass(frozen=True)
class Started:
    """The stand-in this process runs: set once by ``stand_in()``."""

    name: str
    """Its device type, as ``torch.device`` takes it."""
    count: int
    """How many devices it has."""
    capacity: int | None
    """Bytes of memory per device; None for the host's."""


_started: list[Started] = []
_thread = threading.local()


def started() -> Started:
    """The started stand-in; a clear error where none is."""
    if not _started:
        msg = "The stand-in accelerator is not started: call devicekit.testing.stand_in() first."
        raise RuntimeError(msg)
    return _started[0]


def start(record: Started) -> None:
    """Record the stand-in as started (once per process)."""
    _started.append(record)


def current_index() -> int:
    """This thread's current device index, as CUDA keeps one per host thread."""
    return int(getattr(_thread, "index", 0))


def set_current_index(index: int) -> int:
    """Make ``index`` this thread's current device; the index it replaces."""
    check_index(index)
    before = current_index()
    _thread.index = index
    return before


def check_index(index: int) -> None:
    """Refuse an index the stand-in does not have, in CUDA's words."""
    count = started().count
    if not 0 <= index < count:
        msg = (
            f"{started().name} error: invalid device ordinal: expected an index from 0 to "
            f"{count - 1}, got {index}"
        )
        raise RuntimeError(msg)


def index_of(device: Any) -> int:
    """The index of a device given as None, an int, a string or a torch.device."""
    if device is None:
        return current_index()
    if isinstance(device, int):
        check_index(device)
        return device
    index: int | None = torch.device(device).index  # None for "standin", whatever the stubs say
    if index is None:
        return current_index()
    check_index(index)
    return index
