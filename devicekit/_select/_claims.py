"""Claims on GPUs that every job of a machine sees: one OS file lock per GPU.

A claim is a lock of :mod:`devicekit._select._file_locks` (an exclusive ``flock``) on a file
named after the GPU's UUID in the claim directory (``DEVICEKIT_CLAIM_DIR``, else
``devicekit-claims`` in the system's temporary directory). The operating system drops
it when the file is closed or its process ends in any way, ``kill -9`` included, so a
claim can never outlive its job the way a pid file does; and other jobs ask about it
without taking a lock, so a look (a manager's, ``devicekit info``) can never make a
free GPU look claimed to a job claiming it at that moment. The file holds the claiming
pid, for messages only: whether a GPU is claimed is the lock's to say, never the file's.

The directory is shared by every user's jobs, as /tmp is, so nothing another user put
there is trusted: the directory is opened once, without following a link another user
made, and refused where anyone may rename the files in it; a claim file is opened
without following links or blocking, and this process writes into it (its pid) only
where it is a regular file of this user with one name. So a link planted under a GPU's
name can never make a job truncate, write or chmod a file elsewhere. Another user's
claim file that this user cannot open (mode 0600) cannot be locked by this user's jobs:
its GPU counts as claimed by that user, never as an error.

A claim belongs to the process: managers of one process that name the same GPU share
its claim, held until the last of them gives it back, while a manager choosing among
GPUs passes over those this process claims (``take(..., share=False)``); a forked child
(a DataLoader worker) closes its copies of the locks, so it never holds its parent's GPU.

Nothing here needs a lock that a fork can leave held: this module's lock is taken by
the forking thread around each fork and made anew in the child, and the temporary
directory is found without :func:`tempfile.gettempdir`'s lock.

Claims are advisory: only managers built with ``claim=True`` take and respect them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple, overload

from devicekit._select import _file_locks
from devicekit._select._fork_locks import ForkSafeLock

if sys.platform != "win32":
    import pwd

__all__ = ["Claim", "Holder", "claim_dir", "directory_problem", "holders", "take"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_ADVICE = (
    "Set DEVICEKIT_CLAIM_DIR to a directory on this machine's own disk that every job can "
    "write, such as /tmp/devicekit-claims."
)
# Never follow a link at the last step, never wait on a FIFO, never leak into exec'd programs.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC if sys.platform != "win32" else 0

# This process's claims by GPU key; `take` and `release` change it under the lock, which
# no fork leaves held (a forked child forgets the table: _forget_after_fork).
_taken: dict[str, Claim] = {}
_lock = ForkSafeLock()


def claim_dir() -> Path:
    """The directory of the claims: ``DEVICEKIT_CLAIM_DIR``, else one in the temp directory.

    Raises:
        OSError: ``DEVICEKIT_CLAIM_DIR`` is a relative path (``~`` is expanded first).
    """
    configured = os.environ.get("DEVICEKIT_CLAIM_DIR", "").strip()
    if not configured:
        return Path(_temporary_directory()) / "devicekit-claims"
    expanded = os.path.expanduser(configured)
    if not os.path.isabs(expanded):
        msg = (
            f"Expected DEVICEKIT_CLAIM_DIR to be an absolute path, got {configured!r}: jobs "
            "started in different folders would each read it as a directory of their own, "
            f"and claim the same GPU. {_ADVICE}"
        )
        raise OSError(errno.EINVAL, msg)
    return Path(expanded)


def _temporary_directory() -> str:
    """The system's temporary directory, found as :mod:`tempfile` finds it, with no lock.

    :func:`tempfile.gettempdir` holds a lock while it looks for the first time; a process
    forked while another thread held it would wait for it forever. So: the directory the
    program gave :mod:`tempfile`, else the first of ``$TMPDIR``, ``$TEMP``, ``$TMP``,
    ``/tmp``, ``/var/tmp`` and ``/usr/tmp`` that is a directory this user may write.

    >>> _temporary_directory() == tempfile.gettempdir()
    True
    """
    if tempfile.tempdir is not None:  # set by the program, or by a finished first look
        return os.fsdecode(tempfile.tempdir)
    if sys.platform == "win32":  # no fork() there, and other places to look
        return tempfile.gettempdir()
    named = [os.environ.get(name, "") for name in ("TMPDIR", "TEMP", "TMP")]
    for candidate in [*named, "/tmp", "/var/tmp", "/usr/tmp"]:  # noqa: S108 - tempfile's own list
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return os.path.abspath(candidate)
    return "/tmp"  # noqa: S108 - where claiming then says what is wrong


def _file_name(key: str) -> str:
    return f"{_UNSAFE.sub('_', key)}.lock"


class Holder(NamedTuple):
    """Who claims a GPU, as far as this process can tell; ``str()`` says it in words.

    >>> str(Holder(4242)), str(Holder()), str(Holder(ours=True))
    ('pid 4242', 'another job', 'this process (another of its managers)')
    >>> str(Holder(owner=0))
    'user root (uid 0, whose claim file this user cannot open)'
    """

    pid: int | None = None
    """The claiming process, as its claim file says; None where the file does not say."""
    owner: int | None = None
    """The user owning a claim file this user cannot open, and so cannot lock; else None."""
    ours: bool = False
    """Whether this process holds the claim (another of its managers took it)."""

    def __str__(self) -> str:
        if self.ours:
            return "this process (another of its managers)"
        if self.owner is not None:
            name = _user_name(self.owner)
            who = f"user {self.owner} (" if name is None else f"user {name} (uid {self.owner}, "
            return f"{who}whose claim file this user cannot open)"
        return "another job" if self.pid is None else f"pid {self.pid}"


def _user_name(uid: int) -> str | None:
    """The name of the user ``uid``; None where this machine does not list it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class Claim:
    """A GPU claimed by this process: held until its last holder lets go, or the process ends."""

    def __init__(self, key: str, path: Path, descriptor: int) -> None:
        self.key = key
        self.path = path
        self._descriptor: int | None = descriptor
        self._holders = 1

    def release(self) -> None:
        """Give back one holder's share; the last one gives the GPU back. Once per holder."""
        with _lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders:
                return
            _taken.pop(self.key, None)
            descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)  # closing drops the lock


def _refused(directory: Path, why: str, code: int) -> OSError:
    return OSError(code, f"Cannot claim a GPU: the claim directory {directory} {why}. {_ADVICE}")


def _check_sticky(directory: Path, mode: int) -> None:
    """Refuse a directory where any user may rename or remove another's claim files."""
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        msg = (
            f"lets any user rename or remove the claim files in it (mode {mode & 0o7777:o}, "
            "without the sticky bit that /tmp has: chmod +t fixes it)"
        )
        raise _refused(directory, msg, errno.EPERM)


def directory_problem() -> str | None:
    """What is wrong with the claim directory, in the sentence claiming would raise; or None.

    Reads and makes nothing: a directory still to be made is no problem.
    """
    try:
        descriptor = _open_directory(make=False)
    except OSError as err:
        return err.strerror
    if descriptor is not None:
        os.close(descriptor)
    return None


@overload
def _open_directory(*, make: Literal[True] = True) -> int: ...
@overload
def _open_directory(*, make: bool) -> int | None: ...
def _open_directory(*, make: bool = True) -> int | None:
    """The claim directory, opened (made where missing, open to all as /tmp is) and checked.

    With ``make=False`` a missing directory is None, and nothing is made.
    """
    directory = claim_dir()
    try:
        found = os.lstat(directory)
    except FileNotFoundError:
        if not make:
            return None
        found = None
    except OSError as err:
        why = (
            "cannot be made: a part of its path is a file, not a directory"
            if err.errno == errno.ENOTDIR
            else f"cannot be read ({err.strerror})"
        )
        raise _refused(directory, why, err.errno or errno.EIO) from None
    if found is None:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(directory, 0o700)  # opened up below, through its descriptor
            made = True
        except FileExistsError:  # another job made it first
            made = False
        except OSError as err:
            raise _refused(
                directory, f"cannot be made ({err.strerror})", err.errno or errno.EIO
            ) from None
        found = os.lstat(directory)
    else:
        made = False
    if stat.S_ISLNK(found.st_mode) and found.st_uid not in (os.geteuid(), 0):
        msg = (
            f"is a symbolic link that user {found.st_uid} made, where claims would follow "
            "it anywhere that user chose"
        )
        raise _refused(directory, msg, errno.EPERM)
    try:  # a link of this user's or root's is followed here, and only here
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        why = {
            errno.ENOTDIR: "is not a directory",
            errno.ENOENT: "is a link to nothing",
            errno.ELOOP: "is a loop of links",
        }.get(err.errno or 0, f"cannot be opened ({err.strerror})")
        raise _refused(directory, why, err.errno or errno.EIO) from None
    try:
        if made:  # open to every user's jobs; the sticky bit keeps each job's files its own
            os.fchmod(descriptor, 0o1777)
        _check_sticky(directory, os.fstat(descriptor).st_mode)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _open_lock(directory: int, path: Path) -> tuple[int, bool] | None:
    """The lock file at ``path`` (in ``directory``), and whether this job may write its pid.

    None where it is another user's file that this user may not open: theirs to claim.
    """
    name = path.name
    created = False
    try:
        try:
            descriptor = os.open(
                name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o666, dir_fd=directory
            )
            created = True
        except FileExistsError:
            try:
                descriptor = os.open(name, os.O_RDWR | _OPEN_FLAGS, dir_fd=directory)
            except PermissionError:  # another user's claim file: a lock needs no write access
                try:
                    descriptor = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=directory)
                except PermissionError:  # mode 0600: only its owner's jobs can lock it
                    return None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW says of a link
            msg = (
                f"Cannot claim a GPU: {path} is a symbolic link, where devicekit keeps a plain "
                "lock file; another user may have planted it to make this job write elsewhere. "
                f"Remove it, or set DEVICEKIT_CLAIM_DIR to a directory only your jobs can write."
            )
            raise OSError(err.errno, msg) from None
        msg = f"Cannot claim a GPU: {path} cannot be made or opened ({err.strerror}). {_ADVICE}"
        raise OSError(err.errno, msg) from None
    found = os.fstat(descriptor)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
        os.close(descriptor)
        what = (
            "has another name too (a hard link)"
            if stat.S_ISREG(found.st_mode)
            else "is no regular file"
        )
        msg = (
            f"Cannot claim a GPU: {path} {what}, where devicekit keeps a plain lock file of "
            "its own; another user may have put it there. Remove it, or set "
            "DEVICEKIT_CLAIM_DIR to a directory only your jobs can write."
        )
        raise OSError(errno.EPERM, msg)
    if created:  # the next user's job may then write its pid too
        os.fchmod(descriptor, 0o666)
    return descriptor, found.st_uid == os.geteuid()


def take(key: str, *, share: bool = True) -> Claim | None:
    """Claim the GPU ``key`` names (its UUID) without waiting; None where a job holds it.

    Where this process holds it already, ``share`` says whether this is one more holder
    of the claim (a manager naming its GPU), or the GPU is held (None: a manager choosing
    among GPUs, which wants one of its own). Where the claim file is another user's that
    this user may not open, the GPU is theirs: None.
    """
    if sys.platform == "win32":
        msg = (
            "Cannot claim a GPU on Windows: claims are file locks (fcntl.flock), which Linux "
            "and macOS have. Leave claim=False there."
        )
        raise OSError(errno.ENOSYS, msg)
    with _lock:
        if (held := _taken.get(key)) is not None:
            if not share:
                return None
            held._holders += 1
            return held
        directory = _open_directory()
        path = claim_dir() / _file_name(key)
        try:
            opened = _open_lock(directory, path)
        finally:
            os.close(directory)
        if opened is None:
            return None
        descriptor, own = opened
        try:
            locked = _file_locks.lock(descriptor)
        except BaseException:
            os.close(descriptor)
            raise
        if not locked:
            os.close(descriptor)
            return None
        if own:  # the pid, for other jobs' messages; never into a file of another user's
            try:
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # opened read-only, or a full disk: the lock is the claim
        claim = _taken[key] = Claim(key, path, descriptor)
        return claim


def holders(keys: list[str]) -> dict[str, Holder]:
    """The GPUs among ``keys`` that a job claims, this process included, and by whom.

    Takes no lock (where the kernel answers about locks: Linux) and makes nothing: a key
    without a file is not claimed, nor is a link or a FIFO under a GPU's name (claiming
    refuses those), nor any where the claim directory is unusable (claiming says why).
    Another user's claim file that this user may not open is claimed, by that user.
    """
    with _lock:
        found = {key: Holder(os.getpid(), ours=True) for key in keys if key in _taken}
    keys = [key for key in keys if key not in found]
    if not keys or sys.platform == "win32":
        return found
    try:
        directory = os.open(claim_dir(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return found
    try:
        table = functools.cache(_file_locks.read_table)  # once a look, only where needed
        for key in keys:
            holder = _holder(directory, _file_name(key), table)
            if holder is not None:
                found[key] = holder
    finally:
        os.close(directory)
    return found


def _holder(
    directory: int, name: str, table: Callable[[], _file_locks.Table | None]
) -> Holder | None:
    """Who claims the claim file ``name`` in ``directory``; None where nobody does."""
    try:
        descriptor = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=directory)
    except PermissionError:
        try:
            found = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except OSError:
            return None
        return Holder(owner=found.st_uid) if stat.S_ISREG(found.st_mode) else None
    except OSError:  # no file (never claimed), or a link, which no job locks
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # a FIFO, say: nobody's claim
            return None
        if not _file_locks.locked(descriptor, table):
            return None
        text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
        return Holder(int(text) if text.isdecimal() else None)
    finally:
        os.close(descriptor)


def _forget_after_fork() -> None:
    """In a forked child: close its copies of the parent's locks, which unlocks nothing.

    A lock belongs to the open file both processes share: closing the child's copy leaves
    the parent's claim whole, so the claim ends with the parent, not with its last worker.
    """
    for claim in _taken.values():
        if claim._descriptor is not None:
            with contextlib.suppress(OSError):
                os.close(claim._descriptor)
        claim._descriptor, claim._holders = None, 0
    _taken.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
