"""``torch.save``/``torch.load`` of stand-in tensors, with ``map_location`` honoured as for a GPU.

A GPU tensor is saved as its storage's bytes and the storage's location (``"cuda:1"``);
``torch.load`` hands each storage to ``map_location``, then to the deserializer of the
location it ends at. A stand-in tensor has no storage of its own, so it is saved as its
CPU values, their storage tagged with the stand-in location; at load the tag goes
through ``map_location`` like a GPU's, and the deserializer notes where it ended: a
storage sent to the CPU stays a CPU tensor, one sent to the stand-in is wrapped again.
The rebuild function is allowed under ``weights_only=True``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.serialization

from devicekit.testing._stand_in._device import started

__all__ = ["reduce", "register"]

# Storages are told apart by their first byte, which a freed storage's successor may
# reuse: a saved one is kept with its values (dead once they are), and every storage
# torch.load restores overwrites what an earlier load said of its address.
_saving: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}  # first byte -> values, location
_loaded: dict[int, torch.device | None] = {}  # first byte -> where torch.load put it


def _tag(storage: Any) -> str | None:
    if storage.device.type != "cpu":
        return None
    first = storage.data_ptr()
    values, location = _saving.get(first, (None, None))
    if values is None or values() is None:
        _saving.pop(first, None)
        return None
    return location


def _restore(storage: Any, location: str) -> Any:
    ours = location.startswith(started().name)
    _loaded[storage.data_ptr()] = torch.device(location) if ours else None
    return storage if ours else None


_wrap: list[Callable[[torch.Tensor, int], torch.Tensor]] = []  # StandInTensor, once registered


def rebuild_stand_in(values: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A saved stand-in tensor, where ``torch.load`` put its storage (pickled positionally)."""
    device = _loaded.get(values.untyped_storage().data_ptr())
    rebuilt = values if device is None else _wrap[0](values, device.index or 0)
    return rebuilt.requires_grad_(requires_grad)


def reduce(tensor: Any) -> tuple[Any, ...]:
    """What pickling a stand-in tensor writes: its values, tagged with its location."""
    values = tensor._data
    _saving[values.untyped_storage().data_ptr()] = (weakref.ref(values), str(tensor.device))
    return (rebuild_stand_in, (values, tensor.requires_grad))


def register(wrap: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """Teach ``torch.save``/``torch.load`` the stand-in's location (once, at start).

    ``wrap(values, index)`` puts loaded values on device ``index``.
    """
    _wrap.append(wrap)
    torch.serialization.register_package(1, _tag, _restore)
    torch.serialization.add_safe_globals([rebuild_stand_in])
