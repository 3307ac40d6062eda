"""track_transfers: every cross-device copy inside a block, with the user's line that made it.

A dispatch mode of PyTorch's sees each aten call. The three that move data between
devices are recorded: ``_to_copy`` (``.to()``, ``.cpu()``, ``.cuda()``), ``copy_``
between devices, and ``_local_scalar_dense`` on an accelerator (``.item()``, which also
waits for the device). The stack is read only for those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from devicekit._base import DispatchMode, TransferError, nbytes, user_frame

__all__ = ["TransferEvent", "TransferLog", "track_transfers"]

_aten = torch.ops.aten


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

    @property
    def where(self) -> str:
        """``train.py:42 in step``: the line of user code that made the copy."""
        return f"{os.path.basename(self.filename)}:{self.lineno} in {self.function}"


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
        return "\n".join(lines)


def _user_frame() -> tuple[str, int, str]:
    frame, _ = user_frame(sys._getframe(2))
    if frame is None:
        return "<unknown>", 0, "<unknown>"
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _transfer_of(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.device, torch.device, int, str] | None:
    """(source, target, nbytes, operation) when the call moves data between devices."""
    if func is _aten._to_copy.default:
        source = args[0]
        target = kwargs.get("device")
        if target is not None and torch.device(target) != source.device:
            return source.device, torch.device(target), source.nbytes, "to"
    elif func is _aten.copy_.default:
        target, source = args[0], args[1]
        if isinstance(source, torch.Tensor) and source.device != target.device:
            return source.device, target.device, source.nbytes, "copy_"
    elif func is _aten._local_scalar_dense.default:
        source = args[0]
        if source.device.type != "cpu":
            return source.device, torch.device("cpu"), source.element_size(), "item"
    return None


class _Recorder(DispatchMode):  # type: ignore[no-untyped-call]  # an untyped base
    def __init__(self, log: TransferLog, *, strict: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._log = log
        self._strict = strict

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        transfer = _transfer_of(func, args, kwargs)
        if transfer is not None:
            event = TransferEvent(*transfer, *_user_frame())
            if self._strict:
                msg = (
                    f"Expected no transfers between devices inside track_transfers(strict=True), "
                    f"but {event.where} copies {nbytes(event.nbytes)} from "
                    f"{event.source} to {event.target} ({event.operation}). Inside a training "
                    "step such copies (.item(), .cpu(), printing a tensor) stall the device: "
                    "move them out, or batch them."
                )
                raise TransferError(msg)
            self._log.events.append(event)
        return func(*args, **kwargs)


@contextlib.contextmanager
def track_transfers(*, strict: bool = False) -> Iterator[TransferLog]:
    """Record every copy between devices made inside the block, with the line that made it.

    Finds the ``.item()``, ``.cpu()`` and stray ``.to()`` calls that quietly stall a
    training loop. ``strict=True`` raises at the first one instead, naming its line.

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
        strict: Raise :class:`~devicekit.TransferError` at the first copy.

    Yields:
        The log, filled as the block runs.

    Raises:
        TransferError: With ``strict=True``, at the first copy between devices.
    """
    log = TransferLog()
    with _Recorder(log, strict=strict):
        yield log
