"""The words of devicekit's messages, each rule written once.

How a value is shown (:func:`shown`), how a list is cut short (:func:`listing`), and
what a tensor on the meta device is and what to do with one (:data:`META`,
:func:`meta_fix`). A message is built from these where it says one of these things, so
that every message says it one way. How an option is checked is
:mod:`devicekit._base._options`'s.
"""

from __future__ import annotations

import math
import reprlib
import sys
from collections.abc import Sequence
from typing import Final

__all__ = ["LISTED", "META", "listing", "meta_fix", "shown"]

LISTED: Final = 3
"""How many items :func:`listing` names before it counts the rest."""

META: Final = "tensors on the meta device have shapes but no data"
"""What a meta tensor is, for a message that found some where data is needed."""


class _Brief(reprlib.Repr):
    """``repr`` with 8 members a container and 4 levels (sets nested thousands deep)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdict = 8
        self.maxdeque = 8
        self.maxstring = self.maxlong = self.maxother = sys.maxsize  # shown cuts these

    def repr_instance(self, x: object, level: int) -> str:
        return repr(x)  # a __repr__ that raises: shown's placeholder, not reprlib's

    def repr_int(self, x: int, level: int) -> str:
        try:
            return repr(x)
        except ValueError:  # more digits than Python writes out (sys.get_int_max_str_digits)
            return f"<an int of {_digits(x):,} digits>"


def _digits(number: int) -> int:
    """How many decimal digits ``number`` has, without writing it out.

    >>> _digits(0), _digits(-99), _digits(10**4999), _digits(10**5000 - 1)
    (1, 2, 5000, 5000)
    """
    number = abs(number)
    digits = int(number.bit_length() * math.log10(2)) + 1  # right, or one off in either way
    if number >= 10**digits:
        return digits + 1
    return digits - 1 if digits > 1 and number < 10 ** (digits - 1) else digits


_BRIEF: Final = _Brief()


def shown(value: object, limit: int | None = 60) -> str:
    """``repr(value)`` for a message, cut short where it is long (a limit of None: never).

    A container shows its first 8 members and 4 levels. A ``__repr__`` that raises gives
    a placeholder, never its error in the message's place; so does an int of more digits
    than Python writes out (4,300), by its length.

    >>> shown("cuda:0"), shown("x" * 100, limit=12), shown([*range(10)])
    ("'cuda:0'", "'xxxxxxxxx... (100 characters)", '[0, 1, 2, 3, 4, 5, 6, 7, ...]')
    >>> class Key:
    ...     def __repr__(self):
    ...         raise ValueError("no repr")
    >>> shown(Key())
    '<unprintable Key: its __repr__ raised ValueError>'
    >>> shown(10**5000)
    '<an int of 5,001 digits>'
    """
    try:
        text = _BRIEF.repr(value)
    except Exception as err:  # the user's __repr__: a message must still be made
        text = f"<unprintable {type(value).__name__}: its __repr__ raised {type(err).__name__}>"
    if limit is None or len(text) <= limit:
        return text
    length = len(value) if isinstance(value, str | bytes) else len(text)
    return f"{text[: limit - 2]}... ({length:,} characters)"


def listing(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``, ``a, b, c and 4 more``: at most :data:`LISTED` named.

    >>> listing(["a"]), listing(["a", "b"]), listing(["a", "b", "c"])
    ('a', 'a and b', 'a, b and c')
    >>> listing(["a", "b", "c", "d", "e"])
    'a, b, c and 2 more'
    """
    if len(items) > LISTED:
        return f"{', '.join(items[:LISTED])} and {len(items) - LISTED} more"
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def meta_fix(device: object = "cuda") -> str:
    """What to do with a model whose tensors are on meta, as a clause that ends a message.

    >>> meta_fix("cuda:0").split(", which")[0]
    "give the model storage with devicekit.materialize(model, 'cuda:0')"
    """
    return (
        f"give the model storage with devicekit.materialize(model, {str(device)!r}), which "
        "initialises it and names whatever no initialiser writes"
    )
