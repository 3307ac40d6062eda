"""The default device of devicekit's calls given ``device=None``: :func:`current_device`.

The rule, in one sentence: the innermost ``with manager:`` block of this thread or
asyncio task wins, while its manager is open; outside any block, the open managers the
program keeps are the default, in every thread, refused where they disagree; with none
open, ``DeviceManager.from_env()``'s process default.

A manager is *open* from the end of its constructor until :meth:`close` (which leaving
its last ``with`` block calls, in whatever thread) or its collection: :func:`mark_open`
keeps a weak reference to it, whose callback marks it closed, so a manager nobody holds
stops counting as soon as Python frees it. The mover, the loader and the checkpoints read
the default here, not knowing how devices are selected: the manager, imported with
devicekit, registers how the process default is found (:func:`register_process_default`).

A block is an entry of a context variable, and a context outlives a block that ends
elsewhere: a task or callback made inside the block copies it, a generator suspended
inside one leaves its entry in its caller's context, a block entered in one thread may
be left in another. So each entry is its manager's :class:`Scope`, which closing marks:
an entry of a closed scope is passed over, as if its block were not there, and a closed
manager is never the answer.

No lock guards the table of open managers: a fork can leave no lock of it held in the
child. Each change is one dict operation, atomic under the GIL, followed by a new
:data:`_change` token; a reader takes the token before it copies the table (one step
too), so a device it keeps for a token never outlives a later change.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextvars import ContextVar

import torch

from devicekit._base._errors import DeviceKitError
from devicekit._base._frames import caller
from devicekit._base._text import listing

__all__ = [
    "Scope",
    "current_device",
    "enter_block",
    "leave_block",
    "mark_closed",
    "mark_open",
    "open_managers",
    "register_process_default",
]


class Scope:
    """A manager's ``with`` blocks from its first entry until it closes, in every thread.

    Each block's entry in a context is the scope itself: ``blocks`` counts those open,
    across threads and tasks (the manager changes it, under its lock), and ``closed``
    says the manager closed since, which makes every entry of the scope pass over.
    """

    __slots__ = ("blocks", "closed", "device", "owner")

    def __init__(self, owner: object, device: torch.device) -> None:
        self.owner = owner
        self.device = device
        self.blocks = 0
        self.closed = False


# The `with manager:` blocks open in this thread or task, innermost last: each entry is
# its manager's scope, so a manager leaving removes its own entry, not the last.
_active: ContextVar[tuple[Scope, ...]] = ContextVar("devicekit_active", default=())

# The open managers: a weak reference to each, with its device and where it was made.
_open: dict[weakref.ref[object], tuple[torch.device, str]] = {}
# A new object at each change of _open; and the device the open managers agreed on at
# one of them (None: none open). Kept, since looking in the table every call took 0.6 us
# (to_device of a flat dict of 8 tensors, 4.5 us, took a fifth longer).
_change = object()
_found: tuple[object, torch.device | None] = (None, None)


def _unset() -> torch.device:
    msg = "devicekit._select._manager registers the process default device when it is imported."
    raise RuntimeError(msg)


_process_default: Callable[[], torch.device] = _unset


def register_process_default(find: Callable[[], torch.device]) -> None:
    """Find the device of the process-wide manager with ``find`` (devicekit._select's manager)."""
    global _process_default  # noqa: PLW0603 - set once, as the manager is imported
    _process_default = find


def enter_block(scope: Scope) -> None:
    """Make ``scope.device`` the default of this thread or task, until its owner leaves."""
    _active.set((*_active.get(), scope))


def leave_block(owner: object) -> Scope | None:
    """End ``owner``'s innermost block here; its scope, or None where it has none here.

    None: the block was entered in another context (a generator finished elsewhere), or
    it was left already.
    """
    active = _active.get()
    for position in range(len(active) - 1, -1, -1):
        if active[position].owner is owner:
            _active.set(active[:position] + active[position + 1 :])
            return active[position]
    return None


def mark_open(manager: object, device: torch.device) -> weakref.ref[object]:
    """Count ``manager`` open, with its ``device``, until :func:`mark_closed` or its collection.

    Returns:
        The weak reference that names it here: pass it to :func:`mark_closed`.
    """
    global _change  # noqa: PLW0603 - the token of the table's state, see the module
    reference = weakref.ref(manager, mark_closed)
    _open[reference] = (device, caller())
    _change = object()
    return reference


def mark_closed(reference: weakref.ref[object]) -> None:
    """Count the manager behind ``reference`` closed (a second call does nothing)."""
    global _change  # noqa: PLW0603 - see mark_open
    _open.pop(reference, None)
    _change = object()


def open_managers() -> list[object]:
    """The open managers, in the order they were made."""
    return [manager for reference in list(_open) if (manager := reference()) is not None]


def _agreed() -> torch.device | None:
    """The device every open manager chose, None where none is open; kept for this change.

    Raises:
        DeviceKitError: They chose different devices (never kept: asked again each call).
    """
    global _found  # noqa: PLW0603 - see _change
    change = _change  # before the table: a change after it makes this one stale
    managers = list(_open.values())
    devices = {device for device, _ in managers}
    if len(devices) <= 1:
        agreed = managers[0][0] if managers else None
        _found = (change, agreed)
        return agreed
    made = listing([f"{device} (made at {where})" for device, where in managers])
    # Where a manager is held by nothing the user can name (a reference cycle, a kept
    # traceback, a notebook's Out[]), close() on it is no way out: close_all() is.
    msg = (
        f"Expected the open DeviceManagers to agree on one device for a devicekit call "
        f"given no device, found {len(managers)} that chose different ones: {made}. Pass "
        "device= to the call, run it inside `with manager:` in this thread (a block applies "
        "only in the thread or asyncio task that entered it), or close() the managers you "
        "no longer use: devicekit.DeviceManager.close_all() closes every one, also those "
        "you no longer hold."
    )
    raise DeviceKitError(msg)


def current_device() -> torch.device:
    """The device devicekit calls use when given ``device=None``.

    An open DeviceManager (made, kept and not closed) is the device of every devicekit
    call given no device, in every thread; ``with manager:`` makes its manager the
    default inside the block, in its own thread or asyncio task, while the manager is
    open (a task made inside the block and run after the manager closed, for one, passes
    the block over). Open managers that chose different devices make a call outside any
    block refuse, rather than pick one (:meth:`~devicekit.DeviceManager.close_all` closes
    them all); with none open, the default is the device ``DeviceManager.from_env()``
    selects for the process (built once, on first use).

    >>> import devicekit as dk
    >>> manager = dk.DeviceManager("meta")
    >>> dk.current_device()
    device(type='meta')
    >>> with dk.DeviceManager("cpu"):
    ...     dk.current_device()
    device(type='cpu')
    >>> manager.close()
    >>> dk.current_device()
    device(type='cpu')

    Returns:
        The device.

    Raises:
        DeviceKitError: Outside ``with manager:``, open managers chose different devices.
        DeviceUnavailableError: With no manager open or entered, ``DEVICEKIT_DEVICE``
            names no device of this machine.
        ValueError: With no manager open or entered, the launcher's local rank is no
            whole number.
    """
    active = _active.get()
    if active:
        if not active[-1].closed:
            return active[-1].device
        # Blocks whose manager has closed since: passed over, as if they were not there.
        for scope in reversed(active):
            if not scope.closed:
                return scope.device
    change, device = _found
    if change is not _change:
        device = _agreed()
    return _process_default() if device is None else device
