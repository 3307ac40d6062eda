"""Packed transfers: many small host tensors cross to an accelerator in a few copies.

Every host->device copy costs a fixed few microseconds of host time however small it
is (7.6 us for 4 KiB on an H100 machine, its device allocation included), so a batch
of a thousand small tensors spends its time launching copies, not moving bytes.
Packing gathers small tensors into one staging buffer in pinned host memory, sends it
in a few bounded *chunks*, and hands back pieces of the device chunks.

The figures behind every choice here are the H100 costs in the project's cost model
(each primitive's host time per call; see docs/background/gpu-costs.rst):

* Which tensors: only those of at most :data:`PACK_MAX_BYTES`. Gathering costs a
  host memcpy of the bytes; beyond 64 KiB that memcpy costs more than the copy
  launch it saves, and larger tensors are bandwidth-bound anyway.
* Whether at all, per batch: :func:`pack` compares the modelled cost of packing (a
  fixed part per call, per chunk, per run of alike tensors, and per tensor) with one
  copy per tensor, and sends everything directly where packing would not pay (a few
  small tensors, or many of unlike shapes).
* How: tensors of one dtype and one trailing shape form a *run*; a run is gathered
  with one ``torch.cat``/``torch.stack`` into the staging buffer and taken apart on
  the device with one ``split``/``unbind``, so no Python call is made per tensor
  beyond those (a Python ``view`` per tensor costs 3 us on that machine, as much as
  the copy it saves).
* How much one result keeps alive: each chunk is its own device allocation of at most
  :data:`CHUNK_BYTES`, so a kept (or ``torch.save``-d) packed tensor carries at most
  that much of its batch-mates' bytes. ``tensor.clone()`` gives it storage of its own.

Pieces are made below autograd's view tracking, so each behaves as a tensor of its
own: an in-place change to one (``labels.sub_(1)``) does not bump the version of
another that autograd saved (the image a convolution saved for backward), which would
fail the backward pass, as it would with ordinary views of one buffer.

The staging buffer comes from PyTorch's caching pinned-memory allocator, which does not
hand a block out again before the asynchronous copies out of it have completed.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Iterable
from typing import Final, TypeAlias

import torch

from devicekit._base import independent_pieces, pinned_bytes, streams_to

__all__ = [
    "CHUNK_BYTES",
    "MIN_TENSORS",
    "PACK_MAX_BYTES",
    "can_pack",
    "might_pay",
    "pack",
    "packs_to",
]

PACK_MAX_BYTES: Final = 32 * 1024
"""Tensors up to this size may be packed; larger ones are copied alone."""

CHUNK_BYTES: Final = 256 * 1024
"""The most bytes one packed device allocation holds, so the most a kept result shares."""

# The cost model: host microseconds on the H100 machine. COPY_US is measured there (per
# small tensor); the others are this module's own host work, timed on the CPU by
# benchmarks/bench_host_side.py and converted to that host the way the benchmark does.
COPY_US: Final = 7.6
"""One host->device copy of a small tensor, its device allocation included."""
TENSOR_US: Final = 2.0
"""Packing one tensor: grouping it, its share of the gather and of the split."""
KIB_US: Final = 0.1
"""Gathering one KiB into the staging buffer (a host memcpy at about 10 GB/s)."""
RUN_US: Final = 10.0
"""One run: a gather call or a split call, with the views around it."""
CALL_US: Final = 30.0
"""Once per packed call: staging allocation, layout, the pieces' guard and bookkeeping."""
MIN_TENSORS: Final = int((CALL_US + COPY_US + 2 * RUN_US) // (COPY_US - TENSOR_US)) + 1
"""Below this many tensors in a batch packing cannot pay: nothing is even grouped."""

_GLANCE = 4  # how many tensors' dtypes pack reads before reading them all
_ALIGN = 16  # every run starts 16-byte aligned: the widest element, and vector loads
_PACKABLE_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
_STRIDED = torch.strided

# Pieces made under this guard are tensors of their own to autograd (no shared version
# counter, no multi-output-view restrictions); without it PyTorch offers no cheap way
# to that, and packing is off.
_independent_pieces: Callable[[], contextlib.AbstractContextManager[object]] | None = (
    independent_pieces()
)
can_pack: Final = _independent_pieces is not None
"""Whether this PyTorch offers what packing needs."""


def packs_to(device: torch.device) -> bool:
    """Whether small host tensors bound for ``device`` go packed.

    Only accelerators with pinned host memory and asynchronous copies gain: this
    build's accelerator, as torch.accelerator names it, unless it is MPS.

    >>> packs_to(torch.device("cpu")), packs_to(torch.device("meta"))
    (False, False)
    """
    return can_pack and streams_to(device)


class _Run:
    """Tensors of one dtype and trailing shape, laid out back to back.

    A kind's tensors are gathered as one run into the staging buffer, and taken apart
    on the device as one run per chunk they landed in.
    """

    __slots__ = ("chunk", "dtype", "nbytes", "offset", "sizes", "tensors", "trailing")

    def __init__(
        self, dtype: torch.dtype, trailing: tuple[int, ...] | None, chunk: int, offset: int
    ) -> None:
        self.dtype = dtype
        self.trailing = trailing  # None for 0-d tensors: stacked, then unbound
        self.chunk = chunk  # the chunk it lies in (on the device side)
        self.offset = offset  # in the staging buffer
        self.nbytes = 0
        self.tensors: list[torch.Tensor] = []
        self.sizes: list[int] = []  # each tensor's first dimension


_Shape: TypeAlias = tuple[int, ...]
_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")


_Kinds: TypeAlias = dict[
    tuple[torch.dtype, "_Shape | None"], list[tuple[_Shape, list[torch.Tensor]]]
]


def _kinds(tensors: list[torch.Tensor], dtypes: list[torch.dtype]) -> _Kinds:
    """The tensors worth packing, by dtype and trailing shape, then by whole shape.

    The trailing shape (all but the first dimension) is what a run shares: tensors with
    different first dimensions (a detection batch's boxes) gather with one ``cat`` and
    come apart with one ``split``. 0-d tensors have ``None`` there: they are stacked.
    Tensors are grouped by whole shape first, at two attribute reads each; sizes are
    then read once per group, and kinds of one tensor are left out.

    The tensors are taken to be dense host tensors outside autograd (see
    :func:`_staged`); reading the shape of a nested tensor, or the size of a sparse one,
    raises RuntimeError.
    """
    groups = _alike(tensors, dtypes)
    kinds: _Kinds = {}
    for (dtype, shape), members in groups.items():
        if dtype in _PACKABLE_DTYPES and 0 < members[0].nbytes <= PACK_MAX_BYTES:
            kinds.setdefault((dtype, shape[1:] if shape else None), []).append((shape, members))
    return {
        kind: alike
        for kind, alike in kinds.items()
        if len(alike) > 1 or len(alike[0][1]) > 1  # alone, a tensor is cheaper to copy directly
    }


def _alike(
    tensors: list[torch.Tensor], dtypes: list[torch.dtype]
) -> dict[tuple[torch.dtype, _Shape], list[torch.Tensor]]:
    """The tensors grouped by dtype and shape, in order of first appearance."""
    if not tensors:
        return {}
    shapes = list(map(_shape_of, tensors))
    # One shape and dtype throughout (a list of equal tensors) is common, and C-level
    # counts tell it at a fraction of the cost of grouping.
    if dtypes.count(dtypes[0]) == len(dtypes) and shapes.count(shapes[0]) == len(shapes):
        return {(dtypes[0], shapes[0]): tensors}
    groups: dict[tuple[torch.dtype, _Shape], list[torch.Tensor]] = {}
    for key, tensor in zip(zip(dtypes, shapes, strict=True), tensors, strict=True):
        members = groups.get(key)
        if members is None:
            groups[key] = [tensor]
        else:
            members.append(tensor)
    return groups


def _plain(tensor: torch.Tensor) -> bool:
    """Whether a tensor can be packed: dense, on the host, outside autograd.

    A packed copy would cut an autograd graph.
    """
    return (
        tensor.is_cpu
        and not tensor.requires_grad
        and tensor.layout is _STRIDED
        and not tensor.is_nested
    )


def _layout(kinds: _Kinds) -> tuple[list[_Run], list[_Run], list[int]]:
    """Where each packed tensor goes: its kind's run in staging, its chunk's run on device.

    Each kind starts aligned and lies contiguous in the staging buffer, so one call
    gathers it; chunks of at most CHUNK_BYTES are cut at tensor boundaries (each chunk
    is its own device allocation, so a cut needs no alignment).

    Returns:
        The gather runs, the device runs, and the chunk boundaries (offsets into the
        staging buffer, the last being its size).
    """
    gathers: list[_Run] = []
    pieces: list[_Run] = []
    bounds = [0]
    end = 0  # where the next tensor goes
    for (dtype, trailing), groups in kinds.items():
        end = _aligned(end)
        gather = _Run(dtype, trailing, len(bounds) - 1, end)
        gathers.append(gather)
        run = None
        for shape, members in groups:
            nbytes = members[0].nbytes  # one shape, one dtype: one size
            first = shape[0] if trailing is not None else 1
            placed = 0
            while placed < len(members):
                fits = (CHUNK_BYTES - (end - bounds[-1])) // nbytes
                if fits == 0:  # the chunk is full: the rest open the next, in a new run
                    bounds.append(end)
                    run = None
                    continue
                if run is None:
                    run = _Run(dtype, trailing, len(bounds) - 1, end)
                    pieces.append(run)
                taken = members[placed : placed + fits]
                run.tensors += taken
                run.sizes += [first] * len(taken)
                run.nbytes += nbytes * len(taken)
                end += nbytes * len(taken)
                placed += len(taken)
        gather.tensors = [tensor for _, members in groups for tensor in members]
        gather.nbytes = end - gather.offset
    bounds.append(end)
    return gathers, pieces, bounds


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _pays(tensors: int, nbytes: int, runs: int, chunks: int) -> bool:
    """Whether the modelled host time of a packed copy beats one copy per tensor."""
    packed = (
        CALL_US + chunks * COPY_US + runs * RUN_US + tensors * (TENSOR_US + nbytes / 1024 * KIB_US)
    )
    return packed < tensors * COPY_US


def _may_pay(kinds: _Kinds) -> bool:
    """The model with the fewest runs and chunks the kinds can have: a cheap first no."""
    tensors = sum(len(members) for alike in kinds.values() for _, members in alike)
    nbytes = sum(
        members[0].nbytes * len(members) for alike in kinds.values() for _, members in alike
    )
    return _pays(tensors, nbytes // max(tensors, 1), 2 * len(kinds), -(-nbytes // CHUNK_BYTES))


def _staged(
    tensors: list[torch.Tensor], dtypes: list[torch.dtype], *, pin: bool
) -> tuple[torch.Tensor, list[_Run], list[int]] | None:
    """The tensors worth packing gathered into one staging buffer, or None if none pay.

    Returns:
        The staging buffer, the runs the device chunks are taken apart in, and the
        chunk boundaries.

    Raises:
        RuntimeError: Among the tensors is one that is not :func:`_plain`, and it
            would have been packed: PyTorch refuses to read its shape (a nested
            tensor) or size (a sparse one), or to gather it into the host buffer (one
            on another device, or one that requires grad while autograd records).
            Checking every tensor first would cost as much as grouping it; this is
            the rare case, and nothing has been copied to the device yet.
    """
    kinds = _kinds(tensors, dtypes)
    if not kinds or not _may_pay(kinds):
        return None
    gathers, pieces, bounds = _layout(kinds)
    count = sum(len(run.tensors) for run in gathers)
    nbytes = sum(run.nbytes for run in gathers)
    if not _pays(count, nbytes // count, len(gathers) + len(pieces), len(bounds) - 1):
        return None
    staging = pinned_bytes(bounds[-1]) if pin else torch.empty(bounds[-1], dtype=torch.uint8)
    for run in gathers:
        region = staging[run.offset : run.offset + run.nbytes].view(run.dtype)
        if run.trailing is None:
            torch.stack(run.tensors, out=region)
        else:
            torch.cat(run.tensors, out=region.view(-1, *run.trailing))
    return staging, pieces, bounds


def might_pay(tensors: list[torch.Tensor]) -> bool:
    """A cheap first no: whether packing could pay for these tensors, at a glance.

    Too few tensors never pay. Each dtype is a kind of its own at least, and each kind
    costs two runs: a batch of a dozen tensors of a few dtypes (ids, masks, features:
    too many runs for so few tensors) is told from its first tensors, without reading
    every dtype.

    >>> might_pay([torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)] * 6)
    False
    >>> might_pay([torch.zeros(2)] * 12)
    True
    """
    if len(tensors) < MIN_TENSORS:
        return False
    return _pays(len(tensors), 0, 2 * len(set(map(_dtype_of, tensors[:_GLANCE]))), 1)


def pack(
    tensors: Iterable[torch.Tensor],
    device: torch.device,
    *,
    non_blocking: bool,
    dtype: torch.dtype | None = None,
    pin: bool,
) -> dict[int, torch.Tensor]:
    """Copy the small host tensors among ``tensors`` to ``device`` in packed chunks.

    >>> labels = [torch.tensor([i, i + 1]) for i in range(16)]
    >>> moved = pack(labels, torch.device("cpu"), non_blocking=False, pin=False)
    >>> moved[id(labels[3])], moved[id(labels[3])].untyped_storage() is labels[3].untyped_storage()
    (tensor([3, 4]), False)
    >>> pack(labels[:3], torch.device("cpu"), non_blocking=False, pin=False)  # does not pay
    {}

    Args:
        tensors: Tensors of exactly :class:`torch.Tensor`; those not on the host,
            sparse or nested, too large, of exotic dtypes, or requiring grad while
            autograd records are left out, as are all of them where packing would
            not pay.
        device: Where the copies go.
        non_blocking: Whether the chunks' host->device copies are asynchronous.
        dtype: A floating-point dtype that floating-point copies are cast to, on the
            device, once per run.
        pin: Stage in pinned memory (needs an accelerator); False serves tests and the
            host-side benchmark on machines without one.

    Returns:
        ``id(source) -> copy`` for every tensor that went packed; the caller copies the
        rest directly.
    """
    if _independent_pieces is None:  # mypy; to_device asks can_pack first
        return {}
    tensors = list(tensors)
    if not might_pay(tensors):
        return {}
    dtypes = list(map(_dtype_of, tensors))
    # Each dtype is a kind of its own at least, and each kind costs two runs.
    if not _pays(len(tensors), 0, 2 * len(set(dtypes)), 1):
        return {}
    try:
        staged = _staged(tensors, dtypes, pin=pin)
    except RuntimeError:
        plain = list(filter(_plain, tensors))
        if len(plain) == len(tensors):
            raise  # not a tensor packing must leave out: a real failure
        staged = _staged(plain, list(map(_dtype_of, plain)), pin=pin)
    if staged is None:
        return {}
    staging, pieces, bounds = staged
    on_device = [
        # copy=True: each chunk its own allocation on a host target too (tests).
        staging[start:end].to(device, non_blocking=non_blocking, copy=True)
        for start, end in itertools.pairwise(bounds)
    ]
    moved: dict[int, torch.Tensor] = {}
    with _independent_pieces():
        for run in pieces:
            start = run.offset - bounds[run.chunk]
            region = on_device[run.chunk][start : start + run.nbytes].view(run.dtype)
            if dtype is not None and run.dtype.is_floating_point and run.dtype != dtype:
                region = region.to(dtype)
            if run.trailing is None:
                parts = region.unbind(0)
            else:
                parts = region.view(-1, *run.trailing).split_with_sizes(run.sizes)
            moved.update(zip(map(id, run.tensors), parts, strict=True))
    return moved
