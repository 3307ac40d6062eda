"""Whose line is it: a frame of the user's code, or of PyTorch, devicekit or the standard library.

A message that points at "your line" (each of track_transfers' events, guard's account
of a failed forward) skips the frames of the libraries beneath it. The rule, in one
place for both: the nearest folder around a file decides, and installed packages are
the user's, even where a system Python keeps them inside the standard library's folder.
"""

from __future__ import annotations

import contextlib
import os
import site
import sysconfig

import torch

__all__ = ["is_library"]


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
# them beneath the standard library's folder (/usr/lib/python3.11/site-packages).
_PACKAGE_FOLDERS = tuple(
    _folder(path)
    for path in {
        sysconfig.get_path("purelib"),
        sysconfig.get_path("platlib"),
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
    one of them, whether it is known (``packages``: sysconfig's and site's) or named
    ``site-packages`` or ``dist-packages``.

    >>> own = ("/usr/lib/python3.11/", "/usr/lib/python3.11/site-packages/torch/")
    >>> [is_library(f"/usr/lib/python3.11/{name}", own, packages=()) for name in (
    ...     "contextlib.py", "site-packages/transformers/trainer.py", "site-packages/torch/nn.py")]
    [True, False, True]
    """
    own = _OWN_FOLDERS if own is None else own
    packages = _PACKAGE_FOLDERS if packages is None else packages
    nearest = max((folder for folder in own if filename.startswith(folder)), key=len, default="")
    if not nearest:
        return False
    if any(
        len(folder) > len(nearest) and folder.startswith(nearest) and filename.startswith(folder)
        for folder in packages
    ):
        return False
    return _PACKAGE_NAMES.isdisjoint(filename[len(nearest) :].split(os.sep)[:-1])
