"""Warnings that point at the user's line, not at devicekit's."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

__all__ = ["warn"]

# Frames in devicekit's folder, and in the standard library's plumbing that its calls go
# through (decorators, context managers). Not the standard library's whole folder: a
# package installed into the interpreter's own site-packages lives under it.
_DEVICEKIT = os.path.dirname(__file__) + os.sep
_PLUMBING = frozenset({functools.__file__, contextlib.__file__})


def warn(message: str, category: type[Warning]) -> None:
    """Warn with the first frame outside devicekit as the place of the warning.

    A warning raised deep inside (the CPU fallback, reached from ``to_device`` through
    the process's default manager) would otherwise name devicekit's own file; users
    need the line of theirs that led there.
    """
    frame = sys._getframe(1)
    level = 2  # 1 is this function
    while frame is not None and (
        frame.f_code.co_filename.startswith(_DEVICEKIT) or frame.f_code.co_filename in _PLUMBING
    ):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
