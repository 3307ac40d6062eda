"""Claims on GPUs that every job of a machine sees: one OS file lock per GPU.

A claim is an exclusive ``flock`` on a file named after the GPU's UUID in the claim
directory (``DEVICEKIT_CLAIM_DIR``, else ``devicekit-claims`` in the system's temporary
directory). The operating system drops the lock when the file is closed or its process
ends in any way, ``kill -9`` included, so a claim can never outlive its job the way a
pid file does. The file holds the claiming pid, for messages only: whether a GPU is
claimed is the lock's to say, never the file's contents.

Claims are advisory: only managers built with ``claim=True`` take and respect them.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import tempfile
from pathlib import Path

if sys.platform != "win32":
    import fcntl

__all__ = ["Claim", "claim_dir", "holders", "take"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def claim_dir() -> Path:
    """The directory of the claims: ``DEVICEKIT_CLAIM_DIR``, else one in the temp directory."""
    configured = os.environ.get("DEVICEKIT_CLAIM_DIR", "").strip()
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "devicekit-claims"


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
    """A GPU claimed by this process: held until :meth:`release` or the process ends."""

    def __init__(self, path: Path, descriptor: int) -> None:
        self.path = path
        self._descriptor: int | None = descriptor

    def release(self) -> None:
        """Give the GPU back; a second call does nothing."""
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing drops the lock
            self._descriptor = None


def _directory() -> Path:
    """The claim directory, made where missing: open to every user's jobs, as /tmp is."""
    directory = claim_dir()
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return directory
    except OSError as err:
        msg = (
            f"Cannot claim a GPU: the claim directory {directory} cannot be made ({err.strerror}). "
            "Set DEVICEKIT_CLAIM_DIR to a directory every job on this machine can write."
        )
        raise OSError(err.errno, msg) from None
    # Open to all, with the sticky bit: any user's job adds claims, none removes others'.
    os.chmod(directory, 0o1777)  # noqa: S103
    return directory


def take(key: str) -> Claim | None:
    """Claim the GPU ``key`` names (its UUID) without waiting; None where another holds it."""
    _check_platform()
    path = _directory() / _file_name(key)
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError as refused:
        try:  # another user's claim file: a lock needs no write access
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            msg = (
                f"Cannot claim a GPU: {path} cannot be made ({refused.strerror}). Set "
                "DEVICEKIT_CLAIM_DIR to a directory every job on this machine can write."
            )
            raise OSError(refused.errno, msg) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    except BaseException:
        os.close(descriptor)
        raise
    try:  # the pid, for other jobs' messages; a file opened read-only keeps it unsaid
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        os.fchmod(descriptor, 0o666)  # the next user's job may then write its pid too
    except OSError:
        pass
    return Claim(path, descriptor)


def holders(keys: list[str]) -> dict[str, int | None]:
    """The GPUs among ``keys`` that some job claims, with its pid (None where unknown).

    Reads without claiming and makes nothing: a key without a file is not claimed.
    """
    found: dict[str, int | None] = {}
    if not keys or sys.platform == "win32":
        return found
    for key in keys:
        try:
            descriptor = os.open(claim_dir() / _file_name(key), os.O_RDONLY)
        except OSError:  # no file (never claimed), or no directory
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
            found[key] = int(text) if text.isdecimal() else None
        else:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
        finally:
            os.close(descriptor)
    return found
