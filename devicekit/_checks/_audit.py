"""track_transfers: every cross-device copy inside a block, with the user's line that made it.

A dispatch mode of PyTorch's sees each aten call. The three that move data between
devices are recorded: ``_to_copy`` (``.to()``, ``.cpu()``, ``.cuda()``), ``copy_``
between devices, and ``_local_scalar_dense`` on an accelerator (``.item()``, which also
waits for the device). The stack is read only for those.

Two kinds of copy asked to be non-blocking are marked, since nothing else sees them:

- copies that block anyway (:func:`classify`): a copy between the host and an
  accelerator with streams is asynchronous only from, or into, pinned memory that it
  reads or writes where it lies. From pageable memory the driver copies through a
  staging buffer and the host waits; from a non-contiguous view of pinned memory PyTorch
  first makes a contiguous copy, pageable, on the host. ``torch.cuda.set_sync_debug_mode``
  does not see them.
- reads of a host result before its copy finished: a non-blocking copy into pinned host
  memory returns at once. An event is recorded on the device's current stream after it
  and the result's storage watched through a weak reference; the first aten call that
  takes a tensor on that storage as an input asks the event whether the copy is done,
  which a synchronize of the device, stream or event in between also makes true. The
  storage, not the tensor, is what is read: a view of the destination taken before the
  copy reads what it writes. Taking a view reads nothing, so a view taken before the
  synchronize and read after it is right; ``detach`` is the exception, counted as a read,
  since ``.numpy()`` (and ``numpy.asarray``) hand numpy the memory through one and leave
  no other trace. Copies to and from the device are no reads: they follow the watched
  copy on its stream. What costs, only while a result is watched: a storage lookup for
  each tensor argument of each call (1.7 us a call of two tensors, against 0.7 us for
  looking up their ids, on a busy 2-core machine where the mode costs some 7 us a call).

What touches the machine (whether memory is pinned, whether a device has streams, the
event) sits in a :class:`Machine`, which the tests replace (:func:`stand_in`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from devicekit._base import DispatchMode, TransferError, flag, nbytes, new_event, user_frame

__all__ = [
    "NON_CONTIGUOUS",
    "PAGEABLE",
    "READ_EARLY",
    "UNFINISHED",
    "Machine",
    "TransferEvent",
    "TransferLog",
    "classify",
    "stand_in",
    "track_transfers",
]

_aten = torch.ops.aten

PAGEABLE = "pageable"
"""A copy asked to be non-blocking blocked: its host memory is pageable, not pinned."""
NON_CONTIGUOUS = "non-contiguous"
"""A copy asked to be non-blocking blocked: its host memory, pinned, is a non-contiguous view."""
READ_EARLY = "read early"
"""A host result of a non-blocking copy was read before the copy was known finished."""
UNFINISHED = "unfinished"
"""What :func:`classify` says of a truly asynchronous copy to the host: watch its result."""

# Why, and the fix, for each mark: in the strict error and the summary.
_WHY: dict[str | None, tuple[str, str]] = {
    PAGEABLE: (
        "its host memory is pageable, not pinned, so the host waits for it",
        (
            "pin it (tensor.pin_memory(), torch.empty(..., pin_memory=True), or let "
            "dk.DeviceDataLoader pin the batches)"
        ),
    ),
    NON_CONTIGUOUS: (
        (
            "its host memory is a non-contiguous view of pinned memory, which PyTorch first "
            "copies into pageable memory, so the host waits for it"
        ),
        "call .contiguous() before pinning",
    ),
    READ_EARLY: (
        "the copy returns at once and its result lands later, so this read may see unfinished data",
        (
            "synchronize (torch.cuda.synchronize(), or an event recorded after the copy) "
            "before reading the result"
        ),
    ),
}


def classify(to_host: bool, *, non_blocking: bool, pinned: bool, as_it_lies: bool) -> str | None:
    """What a copy between the host and an accelerator with streams asks of track_transfers.

    ``pinned`` and ``as_it_lies`` describe its host side (the source of a copy to the
    device, the result of one to the host): whether that memory is pinned, and whether
    the copy reads or writes it where it lies, with no staging copy on the host (it is
    contiguous, or laid out as the device's side). A copy asked to be non-blocking
    blocks without both: :data:`PAGEABLE`, :data:`NON_CONTIGUOUS`. With both, one to the
    device overlaps (None) and one to the host returns before its result is there
    (:data:`UNFINISHED`). A blocking copy asks nothing.

    >>> classify(False, non_blocking=True, pinned=False, as_it_lies=True)
    'pageable'
    >>> classify(False, non_blocking=True, pinned=True, as_it_lies=False)
    'non-contiguous'
    >>> classify(True, non_blocking=True, pinned=True, as_it_lies=True)
    'unfinished'
    >>> classify(False, non_blocking=False, pinned=False, as_it_lies=False) is None
    True

    Args:
        to_host: Whether the copy is to the host (else to the device).
        non_blocking: Whether it was asked to be non-blocking.
        pinned: Whether its host side is pinned memory.
        as_it_lies: Whether it needs no staging copy of its host side.

    Returns:
        None, :data:`PAGEABLE`, :data:`NON_CONTIGUOUS` or :data:`UNFINISHED`.
    """
    if not non_blocking:
        return None
    if not pinned:
        return PAGEABLE
    if not as_it_lies:
        return NON_CONTIGUOUS
    return UNFINISHED if to_host else None


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill their memory with no gap or overlap, in some order of dims."""
    expected = 1
    for stride, size in sorted(
        (st, n) for st, n in zip(tensor.stride(), tensor.shape, strict=True) if n != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _as_it_lies(host: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether a copy reads or writes ``host`` where it lies: PyTorch stages what is not.

    ``other`` is the device's side. A contiguous host tensor is copied as it is; another
    only where the copy is one block of memory, both sides dense and alike (``.to()``
    keeps a dense tensor's strides).
    """
    if host.is_contiguous():
        return True
    return host.shape == other.shape and host.stride() == other.stride() and _dense(host)


# Devices whose copies to and from the host can be asynchronous, on a stream; MPS's
# share memory with the host, the meta device copies nothing.
_STREAMED = frozenset({"cuda", "xpu"})


def _has_streams(device: torch.device) -> bool:
    return device.type in _STREAMED


def _record_event(device: torch.device) -> Callable[[], bool]:
    event = new_event(device)
    event.record(torch.accelerator.current_stream(device))
    return event.query


@dataclasses.dataclass(frozen=True)
class Machine:
    """What track_transfers asks of the machine; the tests pass stand-ins to :func:`stand_in`.

    >>> import torch
    >>> Machine().streamed(torch.device("cuda")), Machine().streamed(torch.device("mps"))
    (True, False)
    """

    pinned: Callable[[torch.Tensor], bool] = torch.Tensor.is_pinned
    """Whether a host tensor's memory is pinned (a view of pinned memory is)."""
    streamed: Callable[[torch.device], bool] = _has_streams
    """Whether a device is an accelerator whose copies to and from the host can overlap."""
    record_event: Callable[[torch.device], Callable[[], bool]] = _record_event
    """Records an event on the device's current stream; gives its query: is the device past it."""


_machine = Machine()


@contextlib.contextmanager
def stand_in(machine: Machine) -> Iterator[None]:
    """Make the blocks of track_transfers opened inside ask ``machine``, for tests without a GPU.

    >>> import torch
    >>> with stand_in(Machine(streamed=lambda device: device.type == "meta")):
    ...     with track_transfers() as log:
    ...         _ = torch.ones(2).to("meta", non_blocking=True)
    >>> log.events[0].blocked
    'pageable'
    """
    global _machine  # noqa: PLW0603 - the seam: one machine at a time, like as_accelerator
    before, _machine = _machine, machine
    try:
        yield
    finally:
        _machine = before


@dataclasses.dataclass(frozen=True)
class TransferEvent:
    """One copy between devices.

    >>> import torch, devicekit as dk
    >>> with dk.track_transfers() as log:
    ...     _ = torch.ones(2).to("meta")
    >>> event = log.events[0]
    >>> event.source, event.target, event.nbytes, event.operation
    (device(type='cpu'), device(type='meta'), 8, 'to')
    """

    source: torch.device
    target: torch.device
    nbytes: int
    operation: str
    """The call that made it, such as ``"to"`` (``.to()``, ``.cpu()``), ``"copy_"``, ``"item"``."""
    filename: str
    lineno: int
    function: str
    blocked: str | None = None
    """What went wrong, else None. In ``log.events``, why a copy asked to be non-blocking
    blocked the host, ``"pageable"`` or ``"non-contiguous"`` (its host memory). In
    ``log.early_reads``, ``"read early"``; ``operation`` then names the call that read
    (``"add"``, ``"item"``) and the place is the read's."""
    refused: bool = False
    """Whether ``strict=True`` raised :class:`~devicekit.TransferError` at this copy, after
    it ran: a caller that catches the error still finds it here."""

    @property
    def where(self) -> str:
        """The line of user code that made the copy, as ``train.py:42 in step``."""
        return f"{os.path.basename(self.filename)}:{self.lineno} in {self.function}"


def _why(event: TransferEvent) -> str:
    """What went wrong at a marked event, and the fix."""
    reason, fix = _WHY[event.blocked]
    return f"{reason}: {fix}"


@dataclasses.dataclass
class TransferLog:
    """What :func:`track_transfers` recorded; ``str()`` gives a summary.

    >>> import torch, devicekit as dk
    >>> with dk.track_transfers() as log:
    ...     _ = dk.to_device([torch.ones(2), torch.ones(4)], "meta")
    >>> log.count, log.bytes
    (2, 24)
    """

    events: list[TransferEvent] = dataclasses.field(default_factory=list)
    early_reads: list[TransferEvent] = dataclasses.field(default_factory=list)
    """Reads of host results of non-blocking copies before the copies were known finished."""

    @property
    def count(self) -> int:
        """How many copies."""
        return len(self.events)

    @property
    def bytes(self) -> int:
        """How many bytes in all."""
        return sum(event.nbytes for event in self.events)

    def __str__(self) -> str:
        if not self.events:
            return "No transfers between devices."
        groups: dict[tuple[torch.device, torch.device], list[TransferEvent]] = {}
        for event in self.events:
            groups.setdefault((event.source, event.target), []).append(event)
        lines = [f"{self.count} transfer(s) between devices, {nbytes(self.bytes)} in all:"]
        for (source, target), events in groups.items():
            size = nbytes(TransferLog(events).bytes)
            lines.append(
                f"  {source} -> {target}: {len(events)} ({size}), first at {events[0].where}"
            )
        blocked = [event for event in self.events if event.blocked is not None]
        for marked, said in (
            (blocked, "copies asked to be non-blocking blocked"),
            (self.early_reads, "results of non-blocking copies read before the copy finished"),
        ):
            if marked:
                lines.append(
                    f"{len(marked)} {said}: first at {marked[0].where} ({_why(marked[0])})."
                )
        refused = [event for event in self.events if event.refused]
        if refused:
            lines.append(
                f"{len(refused)} refused by strict=True, each raising TransferError: first at "
                f"{refused[0].where}."
            )
        return "\n".join(lines)


def _user_frame() -> tuple[str, int, str]:
    frame, _ = user_frame(sys._getframe(2))
    if frame is None:
        return "<unknown>", 0, "<unknown>"
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


class _Copy(NamedTuple):
    source: torch.device
    target: torch.device
    nbytes: int
    operation: str
    non_blocking: bool


def _transfer_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Copy | None:
    """The copy, when the call moves data between devices."""
    if func is _aten._to_copy.default:
        source = args[0]
        target = kwargs.get("device")
        if target is not None and torch.device(target) != source.device:
            non_blocking = bool(kwargs.get("non_blocking", False))
            return _Copy(source.device, torch.device(target), source.nbytes, "to", non_blocking)
    elif func is _aten.copy_.default:
        target, source = args[0], args[1]
        if isinstance(source, torch.Tensor) and source.device != target.device:
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            return _Copy(source.device, target.device, source.nbytes, "copy_", non_blocking)
    elif func is _aten._local_scalar_dense.default:
        source = args[0]
        if source.device.type != "cpu":
            return _Copy(source.device, torch.device("cpu"), source.element_size(), "item", False)
    return None


class _Watched(NamedTuple):
    """The storage of a host result of a non-blocking copy, until it is read or dies."""

    storage: weakref.ref[torch.UntypedStorage]
    finished: Callable[[], bool]
    copy: _Copy


def _storage_key(tensor: torch.Tensor) -> int:
    """The id of the tensor's storage, which a view shares whenever it was taken; else 0.

    The storage is one Python object while it lives (PyTorch keeps it), so its id names
    it while watched. A sparse or nested tensor, or a subclass wrapping others, has none
    of its own to read: 0, never a live object's id.
    """
    try:
        return id(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return 0


_READS = {"_local_scalar_dense": "item", "_to_copy": "to"}  # aten names, as users write them


class _Recorder(DispatchMode):  # type: ignore[no-untyped-call]  # an untyped base
    def __init__(self, log: TransferLog, *, strict: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._log = log
        self._strict = strict
        self._machine = _machine
        self._watched: dict[int, _Watched] = {}  # by id() of the result's storage, while it lives

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        copy = _transfer_of(func, args, kwargs)
        if copy is None:
            if self._watched:
                self._check_reads(func, args, kwargs)
            return func(*args, **kwargs)
        streamed = self._machine.streamed
        if self._watched and not (streamed(copy.source) or streamed(copy.target)):
            # A copy to or from a device with streams is the device's, after the copy
            # being watched on its stream: the host reads nothing (a pinned buffer reused).
            self._check_reads(func, args, kwargs)
        where = _user_frame()
        result = func(*args, **kwargs)
        verdict = self._verdict(copy, args, result) if copy.non_blocking else None
        blocked = None if verdict == UNFINISHED else verdict
        event = TransferEvent(
            copy.source,
            copy.target,
            copy.nbytes,
            copy.operation,
            *where,
            blocked=blocked,
            refused=self._strict,
        )
        # Logged before a refusal: a caller that catches the TransferError keeps the record.
        self._log.events.append(event)
        if self._strict:
            self._refuse(event, unfinished=verdict == UNFINISHED)
        if verdict == UNFINISHED:
            self._watch(args[0] if copy.operation == "copy_" else result, copy)
        return result

    def _verdict(self, copy: _Copy, args: tuple[Any, ...], result: Any) -> str | None:
        """:func:`classify` of a non-blocking copy, made, between the host and an accelerator."""
        source, target = (args[1], args[0]) if copy.operation == "copy_" else (args[0], result)
        streamed = self._machine.streamed
        if copy.source.type == "cpu" and streamed(copy.target):
            host, other, to_host = source, target, False
        elif copy.target.type == "cpu" and streamed(copy.source):
            host, other, to_host = target, source, True
        else:
            return None
        return classify(
            to_host,
            non_blocking=True,
            pinned=self._machine.pinned(host),
            as_it_lies=_as_it_lies(host, other),
        )

    def _refuse(self, event: TransferEvent, *, unfinished: bool) -> None:
        msg = (
            f"Expected no transfers between devices inside track_transfers(strict=True), "
            f"but {event.where} copies {nbytes(event.nbytes)} from "
            f"{event.source} to {event.target} ({event.operation}). Inside a training "
            "step such copies (.item(), .cpu(), printing a tensor) stall the device: "
            "move them out, or batch them."
        )
        if event.blocked is not None:
            msg += f" It was asked to be non-blocking, yet blocks: {_why(event)}."
        elif unfinished:
            reason, fix = _WHY[READ_EARLY]
            msg += f" It was asked to be non-blocking: {reason}; {fix}."
        raise TransferError(msg)

    def _watch(self, host: torch.Tensor, copy: _Copy) -> None:
        storage = host.untyped_storage()  # a copy's host result is dense: it has one
        key = id(storage)
        watched = self._watched

        def forget(ref: weakref.ref[torch.UntypedStorage]) -> None:
            if key in watched and watched[key].storage is ref:
                del watched[key]

        finished = self._machine.record_event(copy.source)
        watched[key] = _Watched(weakref.ref(storage, forget), finished, copy)

    def _check_reads(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A view reads nothing, and reads through it are seen by its storage; a detach is
        # what .numpy() reads through, its only trace.
        if func.is_view and func is not _aten.detach.default:
            return
        # Type checks and a membership test before any pop (its cost: the module's docstring).
        watched = self._watched
        for arg in (*args, *kwargs.values()) if kwargs else args:
            if type(arg) is list or type(arg) is tuple:  # cat and stack take lists
                for item in arg:
                    if isinstance(item, torch.Tensor) and (key := _storage_key(item)) in watched:
                        self._read(func, key)
            elif isinstance(arg, torch.Tensor) and (key := _storage_key(arg)) in watched:
                self._read(func, key)

    def _read(self, func: Any, key: int) -> None:
        """A watched result is read: marked unless its copy is known finished; watched no more."""
        entry = self._watched.pop(key)
        if not entry.finished():
            name = func.overloadpacket.__name__
            copy = entry.copy
            event = TransferEvent(
                copy.source,
                copy.target,
                copy.nbytes,
                _READS.get(name, name),
                *_user_frame(),
                blocked=READ_EARLY,
            )
            self._log.early_reads.append(event)


@contextlib.contextmanager
def track_transfers(*, strict: bool = False) -> Iterator[TransferLog]:
    """A context manager: record every copy between devices in its ``with`` block, by line.

    Use it as ``with dk.track_transfers() as log:``; each copy is recorded with the line
    that made it. It finds the ``.item()``, ``.cpu()`` and stray ``.to()`` calls that
    quietly stall a training loop. ``strict=True`` raises at the first one instead,
    naming its line.

    It also marks what no other check sees. A copy between the host and a GPU asked to
    be non-blocking blocks anyway where its host memory is pageable or a non-contiguous
    view of pinned memory: its event says so in ``blocked``. A host result of a
    non-blocking copy read (by any aten call taking it or a view of it, even one taken
    before the copy; ``.item()``, ``.numpy()``) before the copy finished, by an event
    recorded after it, is listed in ``log.early_reads`` with the read's line. Taking a
    view reads nothing (``.detach()`` aside, which ``.numpy()`` reads through).
    ``.tolist()`` and printing read memory without an aten call, which a dispatch mode
    cannot see; seeing them would cost each call of the block a torch-function mode,
    about 2.7 us.

    Only the calling thread is watched: PyTorch's dispatch modes are per thread, so
    copies made in other threads (a DataLoader's pin-memory thread, devicekit's own
    feed thread, a thread of your own) are neither recorded nor refused. Wrap the code
    of each thread you want to watch in its own block.

    >>> import torch, devicekit as dk
    >>> with dk.track_transfers() as log:
    ...     moved = dk.to_device([torch.ones(4), torch.ones(4)], "meta")
    >>> log.count, log.bytes
    (2, 32)
    >>> print(log)  # doctest: +ELLIPSIS
    2 transfer(s) between devices, 32 bytes in all:
      cpu -> meta: 2 (32 bytes), first at ...

    Args:
        strict: Raise :class:`~devicekit.TransferError` at the first copy (once it ran),
            and at each after it where the caller catches the error; each stays in the
            log, ``refused``.

    Yields:
        The :class:`~devicekit.TransferLog` that ``with ... as log`` binds, filled as the
        block runs.

    Raises:
        TransferError: With ``strict=True``, at the first copy between devices, saying
            also why a copy asked to be non-blocking blocks, or that one to the host
            must be waited for before its result is read.
        TypeError: On entering the block, ``strict`` is not True or False.
    """
    log = TransferLog()
    with _Recorder(log, strict=flag(strict, "strict")):
        yield log
