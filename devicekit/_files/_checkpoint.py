"""save and load: ``torch.save`` made atomic and checked, ``torch.load`` onto the selected device.

:func:`save` writes through the atomic writer (:mod:`devicekit._files._atomic`) what a
weights-only :func:`load` reads (:mod:`devicekit._files._weights_only`), on the process that
calls it and never talking to other ranks (who saves is the caller's ``if rank == 0:``).
:func:`load` sniffs a file's format before torch.load reads it, and says in devicekit's
words what is no whole checkpoint and what the default load refuses.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import pickle
import stat
import zipfile
from collections.abc import Callable
from typing import IO, Any, cast

import torch

from devicekit._base import (
    META,
    DeviceLike,
    TransferError,
    current_device,
    flag,
    is_unreadable_archive,
    listing,
    resolve_device,
    shown,
    weights_only_said,
)
from devicekit._core import tensor_paths
from devicekit._files import _atomic
from devicekit._files._weights_only import (
    Unloadable,
    allowing,
    checked_pickle,
    first_sentence,
    load_refusal,
    save_refusal,
)

__all__ = ["load", "save"]

# What torch.save writes: a zip archive (PyTorch >= 1.6), or the legacy format, a
# pickle (protocol 2) whose first object is this magic number.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[2:-1]
# A zip ends with its directory's last record: 22 bytes and a comment of at most 64 KiB.
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22
_ZIP_TAIL = _ZIP_END_SIZE + 0xFFFF


def save(obj: Any, f: str | os.PathLike[str] | IO[bytes], *, weights_only: bool = True) -> None:
    """``torch.save``, atomically: a save that dies half-way leaves the last one intact.

    To a path, through a temporary file beside it, flushed and renamed over the target:
    a full disk, a preemption or Ctrl-C leaves the previous file or the new one, never a
    torn one, nor a temporary. It writes on the process that calls it: under torchrun,
    save on rank 0 (``if rank == 0:``) or to a path per rank. Tensors stay on their devices.

    >>> import io, torch, devicekit as dk
    >>> buffer = io.BytesIO()
    >>> dk.save({"weight": torch.ones(2)}, buffer)
    >>> _ = buffer.seek(0)
    >>> dk.load(buffer, "cpu")["weight"]
    tensor([1., 1.])

    A whole module (for a script that reads the model back with its classes, as
    PyTorch's examples do) is saved on request, and loaded on request:

    >>> buffer = io.BytesIO()
    >>> dk.save(torch.nn.Linear(2, 1), buffer, weights_only=False)
    >>> _ = buffer.seek(0)
    >>> dk.load(buffer, "cpu", weights_only=False)
    Linear(in_features=2, out_features=1, bias=True)

    Args:
        obj: What to save, as ``torch.save`` takes it. By default, made of what
            :func:`load` reads by default: tensors, containers, plain Python values,
            numpy scalars and arrays, ``argparse.Namespace`` and ``pathlib`` paths, and
            types allowed with ``torch.serialization.add_safe_globals``.
        f: A path, or a binary file object. A file object is written as torch.save
            writes it, once the check below has passed: a save refused writes nothing
            to it, but one that fails on the way (the stream's own write, Ctrl-C) leaves
            part of a checkpoint there, as torch.save does, and raises the stream's own
            error (where torch.save raises its writer's). A symbolic link's target is
            replaced, the link kept; a device or FIFO (``/dev/null``) is written in
            place, as a file object is.
        weights_only: Refuse, before a byte is written, what a weights-only load would
            refuse to build. False writes it anyway (a whole module, as torch.save
            does), for ``load(f, weights_only=False)`` to read: a load that runs the
            file's code, so only ever of a file you trust.

    Raises:
        TypeError: ``f`` is a file opened in text mode, bytes, or a file descriptor;
            ``weights_only`` is not True or False.
        ValueError: ``obj`` holds something a weights-only load would refuse to build
            (a module, an optimizer, a class of the program's), and ``weights_only`` is
            True: the message names every class refused, where they are and the ways
            out, and nothing was written.
        OSError: The path is a directory or ends with a slash (which names one), is
            read-only or another user's file, in a folder that is missing or not
            writable, or the disk is full: the message names the path, never the
            temporary, and the file that was there is unchanged.
    """
    weights_only = flag(weights_only, "weights_only")
    _check_binary(f, "save to")
    if isinstance(f, str | os.PathLike):
        write = functools.partial(_torch_save, obj, checks=weights_only)
        _atomic.write_file(_path_of(f, "save to"), write)
    elif callable(getattr(f, "write", None)):
        _torch_save(obj, lambda: f, "the file object", checks=weights_only)
    else:
        raise TypeError(_not_a_file(f, "save to"))


def _path_of(f: str | os.PathLike[str], doing: str) -> str:
    path = os.fspath(f)
    if not isinstance(path, str):  # a PathLike whose path is bytes
        raise TypeError(_not_a_file(path, doing))
    return path


def _not_a_file(f: object, doing: str) -> str:
    mode = "rb" if doing == "load from" else "wb"
    if isinstance(f, bytes):
        hint = f": give the path as a str, os.fsdecode({shown(f, limit=60)})"
    elif isinstance(f, int) and not isinstance(f, bool):
        hint = f": a file descriptor is opened as a file with os.fdopen({f}, {mode!r})"
    else:
        hint = ""
    return (
        f"Expected a path (str or os.PathLike) or a binary file object to {doing}, got "
        f"{type(f).__name__} {shown(f, limit=60)}{hint}."
    )


def _torch_save(obj: Any, opening: Callable[[], IO[bytes]], where: str, *, checks: bool) -> None:
    """torch.save to the file ``opening()`` gives, opened once the pickle has passed the check."""
    gate = _Gate(opening, checks=checks)
    try:
        with allowing:
            torch.save(obj, cast("IO[bytes]", gate), pickle_module=gate.checking)
    except Unloadable as refused:
        said, pickled = refused.args
        with allowing:  # what is refused, named as the check saw it
            msg = save_refusal(obj, said, where, pickled)
        raise ValueError(msg) from None
    except BaseException as err:
        failed = gate.failed
        if failed is None or failed is err:
            raise
        # torch.save's zip writer takes a write that raised for a short one, and raises
        # its own check instead ("enforce fail ... unexpected pos"): the stream's error,
        # a full disk or Ctrl-C, is the one to see.
        raise failed from None


class _Gate:
    """What torch.save writes to: nothing reaches the file before the pickle passed the check.

    torch.save's zip writer ends the archive even when the pickling raised (674 bytes),
    and an opened FIFO waits for a reader: so the file is opened once the pickle has
    passed, and written straight: no copy, no second pickling. Into a BytesIO, best of 30
    on a busy 2-core machine: 800 small tensors 35-38 ms (torch.save alone 28-31 ms),
    pickling first to check 56-58 ms; a 100 MiB state 0.10 s, as torch.save, a copy made
    first 0.19-0.23 s. Bytes written before it passed (none today) are held, or dropped.
    The first error a write of the file raised is kept: torch.save's writer loses it.
    """

    def __init__(self, opening: Callable[[], IO[bytes]], *, checks: bool) -> None:
        self._opening = opening
        self._held = bytearray()
        self.file: IO[bytes] | None = None
        self.failed: BaseException | None = None
        self.checking = checked_pickle(checks=checks, passed=self.open)

    def open(self) -> None:
        self.file = self._opening()
        if self._held:
            self.file.write(bytes(self._held))
            self._held.clear()

    def write(self, data: Any) -> int:
        if self.file is None:
            self._held += data
            return memoryview(data).nbytes
        try:
            return self.file.write(data)
        except BaseException as err:
            self.failed = self.failed or err
            raise

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()


def _check_binary(f: object, doing: str) -> None:
    if isinstance(f, io.TextIOBase):
        mode = "rb" if doing == "load from" else "wb"
        msg = (
            f"Expected a path or a file opened in binary mode to {doing}, got a file opened in "
            f"text mode ({getattr(f, 'name', f)!r}): open it with {mode!r}."
        )
        raise TypeError(msg)


def load(
    f: str | os.PathLike[str] | IO[bytes],
    device: DeviceLike | None = None,
    *,
    weights_only: bool = True,
    mmap: bool | None = None,
    map_location: DeviceLike | None = None,
) -> Any:
    """``torch.load`` with every tensor mapped to the device, wherever it was saved.

    A checkpoint saved on ``cuda:3`` of another machine loads onto this process's
    device; under torchrun that is ``cuda:LOCAL_RANK``, so eight ranks do not all land
    on ``cuda:0``. ``weights_only=True`` refuses pickles that would run code, and reads
    what :func:`save` writes (its ``obj`` says what that is).

    >>> import io, torch, devicekit as dk
    >>> buffer = io.BytesIO()
    >>> torch.save({"weight": torch.ones(2)}, buffer)
    >>> _ = buffer.seek(0)
    >>> dk.load(buffer, "meta")["weight"].device
    device(type='meta')

    Args:
        f: A path or a binary file object, as ``torch.load`` takes. A pipe
            (``<(aws s3 cp ... -)``) or an unseekable stream is read once into memory.
        device: Where the tensors go; None for :func:`~devicekit.current_device`.
        weights_only: Load tensors, containers and plain data only (PyTorch's safe
            mode). Pass False only for checkpoints you trust.
        mmap: Map the file instead of reading it into memory, as ``torch.load`` does
            (a path to a regular file, zip format only).
        map_location: ``device`` by the name ``torch.load`` gives it (a device, not a
            dict or function: devicekit maps every tensor to one device).

    Returns:
        What was saved, its tensors on ``device``.

    Raises:
        TypeError: ``weights_only`` is not True or False (anything else could be read
            as permission to run the pickle's code); ``mmap`` is not True, False or
            None; ``f`` was opened in text mode, or is bytes or a file descriptor;
            ``device`` and ``map_location`` disagree; ``map_location`` is a dict or a
            function; a device is of the wrong type.
        ValueError: The file is empty, not one written by ``torch.save`` (a zip archive:
            the message names the records it lacks; a TorchScript archive, loaded weights
            only: it names ``torch.jit.load``), cut short or damaged, or a device; or
            ``mmap=True`` for what is no regular file.
        OSError: The path is missing (:class:`FileNotFoundError`), a directory
            (:class:`IsADirectoryError`), or cannot be read.
        DeviceUnavailableError: ``device`` or ``map_location`` does not parse or is not
            on this machine.
        pickle.UnpicklingError: The checkpoint holds an object a weights-only load does
            not build; the message names it and how to allow it.
        TransferError: The checkpoint holds tensors on the meta device, which no
            map_location can give data to; the message names them.
    """
    weights_only = flag(weights_only, "weights_only")
    mmap = None if mmap is None else flag(mmap, "mmap")
    _check_binary(f, "load from")
    target = _load_device(device, map_location)
    source, name = _source(f, mmap)
    tail = _check_format(source, name)
    start = None if isinstance(source, str) else source.tell()
    if weights_only and _TORCHSCRIPT_RECORD.encode() in tail:
        # Refused before torch.load, which would warn that it dispatches to torch.jit.load
        # and then refuse it, advising weights_only=False. The name is looked for in the
        # zip directory's last bytes, read already (torch.jit.save writes it near the end),
        # and confirmed by the whole directory on that rare file alone.
        other = _other_archive(source, start, name, target)
        if other is not None:
            raise ValueError(other)
    try:
        with allowing:
            loaded = torch.load(source, map_location=target, weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as err:
        refused = load_refusal(str(err), name, source, start) if weights_only else None
        if refused is not None:
            raise pickle.UnpicklingError(refused) from None
        raise ValueError(_damaged(name, first_sentence(str(err)))) from None
    except (EOFError, KeyError, UnicodeDecodeError, RuntimeError, OSError) as err:
        # Past the format check, these are an archive cut or damaged inside, or one that
        # is no checkpoint (PyTorch's reader names a record it cannot find).
        if isinstance(err, RuntimeError):
            other = _other_archive(source, start, name, target)
            if other is not None:
                raise ValueError(other) from None
            if not is_unreadable_archive(err):
                raise
        if isinstance(err, OSError) and err.errno not in (errno.EINVAL, None):
            raise
        raise ValueError(_damaged(name, weights_only_said(str(err)).reason)) from None
    if target.type != "meta":
        without_data = [path for path, tensor in tensor_paths(loaded, "") if tensor.is_meta]
        if without_data:
            msg = (
                f"Expected a checkpoint with data to load onto {target}, but it holds meta "
                f"tensors: {listing(without_data)}; {META}. It was saved from a model that "
                "was never given its weights (created on meta, or with to_empty() still to "
                "come); save it after the weights are loaded."
            )
            raise TransferError(msg)
    return loaded


def _load_device(device: DeviceLike | None, map_location: object) -> torch.device:
    if map_location is not None:
        if isinstance(map_location, dict) or callable(map_location):
            msg = (
                f"Expected map_location to be a device such as 'cpu' or 'cuda:0', got "
                f"{type(map_location).__name__} {shown(map_location, limit=60)}: dk.load puts "
                "every tensor on one device. For a mapping per device, call torch.load."
            )
            raise TypeError(msg)
        mapped = resolve_device(map_location)  # type: ignore[arg-type]
        if device is not None and resolve_device(device) != mapped:
            msg = (
                f"Expected one device to load onto, got device={shown(device)} and "
                f"map_location={shown(map_location)}: give one of them."
            )
            raise TypeError(msg)
        return mapped
    return current_device() if device is None else resolve_device(device)


def _source(f: object, mmap: bool | None) -> tuple[str | IO[bytes], str]:
    """What torch.load reads (a path or a seekable file object), and its name for messages.

    A FIFO or unseekable stream is read into memory once: torch.load seeks.
    """
    if isinstance(f, str | os.PathLike):
        path = _path_of(f, "load from")
        name = shown(path, limit=300)
        kind = os.stat(path).st_mode  # FileNotFoundError as open() raises it
        if stat.S_ISREG(kind):
            return path, name
        if stat.S_ISDIR(kind):
            msg = f"Expected a checkpoint file to load, but {name} is a directory."
            raise IsADirectoryError(errno.EISDIR, msg)
        if stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
            msg = f"Expected a file written by torch.save, but {name} is a device, not a file."
            raise ValueError(msg)
        if mmap:
            msg = f"Expected a regular file to map with mmap=True, but {name} is a pipe: omit mmap."
            raise ValueError(msg)
        with open(path, "rb") as stream:  # a FIFO: its writer's bytes, read once
            return io.BytesIO(stream.read()), name
    if not callable(getattr(f, "read", None)):
        raise TypeError(_not_a_file(f, "load from"))
    file = cast("IO[bytes]", f)
    given = getattr(file, "name", None)
    name = "the file object" if given is None else shown(str(given), limit=300)
    if mmap:
        msg = f"Expected a path to map with mmap=True, got a file object ({name}): pass its path."
        raise ValueError(msg)
    try:
        seekable = bool(file.seekable()) and file.tell() >= 0
    except (AttributeError, OSError, ValueError):
        seekable = False
    return (file if seekable else io.BytesIO(file.read())), name


def _check_format(source: str | IO[bytes], name: str) -> bytes:
    """Refuse what is no whole checkpoint before torch.load reads it, saying what it is.

    Returns:
        The last bytes of a zip archive (its directory's end), read to check it; none
        for the legacy format.
    """
    head_size = len(_LEGACY_MAGIC) + 2
    with open(source, "rb") if isinstance(source, str) else contextlib.nullcontext(source) as file:
        start = file.tell()
        head = file.read(head_size)
        tail = b""
        if head.startswith(_ZIP_MAGIC):
            end = file.seek(0, os.SEEK_END)
            file.seek(max(start, end - _ZIP_TAIL))
            tail = file.read()
        file.seek(start)
    if head.startswith(_ZIP_MAGIC):
        last = tail.rfind(_ZIP_END)
        if last < 0 or last + _ZIP_END_SIZE + int.from_bytes(
            tail[last + 20 : last + 22], "little"
        ) != len(tail):
            msg = (
                f"Expected a whole checkpoint, but {name} is cut short or damaged: it lacks "
                "the zip directory that torch.save writes at its end (a copy or a save "
                "that stopped early?)."
            )
            raise ValueError(msg)
        return tail
    if head[2:].startswith(_LEGACY_MAGIC):
        return b""
    # Never handed to torch.load: its refusal would advise weights_only=False, that is
    # running a pickle's code, for a file that is no checkpoint at all.
    why = "is empty" if not head else f"is not one (it begins with {head[:8]!r})"
    msg = f"Expected a file written by torch.save, but {name} {why}."
    raise ValueError(msg)


# What torch.load reads first of a zip archive's folder, as torch.save writes it, and
# what tells torch.jit.save's archives (as torch.load tells them: a constants record).
_FIRST_READ = ("data.pkl", "version")
_TORCHSCRIPT_RECORD = "constants.pkl"


def _other_archive(
    source: str | IO[bytes], start: int | None, name: str, target: torch.device
) -> str | None:
    """Why a zip archive torch.load refused is no checkpoint; None if it is one, or no zip.

    A TorchScript archive, or an archive whose folder lacks a record torch.load reads
    first (its own words: ``Expected hasRecord("version") to be true``).
    """
    try:
        if start is not None:
            cast("IO[bytes]", source).seek(start)
        with zipfile.ZipFile(source) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    finally:
        if start is not None:  # where torch.load reads it from, if it is a checkpoint
            cast("IO[bytes]", source).seek(start)
    folder = names[0].partition("/")[0] if names else ""
    if not names or any(not each.startswith(f"{folder}/") for each in names):
        return None  # no folder of records: said as damaged, in PyTorch's words
    records = [each[len(folder) + 1 :] for each in names]
    if _TORCHSCRIPT_RECORD in records:
        loaded = name if isinstance(source, str) else "f"
        return (
            f"Expected a file written by torch.save, but {name} is a TorchScript archive, "
            f"written by torch.jit.save: load it with torch.jit.load({loaded}, "
            f"map_location={str(target)!r})."
        )
    missing = [each for each in _FIRST_READ if each not in records]
    if not missing:
        return None
    lacks = " and ".join(repr(each) for each in missing)
    return (
        f"Expected a file written by torch.save, but {name} is a zip archive without the "
        f"{lacks} record{'s' if len(missing) > 1 else ''} that torch.save writes and "
        f"torch.load reads first: it holds {listing([repr(each) for each in records])}."
    )


def _damaged(name: str, said: str) -> str:
    said = shown(said.split(". ", maxsplit=1)[0].strip(" ."), limit=120)
    return (
        f"Expected a file written by torch.save, but {name} is cut short or damaged, or a "
        f"zip archive that is not a checkpoint (PyTorch: {said})."
    )
