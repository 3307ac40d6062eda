"""``torch.<name>``: the stand-in's device module, shaped as ``torch.cuda`` where a loop reads it.

PyTorch reaches a PrivateUse1 backend through its module (``torch.manual_seed``,
autocast, ``DataLoader(pin_memory=True)``), and ``torch.accelerator``'s functions are
pointed here when the stand-in starts (:func:`devicekit.testing.stand_in`): its C++ side
knows one device, no streams and no memory figures for a Python backend.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from devicekit.testing._stand_in import _memory, _streams
from devicekit.testing._stand_in._device import current_index, index_of, set_current_index, started
from devicekit.testing._stand_in._memory import host_register, host_unregister
from devicekit.testing._stand_in._streams import Event, Stream

__all__ = [
    "Event",
    "Stream",
    "current_device",
    "current_stream",
    "default_stream",
    "device_count",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_device_name",
    "host_register",
    "host_unregister",
    "is_available",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
    "set_device",
    "set_per_process_memory_fraction",
    "set_stream",
    "stream",
    "synchronize",
]


def is_available() -> bool:
    """Always: the stand-in runs on the CPU."""
    return True


def is_initialized() -> bool:
    """Always: there is nothing to start."""
    return True


def _is_in_bad_fork() -> bool:
    return False  # no driver state for a forked child to inherit


def device_count() -> int:
    """How many devices ``stand_in(devices=...)`` made."""
    return started().count


def current_device() -> int:
    """This thread's current device index."""
    return current_index()


def set_device(device: Any) -> None:
    """Make ``device`` this thread's current device."""
    set_current_index(index_of(device))


def get_device_name(device: Any = None) -> str:
    """``"devicekit stand-in (CPU-backed)"``, for every index."""
    index_of(device)
    return "devicekit stand-in (CPU-backed)"


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes autocast accepts here, as on CUDA."""
    return [torch.float16, torch.bfloat16]


def manual_seed(seed: int) -> None:
    """Nothing to seed: random numbers on the stand-in come from the CPU's generator."""


def manual_seed_all(seed: int) -> None:
    """Nothing to seed: random numbers on the stand-in come from the CPU's generator."""


def synchronize(device: Any = None) -> None:
    """Wait for everything issued to every stream of ``device``."""
    _streams.synchronize_device(index_of(device))


def current_stream(device: Any = None) -> Stream:
    """This thread's current stream on ``device``."""
    return _streams.current_stream(index_of(device))


def default_stream(device: Any = None) -> Stream:
    """The default stream of ``device``."""
    return _streams.stream_of(index_of(device), 0)


def set_stream(stream: Stream) -> None:
    """Make ``stream`` this thread's current stream on its device."""
    _streams.set_current(int(stream.device_index), int(stream.stream_id))


@contextlib.contextmanager
def stream(chosen: Stream | None) -> Iterator[None]:
    """Make ``chosen`` current within the block, as ``torch.cuda.stream`` does."""
    if chosen is None:
        yield
        return
    with chosen:
        yield


def memory_allocated(device: Any = None) -> int:
    """Bytes held by live tensors of ``device``."""
    return _memory.memory(index_of(device)).allocated


def max_memory_allocated(device: Any = None) -> int:
    """The most bytes held at once since the last reset."""
    return _memory.memory(index_of(device)).peak


def memory_reserved(device: Any = None) -> int:
    """Bytes held or kept for reuse, as a caching allocator reserves them."""
    return _memory.memory(index_of(device)).reserved


def max_memory_reserved(device: Any = None) -> int:
    """The most bytes reserved at once since the last reset."""
    return _memory.memory(index_of(device)).peak_reserved


def reset_peak_memory_stats(device: Any = None) -> None:
    """Start the peaks again from the current figures."""
    figures = _memory.memory(index_of(device))
    figures.peak, figures.peak_reserved = figures.allocated, figures.reserved


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes: the capacity less what is reserved, and the capacity."""
    figures = _memory.memory(index_of(device))
    return figures.capacity - figures.reserved, figures.capacity


def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
    """The figures under ``torch.cuda.memory_stats``'s names."""
    return OrderedDict(sorted(_memory.memory(index_of(device)).figures().items()))


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Let this process allocate ``fraction`` of ``device``'s capacity (1.0: all of it)."""
    if not 0 <= fraction <= 1:
        msg = f"Expected a fraction from 0 to 1, got {fraction!r}."
        raise ValueError(msg)
    figures = _memory.memory(index_of(device))
    figures.limit = None if fraction == 1 else int(figures.capacity * fraction)


def empty_cache() -> None:
    """Give back what every device reserved and no tensor holds."""
    for index in range(started().count):
        _memory.empty_cache(index)
