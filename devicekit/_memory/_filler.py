"""What materialize fills new storage with, and how it is told, element by element, from a write.

A tensor given storage holds the filler until something writes it. PyTorch counts an
in-place write on the tensor's version, but a counted write is evidence of a write, not
of every element written: ``w[:4] = ...`` covers half of an eight-row weight, and
``mul_`` or ``clamp_`` compute from what the elements held. So after the initialisers
the filler is looked for in every element, and it is chosen so that no write leaves it
on purpose:

- A floating type (each part of a complex one) is filled with every bit set: a NaN
  whose bits ``float('nan')`` never has. Arithmetic on it gives a NaN again, with these
  bits or another NaN's (``neg_`` clears the sign), so every NaN except
  ``float('nan')``'s is the filler or was computed from it. A NaN
  written on purpose (``fill_(float('nan'))``, ``torch.full(..., math.nan)``, copied
  from either) has ``float('nan')``'s bits and counts as written.
- An integer type is filled with 0x5A in every byte: not a marker anyone writes on
  purpose (the largest value, -1 and 0 are), and out of range as a 32- or 64-bit index.
- Where a write can leave the filler on purpose, the filler is looked for only in a
  tensor on which no write was counted, and one write counts as the whole tensor's:
  every value of an 8- or 16-bit integer can be data (a table of every uint8 holds
  0x5A), and a float8 type whose one NaN is ``float('nan')``'s (``float8_e4m3fnuz``)
  cannot tell that NaN from the filler.
- A type with no value to spare (bool, float4, the sub-byte and bit types), or one that
  PyTorch cannot fill here, has no filler: its tensors get storage and are not checked.

One case slips through: arithmetic that rounds every NaN to ``float('nan')``'s bits, as
bfloat16's does on the CPU, leaves a tensor that is only rescaled (``mul_``) holding what
a deliberate NaN holds, and it counts as written. A write of part of it is still found:
the elements it leaves keep the filler's bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import torch

__all__ = ["Filler", "count_fillers", "fill", "filler_of"]

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
    summed: bool
    """Whether a sum finds a tensor free of it: the filler is a NaN, which makes a sum
    NaN, and torch sums the type (not float8's)."""


@functools.cache
def filler_of(dtype: torch.dtype) -> Filler | None:
    """The filler of ``dtype``; None where it has none (bool, float4, a bit or sub-byte type).

    >>> filler_of(torch.float32)  # every bit set; float('nan') is 0x7FC00000
    Filler(through=torch.int32, bits=-1, kept=2143289344, whole=False, summed=True)
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
            return Filler(dtype, bits, None, whole=part.element_size() < 4, summed=False)
        nan = torch.full((1,), math.nan, dtype=part.dtype)
        ones = torch.full((1,), -1, dtype=through).view(part.dtype)
        if not torch.isnan(nan).item():  # float4: no NaN to fill with
            return None
    except (RuntimeError, TypeError):  # fill_ or a comparison not implemented for the type
        return None
    try:
        summed = bool(torch.isnan(nan.sum()))
    except (RuntimeError, TypeError):  # sum not implemented for the type (float8)
        summed = False
    kept = int(nan.view(through).item())
    if torch.isnan(ones).item() and kept != -1:
        return Filler(through, -1, kept, whole=False, summed=summed)
    return Filler(through, kept, None, whole=True, summed=summed)  # one NaN: float('nan')'s


def count_fillers(read: Sequence[tuple[torch.Tensor, Filler]]) -> list[int]:
    """How many elements of each plain tensor (a DTensor's local shard) hold its filler.

    Nearly every tensor holds none, and a NaN anywhere in a tensor makes its sum a NaN,
    so a tensor whose filler is a NaN is summed first, one reduction, and read element by
    element only where that sum is a NaN (written on purpose, or the filler): on the
    2,000 tensors of benchmarks/bench_materialize.py's model, 5-6 ms where reading every
    element took 27-40 ms (one CPU thread). Counts come to the host in one copy a device.

    >>> weight, steps = torch.empty(8, 2), torch.empty(4, dtype=torch.int64)
    >>> for tensor in (weight, steps):
    ...     fill(tensor, filler_of(tensor.dtype))
    >>> weight[:4], steps[0] = 0.5, 0
    >>> count_fillers([(weight, filler_of(weight.dtype)), (steps, filler_of(steps.dtype))])
    [8, 3]
    """
    summed = [at for at, (_, filler) in enumerate(read) if filler.summed]
    found = _on_host([read[at][0].sum() for at in summed], torch.isnan)
    exact = [at for at, (_, filler) in enumerate(read) if not filler.summed]
    exact += [at for at, nan in zip(summed, found, strict=True) if nan]
    counts = [0] * len(read)
    for at, count in zip(exact, _on_host([_count(*read[at]) for at in exact]), strict=True):
        counts[at] = int(count)
    return counts


def fill(tensor: torch.Tensor, filler: Filler) -> None:
    """Write the filler into every element of a plain tensor (a DTensor's local shard)."""
    _bits(tensor, filler).fill_(filler.bits)


def _count(tensor: torch.Tensor, filler: Filler) -> torch.Tensor:
    """How many elements of a plain tensor hold the filler: a count on its device, not read.

    >>> weight = torch.empty(8, 2)
    >>> fill(weight, filler_of(weight.dtype))
    >>> weight[:4] = 0.5
    >>> weight[4, 0] = float("nan")  # written on purpose: float('nan')'s bits
    >>> _ = weight[5].mul_(2.0)  # computed from the filler: still a NaN of its own
    >>> int(_count(weight, filler_of(weight.dtype)))
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


def _on_host(
    values: list[torch.Tensor], then: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[Any]:
    """Values of 0-dim tensors (``then`` applied): one copy a device, not one wait a tensor."""
    by_device: dict[torch.device, list[int]] = {}
    for position, value in enumerate(values):
        by_device.setdefault(value.device, []).append(position)
    found: list[Any] = [None] * len(values)
    for positions in by_device.values():
        stacked = torch.stack([values[position] for position in positions])
        read = (stacked if then is None else then(stacked)).tolist()
        for position, value in zip(positions, read, strict=True):
            found[position] = value
    return found


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
