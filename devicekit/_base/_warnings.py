"""Warnings and messages that point at the user's line, not at devicekit's."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from types import FrameType

__all__ = ["caller", "warn"]

# Frames in devicekit's folder, and in the standard library's plumbing that its calls go
# through (decorators, context managers). Not the standard library's whole folder: a
# package installed into the interpreter's own site-packages lives under it.
_DEVICEKIT = os.path.dirname(os.path.dirname(__file__)) + os.sep  # the package, not _base
_PLUMBING = frozenset({functools.__file__, contextlib.__file__})


def _outside(frame: FrameType | None) -> tuple[FrameType | None, int]:
    """The first frame from ``frame`` outwards that is not devicekit's, and how many it skipped."""
    skipped = 0
    while frame is not None and (
        frame.f_code.co_filename.startswith(_DEVICEKIT) or frame.f_code.co_filename in _PLUMBING
    ):
        frame = frame.f_back
        skipped += 1
    return frame, skipped


def caller() -> str:
    """``file:line`` of the user's code that called into devicekit, for messages."""
    frame, _ = _outside(sys._getframe(1))
    return "an unknown place" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def warn(message: str, category: type[Warning]) -> None:
    """Warn with the first frame outside devicekit as the place of the warning.

    A warning raised deep inside (the CPU fallback, reached from ``to_device`` through
    the process's default manager) would otherwise name devicekit's own file; users
    need the line of theirs that led there.
    """
    _, skipped = _outside(sys._getframe(1))
    warnings.warn(message, category, stacklevel=2 + skipped)  # 1 is this function
