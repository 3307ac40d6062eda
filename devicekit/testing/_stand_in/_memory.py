"""The stand-in's memory: a capacity per device, CUDA's figures, and a ledger of pinned host memory.

Device memory is counted by storage: a tensor and its views hold one storage, counted
once, until the last of them is gone. ``reserved`` follows a caching allocator's rule
(it keeps what was freed until ``empty_cache()``, and gives it up before failing), so
``free`` is the capacity less what is reserved, as ``torch.cuda.mem_get_info`` reports.

Host memory is pinned two ways, and the ledger names both: ``tensor.pin_memory()``
(and a pinning DataLoader) gives a pinned copy, pinned while it lives; ``host_register``
page-locks memory the process already has, as ``cudaHostRegister`` does, pinned until
``host_unregister``: a registration nobody undoes is what :func:`still_pinned` names.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any

import torch

from devicekit._base import nbytes
from devicekit.testing._stand_in._device import started

__all__ = ["DeviceMemory", "charge", "host_register", "host_unregister", "memory", "still_pinned"]


@dataclasses.dataclass
class DeviceMemory:
    """One device's figures, in bytes."""

    capacity: int
    limit: int | None = None
    """The share of it this process may allocate (``set_per_process_memory_fraction``)."""
    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    peak_reserved: int = 0
    holders: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """Each live storage's first byte -> [its bytes, how many tensors hold it]."""

    def figures(self) -> dict[str, int]:
        """``memory_stats()``'s names for the figures."""
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak_reserved,
        }


_devices: list[DeviceMemory] = []


def start(count: int, capacity: int) -> None:
    """Give each of ``count`` devices ``capacity`` bytes."""
    _devices.extend(DeviceMemory(capacity) for _ in range(count))


def memory(index: int) -> DeviceMemory:
    """The figures of device ``index``."""
    return _devices[index]


def charge(index: int, data: torch.Tensor) -> None:
    """Count ``data``'s storage against device ``index`` while ``data`` lives.

    Watched through ``data`` (the CPU tensor inside), never through the stand-in tensor:
    a tensor with a weak reference cannot be swapped, and ``Module.to`` swaps.

    Raises:
        torch.OutOfMemoryError: The storage is new and does not fit, as CUDA raises it.
    """
    storage = data.untyped_storage()
    first, size = storage.data_ptr(), storage.nbytes()
    if size == 0:
        return
    device = _devices[index]
    held = device.holders.get(first)
    if held is None:
        if device.allocated + size > (device.capacity if device.limit is None else device.limit):
            _refuse(index, device, size)
        held = device.holders[first] = [size, 0]
        device.allocated += size
        device.peak = max(device.peak, device.allocated)
        device.reserved = max(device.reserved, device.allocated)
        device.peak_reserved = max(device.peak_reserved, device.reserved)
    held[1] += 1
    weakref.finalize(data, _release, device, first)


def _release(device: DeviceMemory, first: int) -> None:
    held = device.holders.get(first)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del device.holders[first]
        device.allocated -= held[0]


def empty_cache(index: int) -> None:
    """Give back what is reserved but not allocated (``empty_cache()``)."""
    device = _devices[index]
    device.reserved = device.allocated


def _refuse(index: int, device: DeviceMemory, size: int) -> None:
    free = device.capacity - device.allocated
    allowed = (
        "set by stand_in(memory=...)"
        if device.limit is None
        else f"limited to {nbytes(device.limit)} by set_per_process_memory_fraction"
    )
    msg = (
        f"{started().name} out of memory. Tried to allocate {nbytes(size)}. Device {index} has "
        f"a total capacity of {nbytes(device.capacity)} of which {nbytes(free)} is free. Of the "
        f"allocated memory {nbytes(device.allocated)} is allocated by PyTorch. (The stand-in "
        f"accelerator's capacity, {allowed}.)"
    )
    device.reserved = device.allocated  # a caching allocator frees its cache before failing
    raise torch.OutOfMemoryError(msg)


@dataclasses.dataclass(frozen=True)
class _Pinned:
    size: int
    how: str


_pinned: dict[int, _Pinned] = {}


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.pin_memory()``: a copy, in the ledger while its storage lives."""
    copy = torch.empty_like(tensor, memory_format=torch.preserve_format)
    copy.copy_(tensor)
    storage = copy.untyped_storage()
    first = storage.data_ptr()
    _pinned[first] = _Pinned(storage.nbytes(), "pinned by tensor.pin_memory()")
    weakref.finalize(copy, _pinned.pop, first, None)
    return copy


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor's memory is pinned or registered (``tensor.is_pinned()``)."""
    return tensor.untyped_storage().data_ptr() in _pinned


def host_register(tensor: torch.Tensor) -> None:
    """Page-lock a CPU tensor's memory in place, as ``cudaHostRegister`` does.

    Raises:
        RuntimeError: It is registered already (CUDA's error 712).
    """
    storage = tensor.untyped_storage()
    first = storage.data_ptr()
    if first in _pinned:
        msg = (
            "host_register failed: part or all of the memory is registered already (CUDA error 712)"
        )
        raise RuntimeError(msg)
    _pinned[first] = _Pinned(storage.nbytes(), "registered by host_register")


def host_unregister(tensor: Any) -> None:
    """Undo :func:`host_register`.

    Raises:
        RuntimeError: It is not registered (CUDA's error 713).
    """
    first = tensor.untyped_storage().data_ptr()
    found = _pinned.get(first)
    if found is None or not found.how.startswith("registered"):
        msg = "host_unregister failed: the memory is not registered (CUDA error 713)"
        raise RuntimeError(msg)
    del _pinned[first]


def registered_at_exit() -> None:
    """Name, on stderr, the registrations the process ends with (the stand-in stops then)."""
    left = [line for line in still_pinned() if "registered by" in line]
    if left:
        lines = "".join(f"\n  {line}" for line in left)
        sys.stderr.write(f"devicekit stand-in: host memory still registered at exit:{lines}\n")


def still_pinned() -> list[str]:
    """The ledger: each block of host memory pinned or registered now, one line each.

    Memory registered and never unregistered stays pinned until the process ends, as
    it does with ``cudaHostRegister``; a pinned copy is listed while it lives.

    .. doctest::
       :skipif: True  # run by the tests, not the docs build, which it would change

       >>> import torch, devicekit.testing
       >>> name = devicekit.testing.stand_in()
       >>> pinned = torch.ones(1024).pin_memory()
       >>> [line for line in devicekit.testing.still_pinned() if line.startswith("4.0 KiB")]
       ['4.0 KiB at 0x..., pinned by tensor.pin_memory()']
    """
    return [f"{nbytes(block.size)} at {first:#x}, {block.how}" for first, block in _pinned.items()]
