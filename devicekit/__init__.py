"""devicekit: take device handling out of PyTorch training loops.

Pick the right accelerator, move anything to it (tensors, modules, optimizers,
arbitrarily nested batches), and explain device problems in the user's own terms.
"""

from devicekit._errors import (
    DeviceKitError,
    DeviceMismatchError,
    DeviceUnavailableError,
    TransferError,
)
from devicekit._transfer import register_transfer, to_device

__version__ = "0.1.0"

__all__ = [
    "DeviceKitError",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "TransferError",
    "__version__",
    "register_transfer",
    "to_device",
]
