"""The default device of devicekit's calls given ``device=None``: :func:`current_device`.

That is the device of the innermost ``with manager:`` block in this thread or asyncio
task (a :class:`~contextvars.ContextVar`, so each sees its own), else the one the
process-wide ``DeviceManager.from_env()`` chose. The mover, the loader and the
checkpoints read it here, without knowing how devices are selected: the manager
registers how the process default is found (:data:`process_default`) when it is
imported, which importing devicekit does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch

__all__ = ["current_device", "enter", "leave"]

# The `with manager:` blocks open in this thread or task, innermost last: each entry is
# (the manager, its device), so a manager leaving removes its own entry, not the last.
_active: ContextVar[tuple[tuple[object, torch.device], ...]] = ContextVar(
    "devicekit_active", default=()
)


def _unset() -> torch.device:
    msg = "devicekit._manager registers the process default device when it is imported."
    raise RuntimeError(msg)


process_default: Callable[[], torch.device] = _unset
"""The device of the process-wide manager, found once; set by devicekit._manager."""


def enter(owner: object, device: torch.device) -> None:
    """Make ``device`` the default of this thread or task, until ``owner`` leaves."""
    _active.set((*_active.get(), (owner, device)))


def leave(owner: object) -> bool:
    """End ``owner``'s innermost block; whether it has another one open here still."""
    active = _active.get()
    for position in range(len(active) - 1, -1, -1):
        if active[position][0] is owner:
            active = active[:position] + active[position + 1 :]
            _active.set(active)
            break
    return any(entry[0] is owner for entry in active)


def current_device() -> torch.device:
    """The device devicekit calls use when given ``device=None``.

    That is the device of the innermost ``with manager:`` block in this thread or
    asyncio task, else the one ``DeviceManager.from_env()`` selects for the process
    (built once, on first use).

    >>> import devicekit as dk
    >>> with dk.DeviceManager("meta"):
    ...     dk.current_device()
    device(type='meta')

    Returns:
        The device.

    Raises:
        DeviceUnavailableError: Outside ``with manager:``, ``DEVICEKIT_DEVICE`` names no
            device of this machine.
        ValueError: Outside ``with manager:``, the launcher's local rank is no whole number.
    """
    active = _active.get()
    if active:
        return active[-1][1]
    return process_default()
