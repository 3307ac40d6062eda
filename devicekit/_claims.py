"""Claims on GPUs that every job of a machine sees: one OS file lock per GPU.

A claim is an exclusive ``flock`` on a file named after the GPU's UUID in the claim
directory (``DEVICEKIT_CLAIM_DIR``, else ``devicekit-claims`` in the system's temporary
directory). The operating system drops the lock when the file is closed or its process
ends in any way, ``kill -9`` included, so a claim can never outlive its job the way a
pid file does. The file holds the claiming pid, for messages only: whether a GPU is
claimed is the lock's to say, never the file's contents.

The directory is shared by every user's jobs, as /tmp is, so nothing another user put
there is trusted: the directory is opened once, without following a link another user
made, and refused where anyone may rename the files in it; a claim file is opened
without following links or blocking, and this process writes into it (its pid) only
where it is a regular file of this user with one name. So a link planted under a GPU's
name can never make a job truncate, write or chmod a file elsewhere.

A claim belongs to the process: managers of one process that choose the same GPU share
its claim, held until the last of them gives it back; a forked child (a DataLoader
worker) closes its copies of the locks, so it never holds its parent's GPU.

Claims are advisory: only managers built with ``claim=True`` take and respect them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Literal, overload

if sys.platform != "win32":
    import fcntl

__all__ = ["Claim", "claim_dir", "directory_problem", "holders", "take"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_ADVICE = (
    "Set DEVICEKIT_CLAIM_DIR to a directory on this machine's own disk that every job can "
    "write, such as /tmp/devicekit-claims."
)
# Never follow a link at the last step, never wait on a FIFO, never leak into exec'd programs.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC if sys.platform != "win32" else 0

# This process's claims by GPU key; `take` and `release` change it under the lock.
_taken: dict[str, Claim] = {}
_lock = threading.Lock()


def claim_dir() -> Path:
    """The directory of the claims: ``DEVICEKIT_CLAIM_DIR``, else one in the temp directory.

    Raises:
        OSError: ``DEVICEKIT_CLAIM_DIR`` is a relative path (``~`` is expanded first).
    """
    configured = os.environ.get("DEVICEKIT_CLAIM_DIR", "").strip()
    if not configured:
        return Path(tempfile.gettempdir()) / "devicekit-claims"
    expanded = os.path.expanduser(configured)
    if not os.path.isabs(expanded):
        msg = (
            f"Expected DEVICEKIT_CLAIM_DIR to be an absolute path, got {configured!r}: jobs "
            "started in different folders would each read it as a directory of their own, "
            f"and claim the same GPU. {_ADVICE}"
        )
        raise OSError(errno.EINVAL, msg)
    return Path(expanded)


def _file_name(key: str) -> str:
    return f"{_UNSAFE.sub('_', key)}.lock"


def _check_platform() -> None:
    if sys.platform == "win32":
        msg = (
            "Cannot claim a GPU on Windows: claims are file locks (fcntl.flock), which Linux "
            "and macOS have. Leave claim=False there."
        )
        raise OSError(errno.ENOSYS, msg)


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


def _open_lock(directory: int, path: Path) -> tuple[int, bool]:
    """The lock file at ``path`` (in ``directory``), and whether this job may write its pid."""
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
                descriptor = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=directory)
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


def take(key: str) -> Claim | None:
    """Claim the GPU ``key`` names (its UUID) without waiting; None where another job holds it.

    Where this process holds it already, the claim is shared: one more holder.
    """
    _check_platform()
    with _lock:
        if (held := _taken.get(key)) is not None:
            held._holders += 1
            return held
        directory = _open_directory()
        path = claim_dir() / _file_name(key)
        try:
            descriptor, own = _open_lock(directory, path)
        finally:
            os.close(directory)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return None
        except BaseException:
            os.close(descriptor)
            raise
        if own:  # the pid, for other jobs' messages; never into a file of another user's
            try:
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # opened read-only, or a full disk: the lock is the claim
        claim = _taken[key] = Claim(key, path, descriptor)
        return claim


def holders(keys: list[str]) -> dict[str, int | None]:
    """The GPUs among ``keys`` that another job claims, with its pid (None where unknown).

    Reads without claiming and makes nothing: a key without a file is not claimed, nor
    is one this process claims (its managers share it), nor any where the claim
    directory is unusable (claiming says why).
    """
    found: dict[str, int | None] = {}
    with _lock:
        keys = [key for key in keys if key not in _taken]
    if not keys or sys.platform == "win32":
        return found
    try:
        directory = os.open(claim_dir(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return found
    try:
        for key in keys:
            try:
                descriptor = os.open(_file_name(key), os.O_RDONLY | _OPEN_FLAGS, dir_fd=directory)
            except OSError:  # no file (never claimed), or a link, which no job locks
                continue
            try:
                fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
                found[key] = int(text) if text.isdecimal() else None
            except OSError:  # not lockable (no regular file): nobody's claim
                pass
            else:
                fcntl.flock(descriptor, fcntl.LOCK_UN)
            finally:
                os.close(descriptor)
    finally:
        os.close(directory)
    return found


def _forget_after_fork() -> None:
    """In a forked child: close its copies of the parent's locks, which unlocks nothing.

    A lock belongs to the open file that both processes share after a fork; closing the
    child's descriptor leaves the parent's claim whole, and the child holding none means
    the claim ends with the parent, ``kill -9`` included, not with its last worker.
    """
    for claim in _taken.values():
        if claim._descriptor is not None:
            with contextlib.suppress(OSError):
                os.close(claim._descriptor)
        claim._descriptor, claim._holders = None, 0
    _taken.clear()
    _lock.release()


if hasattr(os, "register_at_fork"):
    # The lock is held across the fork, so no other thread is inside `take` or `release`
    # with it when the child starts (that thread would not exist there to let go).
    os.register_at_fork(
        before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_forget_after_fork
    )
