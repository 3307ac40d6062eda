"""What materialize fills new storage with, and how it is told, element by element, from a write.

A tensor given storage holds the filler until something writes it. PyTorch counts an
in-place write on the tensor's version, but a counted write is evidence of a write, not
of every element written: ``w[:4] = ...`` covers half of an eight-row weight, and
``mul_`` or ``clamp_`` compute from what the elements held. So after the initialisers
the filler is looked for in every element, and it is chosen so that no write leaves it
on purpose:

- A floating type (each part of a complex one) is filled with every bit set: a NaN
  whose bits ``float('nan')`` never has. Arithmetic on it gives a NaN again, with these
  bits or another NaN's (``neg_`` clears the sign; CUDA's arithmetic gives its own), so
  every NaN except ``float('nan')``'s is the filler or was computed from it. A NaN
  written on purpose (``fill_(float('nan'))``, ``torch.full(..., math.nan)``, copied
  from either) has ``float('nan')``'s bits and counts as written.
- An integer type is filled with 0x5A in every byte: not a marker anyone writes on
  purpose (the largest value, -1 and 0 are), and, as an index, out of range.
- Where a write can leave the filler on purpose, the filler is looked for only in a
  tensor on which no write was counted, and one write counts as the whole tensor's:
  every value of an 8- or 16-bit integer can be data (a table of every uint8 holds
  0x5A), and a float8 type whose one NaN is ``float('nan')``'s (``float8_e4m3fnuz``)
  cannot tell that NaN from the filler.
- A type with no value to spare (bool, float4, the sub-byte and bit types), or one that
  PyTorch cannot fill here, has no filler: its tensors get storage and are not checked.

One case slips through: on the CPU, arithmetic in bfloat16 rounds every NaN to
``float('nan')``'s bits, so a bfloat16 tensor that is only rescaled there (``mul_``)
holds what a deliberate NaN holds, and counts as written. A write of part of it is
still found: the elements it leaves keep the filler's bits.
"""

from __future__ import annotations

import functools
import math
from typing import Final, NamedTuple

import torch

__all__ = ["Filler", "count_filler", "fill", "filler_of"]

_BY_WIDTH: Final = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The signed integer type of each width in bytes: a floating type is filled and read through it."""

_QUANTIZED: Final = frozenset(
    {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
)
"""Integers with a scale: a plain tensor of one is not made (torch warns that they go)."""

_BYTE: Final = 0x5A
"""An integer filler's every byte."""

_PIECE: Final = 1 << 24
"""The elements read at once: a scan's temporaries (a bool an element, three at a time)
stay under 48 MiB however large the tensor, where a whole 1e9-element embedding's would
take 3 GB of a device that the model itself may nearly fill."""


class Filler(NamedTuple):
    """What a new tensor of one dtype holds until written, and how a write is told from it."""

    through: torch.dtype
    """The dtype it is written and read as: an integer type's own; for a floating type
    (a complex one's parts), the signed integer type of its width."""
    bits: int
    """The filler, as a value of :attr:`through`."""
    kept: int | None
    """``float('nan')``'s bits as a value of :attr:`through`, the one NaN a write leaves on
    purpose; None where any element holding :attr:`bits` is the filler."""
    whole: bool
    """Whether one counted write counts as the whole tensor's, a write being able to
    leave :attr:`bits` on purpose (an 8- or 16-bit integer, a float8 type with one NaN)."""


@functools.cache
def filler_of(dtype: torch.dtype) -> Filler | None:
    """The filler of ``dtype``; None where it has none (bool, float4, a bit or sub-byte type).

    >>> filler_of(torch.float32)  # every bit set; float('nan') is 0x7FC00000
    Filler(through=torch.int32, bits=-1, kept=2143289344, whole=False)
    >>> filler_of(torch.int64).bits == 0x5A5A5A5A5A5A5A5A, filler_of(torch.uint8).whole
    (True, True)
    >>> filler_of(torch.float8_e4m3fnuz).whole, filler_of(torch.bool)
    (True, None)
    """
    if dtype == torch.bool or dtype in _QUANTIZED:
        return None
    part = torch.empty(0, dtype=dtype)
    if dtype.is_complex:
        part = torch.view_as_real(part)
    through = _BY_WIDTH.get(part.element_size())
    if through is None:
        return None
    try:
        if not part.dtype.is_floating_point:
            bits = int.from_bytes(bytes([_BYTE]) * part.element_size(), "little")
            torch.full((1,), bits, dtype=dtype).eq(bits)  # a type torch cannot fill: no filler
            return Filler(dtype, bits, None, whole=part.element_size() < 4)
        nan = torch.full((1,), math.nan, dtype=part.dtype)
        ones = torch.full((1,), -1, dtype=through).view(part.dtype)
        if not torch.isnan(nan).item():  # float4: no NaN to fill with
            return None
    except (RuntimeError, TypeError):  # fill_ or a comparison not implemented for the type
        return None
    kept = int(nan.view(through).item())
    if torch.isnan(ones).item() and kept != -1:
        return Filler(through, -1, kept, whole=False)
    return Filler(through, kept, None, whole=True)  # its one NaN: float('nan')'s own


def fill(tensor: torch.Tensor, filler: Filler) -> None:
    """Write the filler into every element of a plain tensor (a DTensor's local shard)."""
    _bits(tensor, filler).fill_(filler.bits)


def count_filler(tensor: torch.Tensor, filler: Filler) -> torch.Tensor:
    """How many elements of a plain tensor hold the filler: a count on its device, not read.

    >>> weight = torch.empty(8, 2)
    >>> fill(weight, filler_of(weight.dtype))
    >>> weight[:4] = 0.5
    >>> weight[4, 0] = float("nan")  # written on purpose: float('nan')'s bits
    >>> _ = weight[5].mul_(2.0)  # computed from the filler: still a NaN of its own
    >>> int(count_filler(weight, filler_of(weight.dtype)))
    7
    """
    if not tensor.is_contiguous():  # read whole (a new tensor is laid out as its meta one)
        return _left(tensor, filler).sum()
    flat = tensor.view(-1)
    counts = [
        _left(flat[start : start + _PIECE], filler).sum()
        for start in range(0, max(flat.numel(), 1), _PIECE)
    ]
    return counts[0] if len(counts) == 1 else torch.stack(counts).sum()


def _left(piece: torch.Tensor, filler: Filler) -> torch.Tensor:
    """A bool per element of ``piece``: whether it holds the filler."""
    bits = _bits(piece, filler)
    if filler.kept is None:
        left = bits == filler.bits
    else:
        parts = torch.view_as_real(piece) if piece.is_complex() else piece
        left = torch.isnan(parts) & (bits != filler.kept)
    return left.any(-1) if piece.is_complex() else left


def _bits(tensor: torch.Tensor, filler: Filler) -> torch.Tensor:
    """``tensor`` as :attr:`Filler.through`: its bits, a complex element's two parts apart."""
    parts = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    return parts.view(filler.through)
