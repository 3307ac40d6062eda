"""How an option is checked: one checker per kind of option, one error for one mistake.

Every public call checks its options with these, so that a mistake reads alike in every
call that can be given it. There are four kinds:

- A flag (:func:`flag`): True or False, numpy's too (``np.bool_``, what a comparison of
  arrays gives), returned as Python's. Nothing else is one: not 0 or 1, not a float, a
  string or None. Python takes each of them for true or false, but ``copy=0`` is as
  likely a count put in the wrong place, and ``pin_memory="False"`` is true.
- ``"auto"`` or a flag (:func:`auto_or_flag`): the string ``"auto"``, or a flag.
- A whole number (:func:`whole_number`): an int, numpy's too, of a least value or more;
  never a bool, which is a flag, nor a float, even 2.0.
- A size (:func:`~devicekit._base._units.parse_bytes`): a whole number of bytes, 0 or
  more, or a string such as ``"8GiB"``.

The class of the error says which mistake it is. A value of a kind the option never
takes is a TypeError: a float for a count, None or 1 for a flag, ``"yes"`` where
``"auto"`` or a flag is asked for. One of the right kind that the option still cannot take
is a ValueError: a count below its least, a negative size, a string that reads as no size.
The message names the option, what it takes, and the value as :func:`shown` shows it:

>>> import numpy as np
>>> flag(np.True_, "copy"), auto_or_flag("auto", "non_blocking")
(True, 'auto')
>>> whole_number(np.int64(2), 0, "prefetch")
2
>>> flag(1, "copy")
Traceback (most recent call last):
...
TypeError: Expected copy to be True or False, got 1.
>>> auto_or_flag("yes", "pin_memory")
Traceback (most recent call last):
...
TypeError: Expected pin_memory to be 'auto', True or False, got 'yes'.
>>> whole_number(2.0, 1, "start")
Traceback (most recent call last):
...
TypeError: Expected start to be a whole number of 1 or more, got 2.0.
>>> whole_number(-1, 0, "prefetch")
Traceback (most recent call last):
...
ValueError: Expected prefetch to be a whole number of 0 or more, got -1.
>>> from devicekit._base._units import parse_bytes
>>> parse_bytes("2KiB", "memory"), parse_bytes(np.int64(512), "memory")
(2048, 512)
>>> parse_bytes(1.5, "memory")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
TypeError: Expected memory as a number of bytes or a size such as '8GiB', ... got 1.5.
>>> parse_bytes("lots", "memory")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: Expected memory as a number of bytes or a size such as '8GiB', ... got 'lots'.
"""

from __future__ import annotations

import numbers
import sys
from typing import Literal

from devicekit._base._text import shown

__all__ = ["auto_or_flag", "flag", "whole_number"]


def _is_flag(value: object) -> bool:
    """Whether ``value`` is True or False, Python's or numpy's (never imported to look)."""
    if isinstance(value, bool):
        return True
    numpy = sys.modules.get("numpy")  # a numpy bool exists only once numpy is imported
    return numpy is not None and isinstance(value, numpy.bool_)


def flag(value: object, name: str) -> bool:
    """``value`` as Python's True or False: a flag, numpy's too.

    >>> flag(False, "strict")
    False

    Raises:
        TypeError: ``value`` is no flag (0 or 1, a float, a string, None, ...).
    """
    if value is True or value is False:  # first: to_device checks on every call, 0.1 us
        return value
    if not _is_flag(value):
        msg = f"Expected {name} to be True or False, got {shown(value)}."
        raise TypeError(msg)
    return bool(value)


def auto_or_flag(value: object, name: str) -> Literal["auto"] | bool:
    """``value`` as ``"auto"``, or as Python's True or False.

    >>> auto_or_flag("auto", "pin_memory"), auto_or_flag(True, "pin_memory")
    ('auto', True)

    Raises:
        TypeError: ``value`` is neither ``"auto"`` nor a flag (another string, 0 or 1, ...).
    """
    if value is True or value is False:  # first, as in flag()
        return value
    if isinstance(value, str) and value == "auto":
        return "auto"
    if not _is_flag(value):
        msg = f"Expected {name} to be 'auto', True or False, got {shown(value)}."
        raise TypeError(msg)
    return bool(value)


def whole_number(value: object, least: int, name: str) -> int:
    """``value`` as an int: a whole number (numpy's too, never a bool) of ``least`` or more.

    >>> whole_number(4, 1, "prefetch")
    4
    >>> whole_number(2.5, 1, "prefetch")
    Traceback (most recent call last):
    ...
    TypeError: Expected prefetch to be a whole number of 1 or more, got 2.5.

    Raises:
        TypeError: ``value`` is no whole number (a bool, a float, a str, ...).
        ValueError: ``value`` is one below ``least``.
    """
    said = f"Expected {name} to be a whole number of {least} or more, got"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        msg = f"{said} {shown(value)}."
        raise TypeError(msg)
    if value < least:  # numpy's shown as the number it is: 0, not np.int64(0)
        msg = f"{said} {int(value)}."
        raise ValueError(msg)
    return int(value)
