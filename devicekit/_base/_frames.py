"""Whose line is it: a frame of the user's code, or of PyTorch, devicekit or the standard library.

A message that points at "your line" (a warning, each of track_transfers' events,
guard's account of a failed forward, where a manager was opened) skips the frames of
the libraries beneath it. The rule, in one place for all: the nearest folder around a
file decides, and installed packages are the user's, even where a system Python keeps
them inside the standard library's folder.
"""

from __future__ import annotations

import contextlib
import os
import site
import sys
import warnings
from types import FrameType

import torch

__all__ = ["caller", "is_library", "user_frame", "warn"]


def _folder(path: str) -> str:
    return os.path.join(os.path.normpath(path), "")  # with its separator: a prefix of files


# Frames inside these folders are not "the user's line": PyTorch's, devicekit's (the
# folder above this file's), the standard library's.
_OWN_FOLDERS = tuple(
    _folder(os.path.dirname(path))
    for path in (torch.__file__, os.path.dirname(__file__), contextlib.__file__)
    if path is not None
)
# Except where installed packages live: a system Python (Debian's, a conda base) keeps
# them beneath the standard library's folder (/usr/lib/python3.11/site-packages). Found
# at import, not on first use: an import then, in a child forked while another thread
# held the import lock, would hang.
_PACKAGE_FOLDERS = tuple(
    _folder(path)
    for path in {
        *site.getsitepackages(),
        site.getusersitepackages(),
    }
    if path
)
_PACKAGE_NAMES = frozenset({"site-packages", "dist-packages"})


def is_library(
    filename: str, own: tuple[str, ...] | None = None, packages: tuple[str, ...] | None = None
) -> bool:
    """Whether a frame in ``filename`` is PyTorch's, devicekit's or the standard library's.

    The nearest folder around the file decides: a folder of installed packages inside
    one of ``own`` (by default PyTorch's, devicekit's, the standard library's) is not
    one of them, whether it is known (``packages``: site's) or named
    ``site-packages`` or ``dist-packages``.

    >>> own = ("/usr/lib/python3.11/", "/usr/lib/python3.11/site-packages/torch/")
    >>> [is_library(f"/usr/lib/python3.11/{name}", own, packages=()) for name in (
    ...     "contextlib.py", "site-packages/transformers/trainer.py", "site-packages/torch/nn.py")]
    [True, False, True]
    """
    own = _OWN_FOLDERS if own is None else own
    nearest = max((folder for folder in own if filename.startswith(folder)), key=len, default="")
    if not nearest:
        return False
    if any(
        len(folder) > len(nearest) and folder.startswith(nearest) and filename.startswith(folder)
        for folder in (_PACKAGE_FOLDERS if packages is None else packages)
    ):
        return False
    return _PACKAGE_NAMES.isdisjoint(filename[len(nearest) :].split(os.sep)[:-1])


def user_frame(frame: FrameType | None) -> tuple[FrameType | None, int]:
    """The first frame from ``frame`` outwards that is the user's, and how many it skipped."""
    skipped = 0
    while frame is not None and is_library(frame.f_code.co_filename):
        frame = frame.f_back
        skipped += 1
    return frame, skipped


def caller() -> str:
    """``file:line`` of the user's code that called into devicekit, for messages."""
    frame, _ = user_frame(sys._getframe(1))
    return "an unknown place" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def warn(message: str, category: type[Warning]) -> None:
    """Warn with the user's frame as the place of the warning.

    A warning raised deep inside (the CPU fallback, reached from ``to_device`` through
    the process's default manager) would otherwise name devicekit's own file; users
    need the line of theirs that led there.
    """
    _, skipped = user_frame(sys._getframe(1))
    warnings.warn(message, category, stacklevel=2 + skipped)  # 1 is this function
