"""Whole-file OS locks that other processes can ask about without taking one.

A lock here is an exclusive ``flock`` of an open file (what :mod:`devicekit._select._claims`
makes a claim of) with, where Linux offers it (3.15+, ``F_OFD_SETLK``), a write lock of
the same open file. Both belong to the open file: closing its last descriptor drops
them, whether the process ends in any way or a forked child closes its copy.

Asking takes no lock: the kernel says whether another open file holds a write lock on
the file (``F_OFD_GETLK``), answered alike across containers (PID namespaces) and file
systems; where none is there (an older devicekit's lock holds only its ``flock``; NFS,
or a file this user may only read, may refuse the write lock), the kernel's table of
locks (``/proc/locks``) still shows an exclusive ``flock`` of a process in this
container. So no one's question can make a free file look locked to a process locking
it at that moment. Where the kernel answers neither (macOS), a shared lock dropped at
once is the question, and a process meeting one tries again for a moment
(``_LOOK_S``) before it counts the file as locked.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import time
from collections.abc import Callable

if sys.platform != "win32":
    import fcntl

__all__ = ["Table", "lock", "locked", "read_table"]

# Linux's table of the locks held on the machine (the tests point it elsewhere): since
# Linux 4.9 it leaves out the flocks of processes in other containers (PID namespaces).
_LOCK_TABLE = "/proc/locks"
# Locks of an open file: False where Python has none (macOS; the tests' seam).
_OFD = sys.platform.startswith("linux") and hasattr(fcntl, "F_OFD_GETLK")
# Linux's struct flock: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid, padded to the alignment of off_t (32 bytes on x86_64 and aarch64).
# l_start = l_len = 0 from SEEK_SET is the whole file; l_pid must be 0 on input.
_FLOCK = struct.Struct("hhqqi0q")
# A lock that meets a shared one (a question, where questions take one) tries again
# after 1 ms, then twice as long each time, for at most this long: a question holds its
# lock between two system calls, so only one whose process is stopped outlasts it.
_LOOK_S = 0.25
_FIRST_PAUSE_S = 0.001
_pause = time.sleep  # the tests' seam: a question they hold ends in the first pause

Table = dict[tuple[int, int], bool]
"""The files locked now, by (device, inode), each with whether a lock on it is exclusive."""


def _hold_write_lock(descriptor: int) -> None:
    """Add the open file's write lock to its ``flock``, for questions to meet.

    Where it cannot be had, the ``flock`` alone is the lock (see the module).
    """
    if _OFD:
        with contextlib.suppress(OSError):
            whole = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            fcntl.fcntl(descriptor, fcntl.F_OFD_SETLK, whole)


def _write_locked(descriptor: int) -> bool | None:
    """Whether another open file holds a write lock on this one's file; None where untold.

    A read lock over the whole file, which conflicts only with a write lock, is tested
    and not placed.
    """
    if not _OFD:
        return None
    try:
        asked = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
        answer = fcntl.fcntl(descriptor, fcntl.F_OFD_GETLK, asked)
    except OSError:
        return None
    return bool(_FLOCK.unpack(answer)[0] == fcntl.F_WRLCK)


def read_table() -> Table | None:
    """The kernel's table of locks, read without taking one; None where there is none.

    Some file systems (btrfs subvolumes) number devices there otherwise than ``stat``:
    it is only asked where the open file's write lock says nothing.
    """
    try:
        descriptor = os.open(_LOCK_TABLE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(descriptor, 1 << 16):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(descriptor)
    found: Table = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF"; "1: -> FLOCK ..." waits, holds none
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            where = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
        except ValueError:
            continue
        found[where] = found.get(where, False) or fields[3] == "WRITE"
    return found


def _asked(descriptor: int, table: Callable[[], Table | None]) -> bool | None:
    """Whether another process locks the open file, as the kernel tells; None where untold."""
    written = _write_locked(descriptor)
    if written:
        return True
    locks = table()
    if locks is None:
        return None if written is None else False
    found = os.fstat(descriptor)
    return locks.get((found.st_dev, found.st_ino), False)


def locked(descriptor: int, table: Callable[[], Table | None]) -> bool:
    """Whether another process locks the open file; ``table()`` is read only where needed.

    Where the kernel tells nothing, a shared lock, dropped at once, is the question.
    """
    told = _asked(descriptor, table)
    if told is not None:
        return told
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(descriptor, fcntl.LOCK_UN)
    return False


def lock(descriptor: int) -> bool:
    """Lock an open file for this process, without waiting; False where another holds it.

    Meeting a lock, it asks whose: a lock's is given up on at once. Any other is a
    question (an older devicekit's, or one made where the kernel tells nothing) or a
    lock that cannot be told from one: a question ends at once, so it is waited out, for
    ``_LOOK_S`` at most.
    """
    pause, waited = _FIRST_PAUSE_S, 0.0
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            _hold_write_lock(descriptor)
            return True
        if waited >= _LOOK_S or _asked(descriptor, read_table):
            return False
        _pause(pause)
        waited += pause
        pause *= 2
