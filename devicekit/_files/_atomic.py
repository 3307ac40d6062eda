"""The atomic writer: a file at a path is replaced whole, or not at all.

Its invariant: however a write ends (an exception, a full disk, Ctrl-C, a preemption),
the path holds the file that was there or the new one, never a torn one, and no
temporary is left beside it. The new file is written to a temporary in the target's
folder, flushed to disk, and renamed over the target (atomic on POSIX and Windows).
Where Linux allows it (``O_TMPFILE``, a file system's choice), the temporary has no name
until it is whole, so a process killed while it writes (SIGKILL, or SIGTERM in a write
from a thread) leaves nothing behind, but for the moment between naming it and the
rename. Elsewhere it is named from the start (``.NAME.XXXXXXXX.tmp``) and removed on
every exit the process sees: an exception, Ctrl-C, and SIGTERM or SIGHUP in the main
thread, which are then delivered again as they would have been. Flushing the folder (the
rename, on disk) is durability only: a folder this user may write but not list, or that
refuses the flush, never fails a write.

What a path names decides how it is written:

=====================  ==============================================================
the path names         :func:`write_file`
=====================  ==============================================================
nothing, or a file     the temporary, renamed over it; the mode and owner of the file
of this user's         replaced are kept (a new file: ``0o666 & ~umask``)
a symbolic link        the file it points to, replaced in the same way; the link stays
a device or a FIFO     written in place, as torch.save writes (``/dev/null`` stays
                       one), opened only when the writer has its first byte ready
another user's file    refused, naming its owner: the new file would be this user's,
                       and only root can give it back (root replaces it, and does)
a folder: a directory  refused, naming the path (torch.save refuses ``runs/`` and
or what ends with a    ``ck.pt/`` too)
slash; a read-only
file; a socket
=====================  ==============================================================

Every refusal names the path as given (and a link's target), never the temporary.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from typing import IO, TypeAlias, cast

__all__ = ["Write", "write_file"]

Write: TypeAlias = Callable[[Callable[[], IO[bytes]], str], None]
"""What writes the file: ``write(opening, where)`` calls ``opening()`` once its first byte
is ready and writes to the file it gives; ``where`` names the path for messages."""


def write_file(given: str, write: Write) -> None:
    """Write the file at the path ``given`` through ``write``: whole, or not at all.

    Raises:
        OSError: The refusals of the table above, and those of :func:`devicekit.save`'s
            Raises: the message names the path, never the temporary.
    """
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
            with contextlib.ExitStack() as opened:  # opened late: a FIFO waits for a reader
                write(lambda: opened.enter_context(open(target, "wb")), shown_path)
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
    directory: int | None = None  # opened before anything is written, to flush the rename
    if hasattr(os, "O_DIRECTORY"):
        with contextlib.suppress(OSError):  # a missing folder: named by the temporary's open
            directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _replace(target, folder, found, shown_path, write)
        if directory is not None:
            # Durability only: the file is replaced by now, and some file systems refuse
            # to flush a folder (EINVAL on FUSE and network mounts): no failure reported.
            with contextlib.suppress(OSError):
                os.fsync(directory)
    finally:
        if directory is not None:
            os.close(directory)


def _refuse_a_folder_name(given: str) -> None:
    """Refuse a path that names a folder by its form (``"runs/"``) but no folder is there.

    ``realpath`` drops the slash (``"ck.pt/"`` would be ``ck.pt``); torch.save refuses it.
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


def _replace(
    target: str, folder: str, found: os.stat_result | None, shown_path: str, write: Write
) -> None:
    """Write a temporary beside ``target``, flush it to disk, and rename it over ``target``."""
    temporary = _Temporary(folder, os.path.basename(target), found, shown_path)
    with _removed_on_any_exit(temporary):
        sink = _Sink(os.fdopen(temporary.descriptor, "wb"))
        try:
            with sink.file:
                write(lambda: cast("IO[bytes]", sink), shown_path)
                sink.file.flush()
                os.fsync(sink.file.fileno())
                temporary.name_it(sink.file.fileno())
        except Exception as err:
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
    """The temporary as the writer sees it, keeping the operating system's refusal of a write.

    The user is told that refusal (a full disk, a quota), not the writer's own words for it
    (PyTorch's zip writer: "enforce fail ... unexpected pos").
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
    """A new file beside the target, with the mode (and owner) the written file is to have.

    Unnamed where ``O_TMPFILE`` allows, and named only when whole (:meth:`name_it`).
    """

    def __init__(
        self, folder: str, name: str, replaced: os.stat_result | None, shown_path: str
    ) -> None:
        self.beside = (folder, name)
        self.path = _temporary_name(folder, name)  # its name, or the one it will have
        # A new checkpoint gets 0o666 less the umask, as torch.save's open() gives it;
        # one that replaces a file starts private and then takes that file's mode and owner.
        mode = 0o666 if replaced is None else 0o600
        descriptor: int | None = None
        unnamed = getattr(os, "O_TMPFILE", 0)  # no name until whole, where Linux allows
        if unnamed and os.path.isdir("/proc/self/fd"):  # named later through it (linkat)
            # Not on this file system, or refused: the named way below says why.
            with contextlib.suppress(OSError):
                descriptor = os.open(folder, unnamed | os.O_WRONLY, mode)
        self.named = descriptor is None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        while descriptor is None:
            try:
                descriptor = os.open(self.path, flags, mode)
            except FileExistsError:  # noqa: PERF203 - a name taken, rarely: another draw
                self.path = _temporary_name(folder, name)
            except OSError as err:
                raise _cannot_write(shown_path, folder, err, replaced is not None) from None
        self.descriptor = descriptor
        try:
            if replaced is not None and hasattr(os, "fchown"):  # POSIX owners and modes
                self._keep_owner(replaced, shown_path)
                os.fchmod(descriptor, stat.S_IMODE(replaced.st_mode))
        except BaseException:
            os.close(descriptor)
            self.remove()
            raise

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
    """Remove ``temporary`` however the block is left, SIGTERM and SIGHUP as the module says.

    Only a signal's default action is replaced (Python runs handlers in the main thread
    alone): a program's own handler (a preemption hook that saves) is left alone.
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
