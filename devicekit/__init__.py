"""devicekit: take device handling out of PyTorch training loops.

Pick the right accelerator, move anything to it (tensors, modules, optimizers,
arbitrarily nested batches), and explain device problems in the user's own terms.
"""

import importlib
import typing

from devicekit._backends import Backend, DeviceInfo, GpuProcess
from devicekit._checks import check_same_device, find_devices, find_unmoved
from devicekit._current import current_device
from devicekit._errors import (
    DeviceKitError,
    DeviceMismatchError,
    DeviceUnavailableError,
    TransferError,
)
from devicekit._guard import GuardHandle, guard
from devicekit._kinds import register_transfer, unregister_transfer
from devicekit._loader import DeviceDataLoader
from devicekit._manager import DeviceManager
from devicekit._stats import LoaderStats
from devicekit._transfer import to_device

if typing.TYPE_CHECKING:
    from devicekit._audit import TransferEvent, TransferLog, track_transfers
    from devicekit._checkpoint import load, save
    from devicekit._materialize import materialize
    from devicekit._memory import BatchFit, fit_batch

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
# (docs/background/performance.rst).
_ON_FIRST_USE = {
    "TransferEvent": "_audit",
    "TransferLog": "_audit",
    "track_transfers": "_audit",
    "load": "_checkpoint",
    "save": "_checkpoint",
    "BatchFit": "_memory",
    "fit_batch": "_memory",
    "materialize": "_materialize",
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
