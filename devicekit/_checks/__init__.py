"""The checks, which name the user's own paths and layers.

``find_devices``, ``check_same_device`` and ``find_unmoved`` (checks), ``guard`` and its
account of a failed forward (guard, forward error), and ``track_transfers`` (audit,
loaded on first use).
"""

from devicekit._checks._checks import (
    check_same_device,
    describe_devices,
    find_devices,
    find_unmoved,
)
from devicekit._checks._guard import GuardHandle, guard

__all__ = [
    "GuardHandle",
    "check_same_device",
    "describe_devices",
    "find_devices",
    "find_unmoved",
    "guard",
]
