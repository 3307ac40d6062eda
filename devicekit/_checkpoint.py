"""save and load: checkpoints written atomically, read onto the selected device safely."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tempfile
from pathlib import Path
from typing import IO, Any

import torch

from devicekit._checks import find_devices
from devicekit._devices import DeviceLike, resolve_device, shown
from devicekit._errors import TransferError
from devicekit._manager import current_device

__all__ = ["load", "save"]

# What torch.save writes: a zip archive (PyTorch >= 1.6), or the legacy format, a
# pickle (protocol 2) whose first object is this magic number.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[2:-1]


def save(obj: Any, f: str | os.PathLike[str] | IO[bytes]) -> None:
    """``torch.save``, atomically: a save that dies half-way leaves the last one intact.

    To a path, the checkpoint is written to a temporary file beside it, flushed to disk,
    then renamed over the target, so a full disk, a preemption or Ctrl-C leaves either
    the previous file or the new one, never a torn one, and no temporary. Under
    torchrun, only global rank 0 writes; where a process group is initialised, every
    rank returns once the file is complete (and raises if rank 0 could not write it).
    Tensors are saved as they are, on their devices: :func:`load` maps them.

    >>> import io, torch, devicekit as dk
    >>> buffer = io.BytesIO()
    >>> dk.save({"weight": torch.ones(2)}, buffer)
    >>> _ = buffer.seek(0)
    >>> dk.load(buffer, "cpu")["weight"]
    tensor([1., 1.])

    Args:
        obj: What to save, as ``torch.save`` takes it.
        f: A path, or a binary file object (written in place: a file object cannot be
            replaced atomically).

    Raises:
        TypeError: ``f`` is a file opened in text mode.
        RuntimeError: On a rank other than 0, when rank 0 failed to write the file.
    """
    _check_binary(f, "save to")
    rank, grouped = _rank()
    if rank == 0:
        try:
            _write(obj, f)
        except Exception as err:
            if grouped:  # the other ranks wait for the outcome: they raise too
                _agree(f"{type(err).__name__}: {err}")
            raise
    if grouped and (failure := _agree(None)) is not None:
        msg = f"Cannot save the checkpoint: rank 0 failed to write it ({failure})."
        raise RuntimeError(msg)


def _rank() -> tuple[int, bool]:
    """This process's global rank, and whether a process group is there to wait on."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), True
    return int(os.environ.get("RANK", "0") or 0), False


def _agree(failure: str | None) -> str | None:
    """Rank 0's outcome (``failure``, given there) on every rank; waiting for it is the barrier."""
    outcome = [failure]
    torch.distributed.broadcast_object_list(outcome, src=0)
    return outcome[0]


def _write(obj: Any, f: str | os.PathLike[str] | IO[bytes]) -> None:
    if not isinstance(f, str | os.PathLike):
        torch.save(obj, f)
        return
    target = Path(f)
    handle, temporary = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(handle, "wb") as out:
            torch.save(obj, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)  # atomic on POSIX and Windows
    except BaseException:  # Ctrl-C included: nothing half-written stays behind
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if hasattr(os, "O_DIRECTORY"):  # the rename itself, on disk (POSIX)
        directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _check_binary(f: object, doing: str) -> None:
    if isinstance(f, io.TextIOBase):
        mode = "rb" if doing == "load from" else "wb"
        msg = (
            f"Expected a path or a file opened in binary mode to {doing}, got a file opened in "
            f"text mode ({getattr(f, 'name', f)!r}): open it with {mode!r}."
        )
        raise TypeError(msg)


def _format_of(f: str | os.PathLike[str] | IO[bytes]) -> str:
    """``"zip"``, ``"legacy"``, ``"unread"`` or what the file begins with; put back after."""
    if isinstance(f, str | os.PathLike):
        with open(f, "rb") as file:
            start = file.read(len(_LEGACY_MAGIC) + 2)
    elif f.seekable():
        position = f.tell()
        start = f.read(len(_LEGACY_MAGIC) + 2)
        f.seek(position)
    else:
        return "unread"  # an unseekable stream: torch.load says what it finds
    if start.startswith(_ZIP_MAGIC):
        return "zip"
    if start[2:].startswith(_LEGACY_MAGIC):
        return "legacy"
    return "empty" if not start else f"begins with {start[:8]!r}"


def load(
    f: str | os.PathLike[str] | IO[bytes],
    device: DeviceLike | None = None,
    *,
    weights_only: bool = True,
    mmap: bool | None = None,
) -> Any:
    """``torch.load`` with every tensor mapped to the device, wherever it was saved.

    A checkpoint saved on ``cuda:3`` of another machine loads onto this process's
    device; under torchrun that is ``cuda:LOCAL_RANK``, so eight ranks do not all land
    on ``cuda:0``. ``weights_only=True`` refuses pickles that would run code.

    >>> import io, torch, devicekit as dk
    >>> buffer = io.BytesIO()
    >>> torch.save({"weight": torch.ones(2)}, buffer)
    >>> _ = buffer.seek(0)
    >>> dk.load(buffer, "meta")["weight"].device
    device(type='meta')

    Args:
        f: A path or a binary file object, as ``torch.load`` takes.
        device: Where the tensors go; None for :func:`~devicekit.current_device`.
        weights_only: Load tensors, containers and plain data only (PyTorch's safe
            mode). Pass False only for checkpoints you trust.
        mmap: Map the file instead of reading it into memory, as ``torch.load`` does
            (a path, zip format only).

    Returns:
        What was saved, its tensors on ``device``.

    Raises:
        TypeError: ``weights_only`` is not True or False: anything else could be read as
            permission to run the pickle's code; or ``f`` was opened in text mode.
        ValueError: The file is empty, not one written by ``torch.save``, or cut short.
        TransferError: The checkpoint holds tensors on the meta device (a shape and no
            data), which no map_location can give data to; the message names them.
    """
    if weights_only is not True and weights_only is not False:  # for untyped callers
        msg = (  # type: ignore[unreachable]
            f"Expected weights_only to be True or False, got {weights_only!r}: False runs "
            "the code a pickle holds, so devicekit takes nothing else for it."
        )
        raise TypeError(msg)
    _check_binary(f, "load from")
    target = current_device() if device is None else resolve_device(device)
    name = shown(str(f if isinstance(f, str | os.PathLike) else getattr(f, "name", f)), limit=300)
    found = _format_of(f)
    if found not in ("zip", "legacy", "unread"):
        # Never handed to torch.load: its refusal would advise weights_only=False, that
        # is running a pickle's code, for a file that is no checkpoint at all.
        why = "is empty" if found == "empty" else f"is not one (it {found})"
        msg = f"Expected a file written by torch.save, but {name} {why}."
        raise ValueError(msg)
    try:
        loaded = torch.load(f, map_location=target, weights_only=weights_only, mmap=mmap)
    except (EOFError, pickle.UnpicklingError, KeyError, UnicodeDecodeError, RuntimeError) as err:
        # A checkpoint's refusal under weights_only names what it holds and how to allow
        # it (torch.serialization.add_safe_globals): kept. Anything else here is a file
        # cut short or an archive that is not a checkpoint.
        if "Weights only load failed" in str(err) and "GLOBAL" in str(err):
            raise
        if isinstance(err, RuntimeError) and not _unreadable(err):
            raise
        said = str(err).split(". ")[0].strip(" .")
        why = (
            "is cut short, damaged, or a zip archive that is not a checkpoint (PyTorch: "
            f"{shown(said, limit=120)})"
        )
        msg = f"Expected a file written by torch.save, but {name} {why}."
        raise ValueError(msg) from None
    if target.type != "meta":
        without_data = find_devices(loaded).get(torch.device("meta"))
        if without_data:
            listed = ", ".join(without_data[:3]) + (
                f" and {len(without_data) - 3} more" if len(without_data) > 3 else ""
            )
            msg = (
                f"Expected a checkpoint with data to load onto {target}, but it holds "
                f"tensors on the meta device, which have a shape and no data: {listed}. It "
                "was saved from a model that was never given its weights (created on meta, "
                "or with to_empty() still to come); save it after the weights are loaded."
            )
            raise TransferError(msg)
    return loaded


def _unreadable(err: RuntimeError) -> bool:
    """Whether torch.load's RuntimeError says the archive is not a whole checkpoint."""
    text = str(err)
    return any(
        sign in text
        for sign in ("PytorchStreamReader", "zip archive", "enforce fail", "file not found")
    )
