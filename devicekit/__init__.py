"""devicekit: take device handling out of PyTorch training loops.

Pick the right accelerator, move anything to it (tensors, modules, optimizers,
arbitrarily nested batches), and explain device problems in the user's own terms.
"""

from devicekit._backends import Backend, DeviceInfo
from devicekit._errors import (
    DeviceKitError,
    DeviceMismatchError,
    DeviceUnavailableError,
    TransferError,
)
from devicekit._loader import DeviceDataLoader
from devicekit._manager import DeviceManager, current_device
from devicekit._transfer import register_transfer, to_device

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "DeviceDataLoader",
    "DeviceInfo",
    "DeviceKitError",
    "DeviceManager",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "TransferError",
    "__version__",
    "current_device",
    "register_transfer",
    "to_device",
]
