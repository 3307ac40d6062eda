"""devicekit: take device handling out of PyTorch training loops.

Pick the right accelerator, move anything to it (tensors, modules, optimizers,
arbitrarily nested batches), and explain device problems in the user's own terms.
"""

from devicekit._audit import TransferEvent, TransferLog, track_transfers
from devicekit._backends import Backend, DeviceInfo, GpuProcess
from devicekit._checkpoint import load, save
from devicekit._checks import (
    GuardHandle,
    check_same_device,
    find_devices,
    find_unmoved,
    guard,
)
from devicekit._current import current_device
from devicekit._errors import (
    DeviceKitError,
    DeviceMismatchError,
    DeviceUnavailableError,
    TransferError,
)
from devicekit._kinds import register_transfer, unregister_transfer
from devicekit._loader import DeviceDataLoader
from devicekit._manager import DeviceManager
from devicekit._memory import BatchFit, fit_batch
from devicekit._stats import LoaderStats
from devicekit._transfer import to_device

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
    "register_transfer",
    "save",
    "to_device",
    "track_transfers",
    "unregister_transfer",
]
