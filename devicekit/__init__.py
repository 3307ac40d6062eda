"""devicekit: take device handling out of PyTorch training loops.

Pick the right accelerator, move anything to it (tensors, modules, optimizers,
arbitrarily nested batches), and explain device problems in the user's own terms.
"""

import importlib
import typing

from devicekit._base import (
    DeviceKitError,
    DeviceMismatchError,
    DeviceUnavailableError,
    TransferError,
    current_device,
)
from devicekit._checks import GuardHandle, check_same_device, find_devices, find_unmoved, guard
from devicekit._core import register_transfer, to_device, unregister_transfer
from devicekit._loader import DeviceDataLoader, LoaderStats
from devicekit._select import Backend, DeviceInfo, DeviceManager, GpuProcess

if typing.TYPE_CHECKING:
    from devicekit._checks._audit import TransferEvent, TransferLog, track_transfers
    from devicekit._files import load, save
    from devicekit._memory import BatchFit, fit_batch, materialize

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BatchFit",
    "DeviceDataLoader",
    "DeviceInfo",
    "DeviceKitError",
    "DeviceManager",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "GpuProcess",
    "GuardHandle",
    "LoaderStats",
    "TransferError",
    "TransferEvent",
    "TransferLog",
    "__version__",
    "check_same_device",
    "current_device",
    "find_devices",
    "find_unmoved",
    "fit_batch",
    "guard",
    "load",
    "materialize",
    "register_transfer",
    "save",
    "to_device",
    "track_transfers",
    "unregister_transfer",
]

# Imported on first use: a training step, a DataLoader worker or `devicekit info` rarely
# needs them, and together they cost a fifth of `import devicekit`
# (docs/background/performance.rst). Two parts whole, and one module of the checks,
# whose others every guarded forward needs.
_ON_FIRST_USE = {
    "TransferEvent": "_checks._audit",
    "TransferLog": "_checks._audit",
    "track_transfers": "_checks._audit",
    "load": "_files",
    "save": "_files",
    "BatchFit": "_memory",
    "fit_batch": "_memory",
    "materialize": "_memory",
}


def __getattr__(name: str) -> object:
    module = _ON_FIRST_USE.get(name)
    if module is None:
        msg = f"module 'devicekit' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(f"devicekit.{module}"), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_FIRST_USE))
