"""save and load: ``torch.save`` made atomic, and ``torch.load`` onto the selected device.

:func:`save` writes on the process that calls it, to the path it is given, and never
talks to other ranks: who saves is the caller's ``if rank == 0:``, as with torch.save.
What a path names decides how it is written:

=====================  ==============================================================
the path names         save
=====================  ==============================================================
nothing, or a file     a temporary beside it, flushed to disk, renamed over it: the old
of this user's         checkpoint or the new one, never a torn one; the mode and owner
                       of the file replaced are kept (a new file: ``0o666 & ~umask``)
a symbolic link        the file it points to, replaced in the same way; the link stays
a device or a FIFO     written in place, as torch.save writes (``/dev/null`` stays
                       one), opened once the check below has passed
another user's file    refused, naming its owner: the new file would be this user's,
                       and only root can give it back (root replaces it, and does)
a folder: a directory  refused, naming the path (torch.save refuses ``runs/`` and
or what ends with a    ``ck.pt/`` too)
slash; a read-only
file; a socket
=====================  ==============================================================

Where Linux allows it (``O_TMPFILE``, a file system's choice), the temporary has no
name until it is whole, so a process killed while it writes (SIGKILL, or SIGTERM in a
save from a thread) leaves nothing behind, but for the moment between naming it and
the rename. Elsewhere it is named from the start and removed on every exit the
process sees: an exception, Ctrl-C, and SIGTERM or SIGHUP (a preemption) in the main
thread, which are then delivered again as they would have been. Flushing the folder
(the rename, on disk) is durability only: a folder that cannot be opened for it (one
this user may write but not list) does not fail a save that has replaced the file.
Before a byte is written, the pickle's globals are checked against those a
weights-only :func:`load` allows, so what save writes load reads by default: both
allow the plain data of training scripts that PyTorch's weights-only load refuses
(numpy scalars and arrays, ``argparse.Namespace``, ``pathlib`` paths), and save
refuses the rest, naming every class refused at once and where, unless asked to write
it anyway (``weights_only=False``: a whole model, for a load that runs its code).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import io
import os
import pathlib
import pickle
import re
import secrets
import signal
import stat
import sys
import threading
import types
import zipfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any, ClassVar, Final, TypeAlias, cast

import torch

from devicekit import _tree
from devicekit._checks import find_devices
from devicekit._compat import (
    weights_only_build_refusal,
    weights_only_refusal,
    weights_only_refused_globals,
)
from devicekit._current import current_device
from devicekit._devices import DeviceLike, resolve_device, shown
from devicekit._errors import TransferError

__all__ = ["load", "save"]

# What torch.save writes: a zip archive (PyTorch >= 1.6), or the legacy format, a
# pickle (protocol 2) whose first object is this magic number.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[2:-1]
# A zip ends with its directory's last record: 22 bytes and a comment of at most 64 KiB.
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22
_ZIP_TAIL = _ZIP_END_SIZE + 0xFFFF
_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")  # PyTorch's messages colour their words


@functools.cache
def _safe_types() -> tuple[Any, ...]:
    """Plain data of training scripts that build without running a checkpoint's code.

    numpy's scalars and arrays (``np.float64(loss)``, ``np.random.get_state()``) under
    the module names numpy 2 and numpy 1 write, with the dtype classes their state
    builds; ``argparse.Namespace`` (``args``) and ``pathlib`` paths in it.
    """
    allowed: list[Any] = [
        argparse.Namespace,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        type(pathlib.Path()),
    ]
    try:
        import numpy  # noqa: PLC0415 - optional; PyTorch imports it where installed
    except ImportError:
        return tuple(allowed)
    core = getattr(numpy, "_core", None) or numpy.core
    allowed += [
        (getattr(core.multiarray, name), f"{module}.{name}")
        for module in ("numpy._core.multiarray", "numpy.core.multiarray")
        for name in ("scalar", "_reconstruct")
    ]
    dtypes = getattr(numpy, "dtypes", None)
    allowed += [numpy.dtype, numpy.ndarray]
    allowed += [getattr(dtypes, name) for name in getattr(dtypes, "__all__", ())]
    return tuple(allowed)


class _Allowing:
    """The safe types added to PyTorch's weights-only allowlist while a save or load runs.

    PyTorch's list is the process's; a save or load in another thread shares the
    additions, and the last to finish takes away only what devicekit added.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._added: Any = None  # a torch.serialization.safe_globals, entered

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                present = set(torch.serialization.get_safe_globals())
                missing = [each for each in _safe_types() if each not in present]
                self._added = torch.serialization.safe_globals(missing)
                self._added.__enter__()
            self._users += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._added is not None:
                self._added.__exit__(None, None, None)
                self._added = None


_allowing = _Allowing()


class _Unloadable(Exception):  # noqa: N818 - carries the refusal out of torch.save
    """What a weights-only load would refuse in the pickle about to be written."""

    def __init__(self, refusal: str, pickled: bytes) -> None:
        super().__init__(refusal)
        self.refusal = refusal
        self.pickled = pickled


class _CheckedPickler(pickle.Pickler):
    """torch.save's pickler, checking its pickle as a weights-only load would, before writing."""

    checks: ClassVar[bool] = True  # False: a save with weights_only=False, written as it is

    def __init__(self, file: io.BytesIO, protocol: int | None = None) -> None:
        super().__init__(file, protocol)
        self._written = file

    def dump(self, obj: Any) -> None:
        super().dump(obj)
        if self.checks:
            pickled = self._written.getvalue()
            refusal = weights_only_refusal(pickled)
            if refusal is not None:
                raise _Unloadable(refusal, pickled)
        self.passed()

    def passed(self) -> None:
        """Called once the pickle has passed the check, before torch.save writes a byte."""


def _pickle_module(*, checks: bool, **methods: Any) -> Any:
    """What torch.save takes as ``pickle_module``: it makes its pickler from this one's class."""
    pickler = type("_Pickler", (_CheckedPickler,), {"checks": checks, **methods})
    return types.SimpleNamespace(__name__="pickle", Pickler=pickler)


_CHECKED_PICKLE = _pickle_module(checks=True)
_UNCHECKED_PICKLE = _pickle_module(checks=False)


def save(obj: Any, f: str | os.PathLike[str] | IO[bytes], *, weights_only: bool = True) -> None:
    """``torch.save``, atomically: a save that dies half-way leaves the last one intact.

    To a path, the checkpoint is written to a temporary file beside it, flushed to disk,
    then renamed over the target, so a full disk, a preemption or Ctrl-C leaves either
    the previous file or the new one, never a torn one, and no temporary. It writes on
    the process that calls it, whatever its rank: under torchrun, save on rank 0 with
    ``if rank == 0:``, or on every rank to a path of its own (a shard). Tensors are
    saved as they are, on their devices: :func:`load` maps them.

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
            part of a checkpoint there, as torch.save does. A symbolic link's target is
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
    _check_weights_only(
        weights_only, "False writes a pickle that only a load running its code reads"
    )
    _check_binary(f, "save to")
    if isinstance(f, str | os.PathLike):
        _save_to_path(obj, _path_of(f, "save to"), checks=weights_only)
    elif callable(getattr(f, "write", None)):
        _save_to_stream(obj, lambda: f, "the file object", owned=False, checks=weights_only)
    else:
        raise TypeError(_not_a_file(f, "save to"))


def _check_weights_only(weights_only: object, why: str) -> None:
    if weights_only is not True and weights_only is not False:  # for untyped callers
        msg = (
            f"Expected weights_only to be True or False, got {weights_only!r}: {why}, so "
            "devicekit takes nothing else for it."
        )
        raise TypeError(msg)


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


def _torch_save(obj: Any, out: IO[bytes] | _Sink | _Gate, where: str, checking: Any) -> None:
    """torch.save, refusing what a weights-only load would refuse before a byte is written.

    torch.save pickles the object whole before it writes a record; the refusal comes out
    of that pickling. Its zip writer still ends the archive on the way out (674 bytes of
    an empty checkpoint): harmless in a temporary that is then removed, not in a stream.
    """
    try:
        with _allowing:
            torch.save(obj, cast("IO[bytes]", out), pickle_module=checking)
    except _Unloadable as refused:
        with _allowing:  # what is refused, named as the check saw it
            msg = _unloadable(obj, refused.refusal, where, refused.pickled)
        raise ValueError(msg) from None


def _save_to_stream(
    obj: Any, opening: Callable[[], IO[bytes]], where: str, *, owned: bool, checks: bool
) -> None:
    """Save to a file object, or a device or FIFO: refused, it writes nothing there.

    ``opening`` gives the file once the pickle has passed the check (an opened FIFO
    waits for a reader: a refused save must not wait); ``owned``: closed after.
    """
    gate = _Gate(opening, checks=checks)
    try:
        _torch_save(obj, gate, where, gate.checking)
    finally:
        if owned and gate.file is not None:
            gate.file.close()


class _Gate:
    """What torch.save writes to for a stream: nothing passes before the pickle passed the check.

    torch.save pickles the object whole before it writes anything, and the check ends
    that pickling; but its zip writer ends the archive on the way out even when the
    pickling raised (674 bytes of an empty checkpoint). So the file is opened (``opening``)
    only once the pickle has passed, and torch.save then writes straight to it, with no
    copy made first and no second pickling. Into a BytesIO, best of 30 on a busy 2-core
    machine: 800 small tensors 35-38 ms (torch.save alone 28-31 ms: the check is the
    rest), where pickling first to check took 56-58 ms; a 100 MiB state 0.10 s, as
    torch.save, where a copy made first took 0.19-0.23 s. Bytes written before the
    pickle passed (none, in the PyTorch of today) are held, and dropped if it never does.
    """

    def __init__(self, opening: Callable[[], IO[bytes]], *, checks: bool) -> None:
        self._opening = opening
        self._held = bytearray()
        self.file: IO[bytes] | None = None
        # torch.save makes its pickler from the class it is given: one of this gate's.
        self.checking = _pickle_module(checks=checks, passed=lambda _pickler: self.open())

    def open(self) -> None:
        self.file = self._opening()
        if self._held:
            self.file.write(bytes(self._held))
            self._held.clear()

    def write(self, data: Any) -> int:
        if self.file is None:
            self._held += data
            return memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()


def _save_to_path(obj: Any, given: str, *, checks: bool) -> None:
    _refuse_a_folder_name(given)
    target = os.path.realpath(given)  # a link's target is what gets replaced
    shown_path = (
        repr(given) if target == os.path.abspath(given) else f"{given!r} (a link to {target!r})"
    )
    try:
        found: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        found = None
    except OSError as err:
        raise OSError(err.errno, f"Cannot save to {shown_path}: {err.strerror}.") from None
    if found is not None:
        kind = found.st_mode
        if stat.S_ISDIR(kind):
            example = os.path.join(given, "model.pt")
            msg = f"Cannot save to {shown_path}: it is a directory. Name a file in it: {example!r}."
            raise IsADirectoryError(errno.EISDIR, msg)
        if stat.S_ISSOCK(kind):
            msg = f"Cannot save to {shown_path}: it is a socket, which holds no file."
            raise OSError(errno.ENXIO, msg)
        if not stat.S_ISREG(kind):  # a device or a FIFO: nothing to replace, as torch.save
            opening = lambda: open(target, "wb")  # noqa: E731, SIM115 - closed by the save
            _save_to_stream(obj, opening, shown_path, owned=True, checks=checks)
            return
        if hasattr(os, "geteuid") and found.st_uid != os.geteuid() != 0:
            raise _not_theirs(shown_path, found.st_uid)  # whatever its mode: not theirs
        if not kind & 0o222 or not os.access(target, os.W_OK):
            msg = (
                f"Cannot save to {shown_path}: it is read-only (mode {stat.S_IMODE(kind):o}). "
                "Make it writable (chmod u+w) to replace it, or save to another path."
            )
            raise PermissionError(errno.EACCES, msg)
    folder = os.path.dirname(target) or "."
    directory = _folder_to_sync(folder)
    try:
        _replace(obj, target, folder, found, shown_path, checks=checks)
        if directory is not None:
            # The rename itself, on disk: durability only. The file is replaced by now,
            # and some file systems refuse to flush a folder (EINVAL on FUSE and network
            # mounts): a save that has succeeded does not report a failure.
            with contextlib.suppress(OSError):
                os.fsync(directory)
    finally:
        if directory is not None:
            os.close(directory)


def _refuse_a_folder_name(given: str) -> None:
    """Refuse a path that names a folder by its form (``"runs/"``) but no folder is there.

    ``realpath`` drops the slash, which would make ``"runs/"`` a file named ``runs`` and
    ``"ck.pt/"`` the file ``ck.pt``; torch.save refuses both, and so does save.
    """
    if os.path.basename(given) not in ("", ".", "..") or not given:
        return
    separators = os.sep + (os.altsep or "")
    named = given.rstrip(separators) or given
    if os.path.basename(named) in (".", ".."):  # "ck.pt/.": the file is ck.pt
        named = os.path.dirname(named) or named
    ending = given[len(named) :] or given
    try:
        os.stat(given)  # an existing folder: refused as a directory, with a file to name
    except NotADirectoryError:
        msg = (
            f"Cannot save to {given!r}: a path that ends with {ending!r} names a folder, "
            f"but {named!r} is a file. To replace it, name it without the slash: {named!r}; "
            "it is unchanged."
        )
        raise NotADirectoryError(errno.ENOTDIR, msg) from None
    except FileNotFoundError:
        example = os.path.join(named, "model.pt")
        msg = (
            f"Cannot save to {given!r}: a path that ends with {ending!r} names a folder, "
            f"and there is no folder {named!r}. Name a file in it once it exists "
            f"(os.makedirs({named!r})), such as {example!r}; nothing was written."
        )
        raise IsADirectoryError(errno.EISDIR, msg) from None
    except OSError:  # a folder on the way this user may not enter: said with the target's
        return


def _not_theirs(shown_path: str, owner: int) -> PermissionError:
    """Why a file of another user's is not replaced: the new one would be this user's."""
    import pwd  # noqa: PLC0415 - POSIX only, as the owners it names

    try:
        whose = f"user {pwd.getpwuid(owner).pw_name} (uid {owner})"
    except KeyError:  # an id with no name here (a container, a shared disk)
        whose = f"uid {owner} (no user name here)"
    msg = (
        f"Cannot save to {shown_path}: the file there belongs to {whose}, and a checkpoint "
        f"put in its place would belong to this process's user (uid {os.geteuid()}): only "
        "root can give a file to another user. Save under another name, or remove the file "
        "first (or ask its owner to); it is unchanged."
    )
    return PermissionError(errno.EPERM, msg)


def _folder_to_sync(folder: str) -> int | None:
    """The folder, opened before anything is written, to flush the rename to disk; or None.

    That flush is durability, not correctness: where the folder cannot be opened (one
    this user may write and enter but not list, mode 0733, or no POSIX folders), the save
    goes on without it, rather than report a failure after the file was replaced.
    """
    if not hasattr(os, "O_DIRECTORY"):
        return None
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # a missing folder is named when the temporary is made
        return None


def _replace(
    obj: Any,
    target: str,
    folder: str,
    found: os.stat_result | None,
    shown_path: str,
    *,
    checks: bool,
) -> None:
    """Write a temporary beside ``target``, flush it to disk, and rename it over ``target``."""
    temporary = _Temporary.open(folder, os.path.basename(target), found, shown_path)
    with _removed_on_any_exit(temporary):
        sink = _Sink(os.fdopen(temporary.descriptor, "wb"))
        try:
            with sink.file:
                _torch_save(obj, sink, shown_path, _CHECKED_PICKLE if checks else _UNCHECKED_PICKLE)
                sink.file.flush()
                os.fsync(sink.file.fileno())
                temporary.name_it(sink.file.fileno())
        except (OSError, RuntimeError) as err:
            refusal = sink.refusal or (err if isinstance(err, OSError) else None)
            if refusal is None:
                raise
            raise _cannot_write(shown_path, folder, refusal, found is not None) from None
        try:
            os.replace(temporary.path, target)  # atomic on POSIX and Windows
        except PermissionError as err:
            raise _cannot_replace(shown_path, folder, err) from None
        except OSError as err:
            raise _cannot_write(shown_path, folder, err, found is not None) from None


class _Sink:
    """The file torch.save writes to, keeping the operating system's refusal of a write.

    PyTorch's zip writer turns a failed write into "enforce fail ... unexpected pos";
    the refusal kept here (a full disk, a quota) is what the user is told instead.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.refusal: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.refusal = self.refusal or err
            raise

    def flush(self) -> None:
        self.file.flush()


class _Temporary:
    """A new file beside the target, with the mode (and owner) the saved file is to have.

    Where Linux allows it (``O_TMPFILE``), the file has no name while it is written,
    so a process killed then (SIGTERM in a save from a thread, where no handler can
    run; SIGKILL) leaves nothing behind: it is named only when whole, just before the
    rename. Elsewhere it is named from the start (``.NAME.XXXXXXXX.tmp``) and removed
    on every exit the process sees.
    """

    def __init__(self, beside: tuple[str, str], descriptor: int, path: str | None) -> None:
        self.beside = beside  # the target's folder and name
        self.descriptor = descriptor
        self.named = path is not None
        self.path = path or _temporary_name(*beside)  # its name, or the one it will have

    @classmethod
    def open(
        cls, folder: str, name: str, replaced: os.stat_result | None, shown_path: str
    ) -> _Temporary:
        # A new checkpoint gets 0o666 less the umask, as torch.save's open() gives it;
        # one that replaces a file starts private and then takes that file's mode and owner.
        mode = 0o666 if replaced is None else 0o600
        temporary = cls._unnamed(folder, name, mode) or cls._named(
            folder, name, mode, replaced, shown_path
        )
        try:
            if replaced is not None and hasattr(os, "fchown"):  # POSIX owners and modes
                temporary._keep_owner(replaced, shown_path)
                os.fchmod(temporary.descriptor, stat.S_IMODE(replaced.st_mode))
        except BaseException:
            temporary.close_and_remove()
            raise
        return temporary

    @classmethod
    def _unnamed(cls, folder: str, name: str, mode: int) -> _Temporary | None:
        unnamed = getattr(os, "O_TMPFILE", 0)
        # Named later through /proc (linkat), which must be there to be used.
        if not unnamed or not os.path.isdir("/proc/self/fd"):
            return None
        try:
            descriptor = os.open(folder, unnamed | os.O_WRONLY, mode)
        except OSError:  # not on this file system (or refused: the named way says why)
            return None
        return cls((folder, name), descriptor, None)

    @classmethod
    def _named(
        cls,
        folder: str,
        name: str,
        mode: int,
        replaced: os.stat_result | None,
        shown_path: str,
    ) -> _Temporary:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        while True:
            path = _temporary_name(folder, name)
            try:
                descriptor = os.open(path, flags, mode)
            except FileExistsError:
                continue
            except OSError as err:
                raise _cannot_write(shown_path, folder, err, replaced is not None) from None
            return cls((folder, name), descriptor, path)

    def _keep_owner(self, replaced: os.stat_result, shown_path: str) -> None:
        if replaced.st_uid != os.geteuid():  # root here: others were refused before
            try:
                os.fchown(self.descriptor, replaced.st_uid, replaced.st_gid)
            except PermissionError:  # root without the right to (a user namespace)
                raise _not_theirs(shown_path, replaced.st_uid) from None
        elif replaced.st_gid != os.getegid():
            with contextlib.suppress(PermissionError):  # a group this user has left
                os.fchown(self.descriptor, -1, replaced.st_gid)

    def name_it(self, descriptor: int) -> None:
        """Give the whole file its name, beside the target (an unnamed one: linkat)."""
        if self.named:
            return
        # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N, as open(2) shows; os.link calls
        # link(), which follows no link, unless a folder descriptor is given.
        fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
        try:
            while not self.named:
                try:
                    os.link(str(descriptor), self.path, src_dir_fd=fds, follow_symlinks=True)
                except FileExistsError:  # a name taken since it was drawn: another draw
                    self.path = _temporary_name(*self.beside)
                    continue
                self.named = True
        finally:
            os.close(fds)

    def close_and_remove(self) -> None:
        os.close(self.descriptor)
        self.remove()

    def remove(self) -> None:
        if self.named:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _temporary_name(folder: str, name: str) -> str:
    return os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")


def _cannot_write(shown_path: str, folder: str, err: OSError, replacing: bool) -> OSError:
    why = {
        errno.ENOENT: f"the folder {folder!r} does not exist",
        errno.EACCES: f"the folder {folder!r} is not writable",
        errno.EPERM: f"the folder {folder!r} is not writable",
        errno.EROFS: f"the folder {folder!r} is on a read-only file system",
        errno.ENOSPC: f"the disk holding {folder!r} is full",
        errno.EDQUOT: f"this user's disk quota on {folder!r} is used up",
        errno.EFBIG: f"the checkpoint is larger than the file system of {folder!r} allows",
    }.get(err.errno or 0, f"writing in {folder!r} failed")
    kept = "the file there is unchanged" if replacing else "nothing was written there"
    msg = f"Cannot save to {shown_path}: {why} ({err.strerror}); {kept}."
    return OSError(err.errno, msg)


def _cannot_replace(shown_path: str, folder: str, err: OSError) -> PermissionError:
    """The rename refused (a sticky folder such as /tmp, an immutable file): said of the path."""
    try:
        sticky = bool(os.stat(folder).st_mode & stat.S_ISVTX)
    except OSError:
        sticky = False
    why = (
        f"the folder {folder!r} is sticky, where only a file's owner may replace it"
        if sticky
        else f"the folder {folder!r} does not let this user replace it"
    )
    msg = f"Cannot save to {shown_path}: {why} ({err.strerror}); the file there is unchanged."
    return PermissionError(err.errno, msg)


# Signals that end a process unless handled: a save removes its temporary first.
_ENDING_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


@contextlib.contextmanager
def _removed_on_any_exit(temporary: _Temporary) -> Iterator[None]:
    """Remove ``temporary`` however the block is left, SIGTERM and SIGHUP included.

    Where such a signal would end the process (its default action, in the main thread,
    where Python runs handlers), it is caught for the block's length: the temporary is
    removed, and the signal delivered again as it would have been. A program's own
    handler (a preemption hook that saves) is left alone. Python runs handlers in the
    main thread only: a save from another thread relies on the temporary having no name.
    """

    def remove_and_end(signum: int, frame: object) -> None:
        temporary.remove()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    caught = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _ENDING_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                caught[signum] = signal.signal(signum, remove_and_end)
    try:
        yield
    except BaseException:
        temporary.remove()
        raise
    finally:
        for signum, previous in caught.items():
            signal.signal(signum, previous)


def _unloadable(obj: Any, refusal: str, where: str, pickled: bytes | None = None) -> str:
    """Why save refuses ``obj``: what a weights-only load would not build, where, and the fixes.

    Every global refused is named at once, in the order the pickle names them, and every
    value that holds them at the top (a module, not the modules in it), so that one
    change makes the save pass. The ways out: save what is refused as data (a
    ``state_dict()``, a dict), or save it whole with ``weights_only=False``. Allowing
    the classes named is advised too where that is the fix (a class of the program's,
    a ``defaultdict``, never a module or an optimizer, which have a state_dict, nor a
    function, which the load would call) and makes the load build ``pickled`` (the
    pickle refused), tried without writing: a weights-only load builds no defaultdict
    that holds items, allowed or not (an optimizer's state, once it has stepped).
    Built-in classes the pickle names (``dict``, a defaultdict's factory) are advised
    too: the load refuses them, as it does any global not allowed.
    """
    refusal = _ESCAPES.sub("", refusal)
    names = [] if pickled is None else weights_only_refused_globals(pickled)
    if not names:  # the words of weights_only_refusal: "GLOBAL a ... (and b, c)"
        match = re.search(r"GLOBAL (\S+)|<class '([^']+)'>", refusal)
        names = [] if match is None else [match.group(1) or match.group(2)]
        more = re.search(r"was not an allowed global \(and ([^)]*)\)", refusal)
        names += more.group(1).split(", ") if more else []
    try:
        found = _refused_in(obj, frozenset(names))
        lost = ""
    except TransferError as err:  # a cycle, or depth past MAX_DEPTH: said with its path
        found, lost = [], f" Where it is could not be found: {err}"
    whole = _saved_whole(obj)
    if not found:
        refused = (
            f"to build {', '.join(names)} (building {'them' if len(names) > 1 else 'it'} "
            "could run code the file names)"
            if names
            else f"it ({_first_sentence(refusal)})"
        )
        return (
            f"Cannot save to {where}: a weights-only load, dk.load's default, would refuse "
            f"{refused}.{lost} Save tensors and plain data, or allow the classes where you "
            f"save and where you load with torch.serialization.add_safe_globals([...]).{whole}"
        )
    every = ""
    if len(names) > 1:
        every = f" The load refuses {'both' if len(names) == 2 else f'all {len(names)}'} of "
        every += f"these: {', '.join(names)}."
    held = [_qualified(value if _by_reference(value) else type(value)) or "?" for _, value in found]
    at = _listed(
        [
            f"{path} is {name}" if path else f"the object at the top level is {name}"
            for (path, _), name in zip(found, held, strict=True)
        ]
    )
    them = "them" if len(found) > 1 else "it"
    by_kind: dict[str, list[str]] = {}  # how to save each as data: the paths it fits
    for path, value in found:
        by_kind.setdefault(_kind_of(value), []).append(path)
    fixes = " ".join(
        _fix(kind, paths, obj, alone=len(found) == 1) for kind, paths in by_kind.items()
    )
    alternative = ""
    allowed = [*dict.fromkeys(held), *(each for each in names if each not in held)]
    # Modules and optimizers: their state_dict, or whole. Functions: never tried, since
    # the trial build would call them.
    if "state_dict" not in by_kind and all(isinstance(_loaded(each), type) for each in allowed):
        stuck = None if pickled is None else _refused_even_if_allowed(pickled, allowed)
        if stuck is None:
            shorts = ", ".join(each.rsplit(".", 1)[-1] for each in allowed)
            yours = (
                "the class is yours and safe to build, allow it"
                if len(allowed) == 1
                else "the classes are yours and safe to build, allow them"
            )
            alternative = (
                f" Or, where {yours} before saving and before loading: "
                f"torch.serialization.add_safe_globals([{shorts}])."
            )
        else:
            alternative = (
                " Allowing its classes would not do: a weights-only load refuses to build "
                f"{them} even then ({stuck})."
            )
    return (
        f"Cannot save to {where}: {at}, which a weights-only load, dk.load's default, refuses "
        f"to build (building {them} could run code the file names).{every} "
        f"{fixes}{alternative}{whole}"
    )


# How many values a refusal names where it lists them; the rest are counted.
_SHOWN: Final = 3


def _listed(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``, ``a, b, c and 4 more``."""
    if len(items) > _SHOWN:
        return f"{', '.join(items[:_SHOWN])} and {len(items) - _SHOWN} more"
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _kind_of(value: object) -> str:
    """How to save ``value`` as data: by name, its state_dict, as a dict, or its fields."""
    if _by_reference(value):
        return "name"
    if callable(getattr(value, "state_dict", None)):  # modules, optimizers, schedulers
        return "state_dict"
    return "mapping" if isinstance(value, Mapping) else "fields"


_FIXES: Final = {  # (for one value, for several)
    "name": ("save its name as a str instead", "save their names as str instead"),
    "state_dict": ("save its state_dict() instead", "save their state_dict() instead"),
    "mapping": (
        "save it as a plain dict instead (dict(...))",
        "save them as plain dicts instead (dict(...))",
    ),
    "fields": (
        "save its fields as a dict instead (vars(...) or dataclasses.asdict(...))",
        "save their fields as dicts instead (vars(...) or dataclasses.asdict(...))",
    ),
}


def _fix(kind: str, paths: list[str], obj: Any, *, alone: bool) -> str:
    """The way out that keeps the checkpoint weights-only, for the values at ``paths``.

    ``alone``: these are all the values refused, so "its" says which.
    """
    one, several = _FIXES[kind]
    if not alone:
        return f"For {_listed(paths)}, {several if len(paths) > 1 else one}."
    if kind == "state_dict" and not paths[0]:  # the object saved: the code to write
        name = _name_for(obj)
        return f"Save its state_dict() instead: dk.save({name}.state_dict(), path)."
    return f"{one[0].upper()}{one[1:]}."


def _name_for(obj: object) -> str:
    """What the fixes call the object saved, in the code they show."""
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "checkpoint" if isinstance(obj, Mapping) else "obj"


def _saved_whole(obj: object) -> str:
    """The other way out: the whole object written anyway, for a load that runs its code."""
    name = _name_for(obj)
    return (
        f" Or, to save it whole, write dk.save({name}, path, weights_only=False) and load it "
        "with dk.load(path, weights_only=False) where its classes can be imported; only load "
        "such a file if you trust it, since unpickling it can execute arbitrary code."
    )


def _refused_even_if_allowed(pickled: bytes, names: list[str]) -> str | None:
    """Why a weights-only load, the globals ``names`` allowed, still refuses ``pickled``.

    None where it would build it, or where that cannot be told: a name that is no loaded
    module's (pickle wrote it from one), an error raised by a class's own code.
    """
    found = [_loaded(name) for name in names]
    if any(each is None for each in found):
        return None
    try:
        with _allowing:
            refused = weights_only_build_refusal(pickled, zip(found, names, strict=True))
    except Exception:  # a class's own code, run on meta tensors: nothing to tell
        return None
    return None if refused is None else f"PyTorch: {_first_sentence(refused)}"


def _loaded(qualified: str) -> Any:
    """The global pickle wrote as ``qualified`` (``module.Name``), from a loaded module."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            found: Any = module
            for part in parts[cut:]:
                found = getattr(found, part, None)
            return found
    return None


def _first_sentence(text: str) -> str:
    text = text.rsplit("WeightsUnpickler error:", maxsplit=1)[-1].strip()
    return shown(text.split(". ")[0].strip(" ."), limit=160)


def _qualified(value: object) -> str | None:
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else None


# What pickle writes as it is, with no global to name: a value of these types is never
# the refused one (a defaultdict's list values are not its factory, builtins.list).
_WRITTEN_AS_IS: Final = frozenset({type(None), bool, int, float, str, dict, list, tuple})


def _by_reference(value: object) -> bool:
    """Whether pickle writes ``value`` as a global of its own: a class or a function."""
    return isinstance(value, type | types.FunctionType | types.BuiltinFunctionType)


def _is_refused(value: object, names: frozenset[str]) -> bool:
    if _by_reference(value) and _qualified(value) in names:
        return True
    kind = type(value)
    return kind not in _WRITTEN_AS_IS and _qualified(kind) in names


# A path from the object saved, one fragment a level ("['model']", "[0]", ".lr"): a
# chain of (the path above, the last fragment), shared by the values it leads to.
_Path: TypeAlias = "tuple[_Path, str] | None"


def _fragments(path: _Path) -> list[str]:
    fragments: list[str] = []
    while path is not None:
        path, fragment = path
        fragments.append(fragment)
    return fragments[::-1]


def _refused_in(root: Any, names: frozenset[str]) -> list[tuple[str, Any]]:
    """Where in ``root`` the values pickled as one of the global ``names`` are, outermost only.

    Each such value once (the first path to it), and none inside another: a module's
    own modules go with it. A search on the error path only, through devicekit's one
    walk (:mod:`devicekit._tree`, iterative), first in the order pickle writes (an object
    before what it holds), then through the attributes of the leaves pickle saves by
    their ``__dict__`` (``argparse.Namespace``, a class allowed with add_safe_globals),
    each object once, breadth first. Containers and attribute hops count together against
    the depth rule of every walk: a container or object ``MAX_DEPTH`` levels down is refused.

    Raises:
        TransferError: The data nests deeper than MAX_DEPTH, or holds a cycle.
    """
    found: dict[int, tuple[str, Any]] = {}  # by id: an object saved twice is named once
    entered: set[int] = set()  # objects whose attributes were queued
    queue: deque[tuple[_Path, int, Any]] = deque([(None, 0, root)])  # path, its levels, data
    while queue:
        above, levels, tree = queue.popleft()
        chain: list[_Path] = []  # the path to the value open at each depth of this walk
        inside = _tree.MAX_DEPTH + 1  # the depth of a refused container being passed over
        for depth, key, value, is_container in _tree.preorder(_tree.flatten(tree)):
            if depth > inside:
                continue
            inside = _tree.MAX_DEPTH + 1
            here = above if depth == 0 else (chain[depth - 1], key)
            del chain[depth:]
            chain.append(here)
            if _is_refused(value, names):
                found.setdefault(id(value), ("".join(_fragments(here)), value))
                inside = depth if is_container else inside
                continue
            state = None if is_container else getattr(value, "__dict__", None)
            if type(state) is not dict or id(value) in entered or _by_reference(value):
                state = None
            if (is_container or state is not None) and levels + depth >= _tree.MAX_DEPTH:
                too_deep = _tree.too_deep_at("data", _fragments(here))
                raise too_deep
            if state is not None:
                entered.add(id(value))
                queue.extend(
                    ((here, f".{name}"), levels + depth + 1, each) for name, each in state.items()
                )
    return list(found.values())


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
    what :func:`save` writes: tensors, containers, plain Python values, numpy scalars
    and arrays, ``argparse.Namespace`` and ``pathlib`` paths.

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
        TypeError: ``weights_only`` is not True or False: anything else could be read as
            permission to run the pickle's code; ``f`` was opened in text mode, or is
            bytes or a file descriptor; ``device`` and ``map_location`` disagree.
        ValueError: The file is empty, not one written by ``torch.save``, cut short or
            damaged, or a device; or ``mmap=True`` for what is no regular file.
        pickle.UnpicklingError: The checkpoint holds an object a weights-only load does
            not build; the message names it and how to allow it.
        TransferError: The checkpoint holds tensors on the meta device (a shape and no
            data), which no map_location can give data to; the message names them.
    """
    _check_weights_only(weights_only, "False runs the code a pickle holds")
    _check_binary(f, "load from")
    target = _load_device(device, map_location)
    source, name = _source(f, mmap)
    _check_format(source, name)
    start = None if isinstance(source, str) else source.tell()
    try:
        with _allowing:
            loaded = torch.load(source, map_location=target, weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as err:
        text = _ESCAPES.sub("", str(err))
        refused = _refused_on_load(text, name, source, start) if weights_only else None
        if refused is not None:
            raise pickle.UnpicklingError(refused) from None
        raise ValueError(_damaged(name, _first_sentence(text))) from None
    except (EOFError, KeyError, UnicodeDecodeError, RuntimeError, OSError) as err:
        # Past the format check, these are an archive cut or damaged inside, or one that
        # is no checkpoint (PyTorch's reader names a record it cannot find).
        if isinstance(err, RuntimeError) and not _unreadable(err):
            raise
        if isinstance(err, OSError) and err.errno not in (errno.EINVAL, None):
            raise
        raise ValueError(_damaged(name, _ESCAPES.sub("", str(err)))) from None
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
    """What torch.load reads, and its name for messages: a path, or a seekable file object.

    A pipe, a FIFO or an unseekable stream is read once into memory here: torch.load
    needs to seek, and opening a pipe twice loses what its writer wrote.
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
    if _seekable(file):
        return file, name
    return io.BytesIO(file.read()), name


def _seekable(stream: Any) -> bool:
    try:
        return bool(stream.seekable()) and stream.tell() >= 0
    except (AttributeError, OSError, ValueError):
        return False


def _check_format(source: str | IO[bytes], name: str) -> None:
    """Refuse what is no whole checkpoint before torch.load reads it, saying what it is."""
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
        return
    if head[2:].startswith(_LEGACY_MAGIC):
        return
    # Never handed to torch.load: its refusal would advise weights_only=False, that is
    # running a pickle's code, for a file that is no checkpoint at all.
    why = "is empty" if not head else f"is not one (it begins with {head[:8]!r})"
    msg = f"Expected a file written by torch.save, but {name} {why}."
    raise ValueError(msg)


def _damaged(name: str, said: str) -> str:
    said = shown(said.split(". ", maxsplit=1)[0].strip(" ."), limit=120)
    return (
        f"Expected a file written by torch.save, but {name} is cut short or damaged, or a "
        f"zip archive that is not a checkpoint (PyTorch: {said})."
    )


def _refused_on_load(
    text: str, name: str, source: str | IO[bytes], start: int | None
) -> str | None:
    """The words for a weights-only refusal: what the file holds, and the ways to load it.

    Every global the load refuses is named, read from the checkpoint's pickle (a scan:
    nothing of the file is built or called), where PyTorch names the first; the file is
    read from ``start`` (a stream's position before the load). Loading it whole is
    advised for a file you trust; allowing its classes too, where each is a class of the
    program's own (not a function, which the load would call, nor a module or an
    optimizer, whose state_dict is the way to save them as weights, nor a class of
    Python's or PyTorch's, such as a defaultdict, which allowing may not build).
    """
    blocked = re.search(r"GLOBAL (\S+) whose module (\S+) is blocked", text)
    if blocked:
        return (
            f"Refusing to load {name}: it calls {blocked.group(1)}, which runs commands on "
            "this machine. The file is unsafe: do not load it."
        )
    match = re.search(r"GLOBAL (\S+)|<class '([^']+)'>", text)
    if match is None:  # an operand no pickle of torch.save's has: damaged, as load says
        return None
    pickled = _pickle_in(source, start)
    with _allowing:
        names = [] if pickled is None else weights_only_refused_globals(pickled)
    names = names or [match.group(1) or match.group(2)]
    holds = ", ".join(names)
    whole = (
        f"Cannot load {name} as weights and plain data: it holds {holds}, which a "
        "weights-only load, dk.load's default, does not build or call, since that could run "
        "code the file chooses. If you trust the file, load it whole with "
        "dk.load(path, weights_only=False) where its classes can be imported; only load a "
        "file you trust, since unpickling it can execute arbitrary code."
    )
    if not all(_of_the_program(_loaded(each)) for each in names):
        return whole
    shorts = ", ".join(each.rsplit(".", 1)[-1] for each in names)
    known = (
        "it is a class of yours that is safe to build, allow it"
        if len(names) == 1
        else "they are classes of yours that are safe to build, allow them"
    )
    return (
        f"{whole} Or, if you know {known} first: torch.serialization.add_safe_globals([{shorts}])."
    )


def _of_the_program(value: object) -> bool:
    """Whether ``value`` is a class of the program's own that holds data, not a module's."""
    return (
        isinstance(value, type)
        and value.__module__.split(".")[0] not in {"builtins", "collections", "torch"}
        and not callable(getattr(value, "state_dict", None))
    )


def _pickle_in(source: str | IO[bytes], start: int | None) -> bytes | None:
    """The pickle of a checkpoint in torch.save's zip format; None for the legacy format."""
    try:
        if start is not None:
            cast("IO[bytes]", source).seek(start)
        with zipfile.ZipFile(source) as archive:
            record = next(each for each in archive.namelist() if each.endswith("/data.pkl"))
            return archive.read(record)
    except (zipfile.BadZipFile, StopIteration, OSError, ValueError):
        return None


def _unreadable(err: RuntimeError) -> bool:
    """Whether torch.load's RuntimeError says the archive is not a whole checkpoint."""
    text = str(err)
    return any(
        sign in text
        for sign in ("PytorchStreamReader", "zip archive", "enforce fail", "file not found")
    )
