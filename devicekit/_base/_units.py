"""Sizes, durations and counts: read as people write them, shown as people read them.

One module for the manager's options, the command line, the loader's figures and the
transfer log, so that "8GiB", "10m", "1.5 GiB" and "2 epochs" read alike everywhere.
"""

from __future__ import annotations

import math
import numbers
import re

from devicekit._base._text import shown

__all__ = [
    "count",
    "duration",
    "gib",
    "milliseconds",
    "nbytes",
    "parse_bytes",
    "parse_seconds",
    "percent",
]

_MOST_BYTES = 1e24  # a yottabyte: no device comes near
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# One run of spaces only, inside: the string is stripped first, since two optional runs
# side by side make a regex backtrack quadratically on a long run of spaces.
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)


def parse_bytes(size: object, name: str) -> int:
    """Read a memory size: bytes as a whole number, or a string such as ``"8GiB"`` or ``"500 MB"``.

    The size checker of every option (:mod:`devicekit._base._options`); ``name`` is the
    option's, for the message. A whole number is an int, numpy's too, never a bool.

    >>> parse_bytes("8GiB", "memory"), parse_bytes("1.5 GB", "memory"), parse_bytes(1024, "memory")
    (8589934592, 1500000000, 1024)

    Raises:
        TypeError: The size is neither a whole number nor a string (a float, a bool, ...).
        ValueError: The size is negative, or a string in none of these forms.
    """
    said = (
        f"Expected {name} as a number of bytes or a size such as '8GiB', '500MB' or '1.5 GB', got"
    )
    if isinstance(size, bool) or not isinstance(size, numbers.Integral | str):
        msg = f"{said} {shown(size)}."
        raise TypeError(msg)
    if not isinstance(size, str):
        if size < 0:  # numpy's shown as the number it is, as whole_number shows it
            msg = f"{said} {int(size)}."
            raise ValueError(msg)
        return int(size)
    match = _SIZE.fullmatch(size.strip())
    if match is None or match.group(2).lower() not in _UNITS:
        msg = f"{said} {shown(size)}."
        raise ValueError(msg)
    nbytes = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not nbytes < _MOST_BYTES:  # inf, where the digits outrun a float, included
        msg = (
            f"Expected {name} as a size a device can have, got {shown(size)}: "
            "more than a yottabyte."
        )
        raise ValueError(msg)
    return int(nbytes)


_DURATION = re.compile(
    r"(\d+(?:\.\d+)?)\s*(s|secs?|seconds?|m|mins?|minutes?|h|hrs?|hours?)?", re.IGNORECASE
)
_SECONDS_PER = {"s": 1, "m": 60, "h": 3600}


def parse_seconds(duration: float | str) -> float:
    """Read a duration: seconds as a number, or a string such as ``"90s"``, ``"10m"``, ``"1.5h"``.

    >>> parse_seconds("10m"), parse_seconds("1.5 hours"), parse_seconds(30)
    (600.0, 5400.0, 30.0)

    Raises:
        ValueError: The duration is negative, not finite, or not in one of these forms.
    """
    if (
        isinstance(duration, int | float)
        and not isinstance(duration, bool)
        and math.isfinite(duration)
        and duration >= 0
    ):
        return float(duration)
    match = _DURATION.fullmatch(duration.strip()) if isinstance(duration, str) else None
    if match is None:
        msg = (
            "Expected wait as a number of seconds of 0 or more, or a duration such as '90s', "
            f"'10m' or '1.5h', got {shown(duration)}."
        )
        raise ValueError(msg)
    unit = (match.group(2) or "s")[0].lower()
    return float(match.group(1)) * _SECONDS_PER[unit]


def duration(seconds: float) -> str:
    """``45 s``, ``10 min``, ``1.5 h``: a wait as a person says it, seconds to two figures.

    Two: a wait of ``wait=1`` ends a few milliseconds late on a busy machine, and a
    person says it waited 1 s, not 1.01.

    >>> duration(45), duration(1.013), duration(0.25), duration(100), duration(9000)
    ('45 s', '1 s', '0.25 s', '100 s', '2.5 h')
    """
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def milliseconds(seconds: float) -> str:
    """``12.5 ms`` under a second, ``1.5 s`` from there.

    >>> milliseconds(0.0125), milliseconds(1.5)
    ('12.5 ms', '1.5 s')
    """
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def gib(size: int) -> str:
    """A device's memory, in GiB with one decimal: ``79.2 GiB``.

    >>> gib(3 * 2**29)
    '1.5 GiB'
    """
    return f"{size / 2**30:.1f} GiB"


def nbytes(size: int) -> str:
    """An amount of data in the largest unit it reaches: ``48 bytes``, ``1.5 KiB``.

    >>> nbytes(48), nbytes(1536), nbytes(3 * 2**30)
    ('48 bytes', '1.5 KiB', '3.0 GiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def percent(share: float) -> str:
    """A share as a percentage, to three significant figures: ``12.5%``.

    >>> percent(0.125), percent(0.5)
    ('12.5%', '50%')
    """
    return f"{share * 100:.3g}%"


def count(number: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``.

    >>> count(1, "epoch"), count(3, "cuda device")
    ('1 epoch', '3 cuda devices')
    """
    return f"{number} {noun}{'' if number == 1 else 's'}"
