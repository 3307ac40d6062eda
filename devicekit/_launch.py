"""What launchers tell a process about its place: its local rank, and the devices it sees.

Read from the environment, parsed once here: the manager's rules for ``LOCAL_RANK`` and
the variables that give each process its own devices (``CUDA_VISIBLE_DEVICES`` and the
like) read these functions, never ``os.environ`` directly.
"""

from __future__ import annotations

import os
from typing import Final

from devicekit._devices import shown

__all__ = [
    "VISIBILITY_VARIABLES",
    "devicekit_device",
    "local_rank",
    "local_world_size",
    "visibility_set",
]

VISIBILITY_VARIABLES: Final = {
    "cuda": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    "xpu": ("ZE_AFFINITY_MASK",),
}
"""The variables that give a process its own devices, by device type."""


def devicekit_device() -> str:
    """``DEVICEKIT_DEVICE``, stripped: the device every entry point uses; "" where unset."""
    return os.environ.get("DEVICEKIT_DEVICE", "").strip()


def visibility_set(device_type: str) -> bool:
    """Whether this process was given its own devices (CUDA_VISIBLE_DEVICES and the like)."""
    return any(os.environ.get(name) for name in VISIBILITY_VARIABLES.get(device_type, ()))


def whole_number(value: str) -> int | None:
    """``value`` as a small whole number (ASCII digits, as launchers write them), or None.

    >>> whole_number(" 3 "), whole_number("-1"), whole_number("٣")
    (3, None, None)
    """
    value = value.strip()
    return int(value) if value.isascii() and value.isdecimal() and len(value) <= 9 else None


def local_world_size() -> int | None:
    """Torchrun's LOCAL_WORLD_SIZE, the processes on this node; None where unset or odd."""
    return whole_number(os.environ.get("LOCAL_WORLD_SIZE", ""))


def local_rank() -> int | None:
    """This process's rank on its node (torchrun's LOCAL_RANK); None where unset.

    Raises:
        ValueError: LOCAL_RANK is set but not a whole number of 0 or more.
    """
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        return None
    rank = whole_number(value)
    if rank is None:
        msg = (
            "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, "
            f"got {shown(value)}."
        )
        raise ValueError(msg)
    return rank
