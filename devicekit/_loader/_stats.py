"""Is the loop waiting for data? An epoch's figures, and what they conclude.

The training thread's time in an epoch splits in two, batch by batch: the *wait*, from
asking the loader for a batch to getting it, and the *step*, from getting it to asking
for the next (the loop's own work)::

    asked ──wait──> got ──step──> asked ──wait──> got ──step──> ...

A :class:`LoaderStats` holds an epoch's figures (measured as it runs by
:class:`~devicekit._loader._recorder.EpochRecorder`). Its ``verdict`` (:func:`verdict`) reads
them with what the loader knows of its source (:class:`Setup`, and how its samples are
counted, :class:`Counting`) and says which side the loop is bound by, and what to
change, only where the figures say so. Counting samples is here in whole: what
``samples=`` asks for (:func:`counting`) and what a batch holds (:func:`samples_in`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Final, NamedTuple, SupportsIndex, TypeAlias

import torch

from devicekit._base import TransferError, count, link_peak, milliseconds, nbytes, whole_number
from devicekit._core import ITEM, LIST, READ, TUPLE, Node, decide, flatten

COMPUTE_BOUND: Final = 0.10
"""Below this share of the epoch spent waiting, the loop is compute-bound: input as fast
as can be would gain it less than a tenth."""
INPUT_BOUND: Final = 0.5
"""From this share of the epoch spent waiting, the loop is input-bound: its data, not its
steps, sets its pace. Between the two, faster input would save up to that share."""
_FIRST_BATCH: Final = 0.5  # a wait that is mostly the first batch is about starting up
HANDOVER_S: Final = 450e-6
"""What the training process pays to get a batch from a DataLoader worker, at the least:
a waiting loop that reads its batches more cheaply than this gains nothing from workers.
Measured with ``python benchmarks/bench_loader.py --handover`` (the training thread's
CPU time a batch, from a DataLoader of one small tensor a batch and 1 or 2 persistent
workers; torch 2.13, a 2-core x86-64 Linux machine, four runs): 0.44-0.57 ms, where
the same batches read in the process took 0.06-0.11 ms. Each further tensor in a batch
adds 0.2-0.5 ms (a tensor's shared memory travels as a file descriptor), so this is the
cheapest hand-over: the side to err on, where workers might still help."""

SampleCount: TypeAlias = int | SupportsIndex | str | Callable[[Any], int] | None
"""What ``DeviceDataLoader(samples=)`` takes: a count per batch (numpy's integers too),
``"dim=N"``, a function."""
DEFAULT_RULE: Final = "dimension 0 of the batch's tensors (the default rule)"
"""``LoaderStats.samples_rule`` where the batches' tensors were counted by the default rule."""
_DIMENSION = re.compile(r"dim\s*=\s*(-?\d+)")
WHOLE: Final = object()  # where samples are read: the batch itself
NOWHERE: Final = object()  # no entry of the batch reads them: each batch looked at whole


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """One epoch of a :class:`~devicekit.DeviceDataLoader`, measured: is the loop waiting?

    The loader makes it (``loader.stats``); you read its fields, never construct it.

    ``wait_s`` is the time the training thread spent asking for batches, ``step_s``
    the time it spent between them (the loop's own work), both summed over the batches
    whose time is known; ``elapsed_s`` is the two together. The per-batch tuples hold
    the same figures batch by batch, for plotting.

    >>> import devicekit as dk
    >>> loader = dk.DeviceDataLoader([[1.0], [2.0]], "cpu")
    >>> loader.stats.batches, loader.stats.verdict
    (0, 'No batch has been handed over yet: nothing to judge.')
    >>> for batch in loader:
    ...     pass
    >>> loader.stats.batches, loader.stats.finished
    (2, True)
    """

    batches: int = 0
    """Batches handed over to the loop."""
    samples: int | None = 0
    """Their samples, counted as the loader's ``samples=`` says; ``samples_rule`` says how.

    The default rule (``samples=None``): a DataLoader's ``batch_size`` where its sampler
    has a length (the last batch as short as it is). Else each batch's tensors, as
    :func:`~devicekit.to_device` sees them, tell: the largest first dimension that two
    of them share, one-element tensors (a step count, a temperature) left out; where no
    two share one, the largest first dimension of any; and where it is larger, the
    length of a list or tuple of two or more tensors of one rank (per-sample images).
    ``samples="dim=1"`` applies the same rule to dimension 1 of the tensors that have
    one, lists aside (a sequence-first batch), and ``"dim=-1"`` to each tensor's last
    dimension, as PyTorch counts from the end. An int is the count of every batch; a
    function of the batch returns its count. None where a batch holds no tensor to
    tell, or is one that to_device would refuse to walk (nested deeper than it allows,
    or holding a cycle)."""
    samples_rule: str = DEFAULT_RULE
    """How ``samples`` was counted, in words, such as ``"the DataLoader's batch_size (32)"``
    or ``"dimension 1 of the batch's tensors (samples='dim=1')"``."""
    wait_s: float = 0.0
    step_s: float = 0.0
    elapsed_s: float = 0.0
    wait_fraction: float = 0.0
    """The share of the epoch the loop waited for data, ``wait_s / elapsed_s``."""
    copy_s: float | None = None
    """Time the device spent copying batches in (events on the side stream); None where
    batches are not copied ahead on an accelerator, or no copy's time is known yet."""
    wait_per_batch: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    """The latest 10,000 batches' waits (the sums cover every batch)."""
    step_per_batch: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    """One step per batch whose next batch was asked for, so an epoch left early lacks
    its last step; the latest 10,000."""
    copy_per_batch: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)
    """The copies whose time is known, in order, the latest 10,000; None as ``copy_s``."""
    copy_bytes: int = 0
    """The host bytes of the batches read ahead whose copy time is known (the first batch
    or two, read in the training thread, are not counted)."""
    copy_gbps: float | None = None
    """The bandwidth the copies reached, in GB/s (10**9 bytes a second), as ``copy_bytes``
    over those batches' copy time. None where no such copy is known."""
    pinned_bytes: int = 0
    """The most page-locked memory the loader's staging pool has held at once, in bytes;
    0 where devicekit does not pin (the CPU, ``pin_memory=False``, a pinning DataLoader)."""
    pinned_limit: int | None = None
    """The most bytes the pool may hold, as ``pin_memory_limit=`` says (else ``prefetch +
    1`` times the largest batch it staged); None where devicekit does not pin."""
    pinned_batches: int = 0
    """This epoch's batches staged in the pool's page-locked memory."""
    pinned_reused: int = 0
    """Of those, the batches staged in memory the pool had page-locked for an earlier one."""
    unpinned: int = 0
    """This epoch's batches copied from pageable memory, which blocks the training thread:
    larger than the pool's cap, or met after page-locking failed (``unpinned_why``)."""
    unpinned_why: str | None = None
    """Why batches were not pinned, where their size was not the reason (page-locking
    failed, and the loader warned once; or another live epoch's batches held the
    memory); else None."""
    finished: bool = False
    """Whether the epoch ran to its end; False while it runs, or when it was left early."""
    read_ahead: bool = False
    """Whether a feed thread read the epoch's batches ahead of the loop, from its second
    or third batch on (the first ones are read in the training thread, to see whether
    reading draws random numbers). False where batches move in line (the CPU,
    ``prefetch=0``), and where reading draws (``reads_draw``)."""
    reads_draw: bool | None = None
    """Whether reading each of the epoch's first two batches drew from the global random
    generators (torch's, Python's, numpy's), as augmentation in a dataset read without
    workers does. Then every batch is read in the training thread when the loop asks for
    it, as a plain loop reads it, so that a seeded run repeats, and none is read ahead.
    False where one of the two drew nothing; None where the loader does not look (batches
    move in line) or has not yet."""
    verdict: str = "No batch has been handed over yet: nothing to judge."
    """Whether the loop is input- or compute-bound, and what to change, in a sentence or two."""


class Counting(NamedTuple):
    """How an epoch's samples are counted (see ``LoaderStats.samples``)."""

    per_batch: int | None = None  # every batch holds this many: samples=N, a batch_size
    epoch: int | None = None  # at most this many an epoch: a DataLoader's, its last batch kept
    dim: int = 0  # else the dimension the default rule reads
    function: Callable[[Any], Any] | None = None  # else samples=function, called per batch
    rule: str = DEFAULT_RULE  # LoaderStats.samples_rule


def counting(samples: SampleCount) -> Counting | None:
    """The :class:`Counting` that ``DeviceDataLoader(samples=samples)`` asks for; None: the default.

    >>> counting(20).per_batch, counting("dim=1").dim, counting("dim=-1").dim
    (20, 1, -1)
    >>> counting("dim=1").rule
    "dimension 1 of the batch's tensors (samples='dim=1')"

    Raises:
        TypeError: ``samples`` is none of an integer, a string or a function.
        ValueError: An integer below 1, or a string other than ``"dim=N"``.
    """
    if samples is None:
        return None
    if isinstance(samples, str):
        match = _DIMENSION.fullmatch(samples.strip())
        if match is None:
            msg = (
                "Expected samples as a string to name the dimension of the batch's tensors "
                "that indexes their samples, 'dim=N' with N a whole number, such as 'dim=1' "
                f"or 'dim=-1' (the last dimension), got {samples!r}."
            )
            raise ValueError(msg)
        dim = int(match.group(1))
        return Counting(
            dim=dim, rule=f"dimension {dim} of the batch's tensors (samples={samples!r})"
        )
    if callable(samples):
        name = getattr(samples, "__qualname__", None) or repr(samples)
        return Counting(function=samples, rule=f"{name}(batch) (samples={name})")
    try:
        number = whole_number(samples, 1, "samples")
    except TypeError:  # for untyped callers
        msg = (
            "Expected samples to be a number of samples per batch (an int), a dimension "
            "such as 'dim=1', or a function of the batch returning its count, got "
            f"{type(samples).__name__} {samples!r}."
        )
        raise TypeError(msg) from None
    return Counting(per_batch=number, rule=f"{count(number, 'sample')} a batch (samples={number})")


def returned_count(number: object, function: object, batch: int) -> int:
    """``number`` as ``samples=function`` returned it for a batch, where it is a count.

    Raises:
        TypeError: It is no whole number (a bool, a float, a tensor, ...).
        ValueError: It is negative.
    """
    name = getattr(function, "__qualname__", None) or repr(function)
    what = (
        f"what samples={name} returned for batch {batch} of this epoch (numbered from 0, "
        "as enumerate() numbers them)"
    )
    try:
        return whole_number(number, 0, what)
    except TypeError as err:
        if not isinstance(number, torch.Tensor):
            raise
        msg = f"{str(err)[:-1]} (.item() makes a Python int of a one-element tensor)."
        raise TypeError(msg) from None


def _per_sample(value: Any) -> bool:
    """Whether ``value`` is a list or tuple of per-sample tensors (images of any size)."""
    return (
        type(value) in (list, tuple)
        and len(value) >= 2
        and all(type(item) is torch.Tensor for item in value)
        and len({item.dim() for item in value}) == 1
    )


def samples_in(batch: Any, dim: int = 0) -> tuple[int | None, Any, bool]:
    """A batch's samples by the default rule, and where batches of its structure hold them.

    The rule is :attr:`LoaderStats.samples <devicekit.LoaderStats.samples>`'s, read along
    dimension ``dim`` (from the last where negative, as PyTorch indexes) of the tensors
    that have it, as the type table sees them (the READ view, which
    also looks inside objects that move themselves); a one-element tensor is left out of
    the sharing, so that two of them never outvote the batch's tensors.
    Where: the batch's entry (a key or an index, :data:`WHOLE` for the batch itself) and
    whether its length counts, else its dimension ``dim``; :data:`NOWHERE` where the
    count comes from deeper, and each batch is then looked at whole.

    The batch is walked once, by :func:`~devicekit._core._tree.flatten`: iteratively, and
    refused where :func:`~devicekit.to_device` refuses it (deeper than
    :data:`~devicekit._core._tree.MAX_DEPTH`, or a cycle), which counts as telling no samples.

    >>> import torch
    >>> number, key, length = samples_in({"image": torch.zeros(8, 3), "label": torch.zeros(8)})
    >>> number, key, length
    (8, 'image', False)
    >>> samples_in((torch.zeros(64, 3), torch.zeros(1), torch.zeros(1)))[0]
    64
    >>> samples_in((torch.zeros(35, 20), torch.zeros(700)), dim=1)[0]
    20
    >>> samples_in((torch.zeros(35, 20), torch.zeros(7, 20)), dim=-1)[0]
    20
    """
    if type(batch) is torch.Tensor:
        size = _size_along(batch, dim)
        # A nested tensor is looked at whole each batch: its shape cannot be read.
        return (None, NOWHERE, False) if size is None else (size, _where(batch, WHOLE), False)
    node = decide(type(batch)).read
    if not isinstance(node, Node):
        return None, NOWHERE, False
    try:
        leaves = flatten(batch, view=READ).leaves
    except TransferError:
        return None, NOWHERE, False
    sequence = node is LIST or node is TUPLE
    # The children with the key or index each is read by again (NOWHERE: none): only an
    # item is, not a dataclass's fields, a namedtuple's attributes or an object's contents.
    entries = [
        (key.name if key.form == ITEM else NOWHERE, child)
        for key, child in zip(node.keys(batch), node.children(batch), strict=True)
    ]
    # (a per-sample list's length, its entry)
    lengths = [(len(child), key) for key, child in entries if dim == 0 and _per_sample(child)]
    if sequence and dim == 0 and _per_sample(batch):
        lengths.insert(0, (len(batch), WHOLE))
    # The entries that are tensors themselves, by identity: the first entry that holds one.
    direct = {
        id(child): _where(child, key)
        for key, child in reversed(entries)
        if isinstance(child, torch.Tensor)
    }
    # (a size along dim, the entry it is read from, whether it may share)
    sizes = [
        (size, direct.get(id(leaf), NOWHERE), leaf.numel() != 1)
        for leaf in leaves
        if isinstance(leaf, torch.Tensor) and (size := _size_along(leaf, dim)) is not None
    ]
    voters = [size for size, _, votes in sizes if votes]
    shared = [size for size in set(voters) if voters.count(size) >= 2]
    found = max(shared or [size for size, _, _ in sizes], default=None)
    longest = max((length for length, _ in lengths), default=None)
    if longest is not None and (found is None or longest > found):
        return longest, next(key for length, key in lengths if length == longest), True
    if found is None:
        return None, NOWHERE, False
    key = next((key for size, key, _ in sizes if size == found and key is not NOWHERE), NOWHERE)
    return found, key, False


def _size_along(tensor: torch.Tensor, dim: int) -> int | None:
    """``tensor``'s size along ``dim`` (from the last where negative); None where it has none.

    A nested tensor's samples are its components, along dimension 0; its other
    dimensions are ragged, and count none.
    """
    if tensor.is_nested:
        return tensor.size(0) if dim == 0 else None
    # A tensor has dimension dim where its rank is above this: dim=-1 needs one dimension.
    below = dim if dim >= 0 else -dim - 1
    return tensor.shape[dim] if tensor.dim() > below else None


def _where(tensor: torch.Tensor, key: Any) -> Any:
    """``key``, where later batches may be counted by reading ``tensor``'s place again.

    Not for a nested tensor, whose shape cannot be read: each batch is looked at whole.
    """
    return NOWHERE if tensor.is_nested else key


def dataloader_counting(loader: object) -> Counting:
    """The default rule's :class:`Counting` for ``loader``: by its batch_size where it can."""
    if not isinstance(loader, torch.utils.data.DataLoader) or loader.batch_size is None:
        return Counting()  # batch_size=None: the loader's batches are made by the dataset
    try:
        length = len(loader.sampler)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset's: no length, so the last batch is unknown
        return Counting()
    return Counting(
        per_batch=loader.batch_size,
        epoch=None if loader.drop_last else length,
        rule=f"the DataLoader's batch_size ({loader.batch_size})",
    )


class Setup(NamedTuple):
    """What the loader knows of how its batches are made, for :func:`verdict` and counting."""

    source: str  # "DataLoader", or the type of what else is wrapped
    num_workers: int | None  # None: not a DataLoader
    persistent_workers: bool
    pinned: bool  # by the DataLoader or by devicekit
    accelerator: bool  # batches copied ahead on a side stream
    cpus: int
    counting: Counting = Counting()
    device: torch.device | None = None  # where batches go: its link rates the copy


def verdict(stats: LoaderStats, setup: Setup, *, first_wait: float | None = None) -> str:
    """Which side the loop is bound by, from ``stats``, and what ``setup`` suggests changing.

    >>> stats = LoaderStats(batches=10, wait_s=0.8, step_s=1.2, elapsed_s=2.0,
    ...                     wait_fraction=0.4, wait_per_batch=(0.08,) * 10, finished=True)
    >>> print(verdict(stats, Setup("DataLoader", 2, False, True, True, cpus=16)))
    ... # doctest: +NORMALIZE_WHITESPACE
    The loop waited for data 40% of this epoch (800.0 ms of 2.0 s): faster input could
    save up to 40% of it. The DataLoader has 2 workers on a 16-core machine; try
    num_workers=8.
    """
    if stats.batches == 0:
        return LoaderStats.verdict
    so_far = "" if stats.finished else " so far"
    # Judged on the share as it is written: 9.6% reads "10%", and is no longer compute-bound.
    share = round(stats.wait_fraction, 2)
    head = (
        f"The loop waited for data {share:.0%} of this epoch{so_far} "
        f"({milliseconds(stats.wait_s)} of {milliseconds(stats.elapsed_s)})"
    )
    if share < COMPUTE_BOUND:
        return f"{head}: it is compute-bound, so faster input would not make it faster."
    if share >= INPUT_BOUND:
        return f"{head}: it is input-bound. {_advice(stats, setup, first_wait)}"
    advice = _advice(stats, setup, first_wait)
    return f"{head}: faster input could save up to {share:.0%} of it. {advice}"


def _advice(stats: LoaderStats, setup: Setup, first_wait: float | None = None) -> str:
    """What to change for an input-bound epoch, from the first cause the figures show.

    ``first_wait`` is the first batch's, where the per-batch figures no longer hold it.
    """
    waits, workers = stats.wait_per_batch, setup.num_workers
    first = first_wait if first_wait is not None else waits[0] if waits else 0.0
    if stats.batches >= 3 and first >= _FIRST_BATCH * stats.wait_s:
        if workers and not setup.persistent_workers:
            return (
                f"Most of it was the first batch, while the DataLoader's "
                f"{count(workers, 'worker')} started: persistent_workers=True keeps "
                f"{'it' if workers == 1 else 'them'} from one epoch to the next."
            )
        return "Most of it was the first batch; the later ones kept up with the loop."
    copies, steps = stats.copy_per_batch, stats.step_per_batch
    if copies and steps and sum(copies) / len(copies) >= sum(steps) / len(steps):
        copy, step = milliseconds(sum(copies) / len(copies)), milliseconds(sum(steps) / len(steps))
        ran = _bandwidth(stats, setup)
        if not setup.pinned:
            return (
                f"Copying a batch to the device takes {copy}, longer than a step ({step}), "
                f"from memory that is not pinned: pin_memory=True makes the copy faster.{ran}"
            )
        if stats.unpinned:
            why = stats.unpinned_why or (
                f"they were larger than the {nbytes(stats.pinned_limit or 0)} the loader may "
                "pin: raise pin_memory_limit="
            )
            return (
                f"Copying a batch to the device takes {copy}, longer than a step ({step}), "
                f"and {stats.unpinned} of this epoch's batches were not pinned: {why}.{ran}"
            )
        return (
            f"Copying a batch to the device takes {copy}, longer than a step ({step}): send "
            f"fewer bytes, for example uint8 images normalised on the device with transform=.{ran}"
        )
    # The wait a batch after the first (which starts workers up): the most that reading a
    # batch costs the loop, and all that worker processes could take off it.
    read = (stats.wait_s - first) / (stats.batches - 1) if stats.batches > 1 else stats.wait_s
    cheap = read <= HANDOVER_S
    if stats.reads_draw:
        return _reads_draw(setup, workers_help=not cheap)
    if cheap and workers:
        return (
            f"The loop waited {_short(read)} a batch, no more than a DataLoader worker takes "
            f"to hand one over (about {_short(HANDOVER_S)}), so more workers would not "
            "shorten it: read fewer, larger batches."
        )
    if cheap:
        return (
            f"The loop waited {_short(read)} a batch, less than a DataLoader worker takes to "
            f"hand one over (about {_short(HANDOVER_S)}), so worker processes would cost "
            "more than they save: make reading a batch cheaper, or read fewer, larger batches."
        )
    if workers is None:
        return (
            f"devicekit cannot see how the wrapped {setup.source} makes its batches: make "
            "that cheaper, or load them with a DataLoader and worker processes (num_workers=)."
        )
    cpus = setup.cpus
    suggested = _workers_for(cpus, workers)
    if workers == 0 and cpus > 1:
        return (
            f"The DataLoader loads every batch in the training process (num_workers=0) on a "
            f"{cpus}-core machine; try num_workers={suggested}."
        )
    if workers < suggested:
        return (
            f"The DataLoader has {count(workers, 'worker')} on a {cpus}-core machine; try "
            f"num_workers={suggested}."
        )
    return (
        f"The DataLoader's {count(workers, 'worker')} already "
        f"{'has' if workers == 1 else 'have'} the machine's {count(cpus, 'core')}: make "
        "each sample cheaper to load (decoded once and cached, lighter transforms, or "
        "augmentation on the device with transform=)."
    )


def _bandwidth(stats: LoaderStats, setup: Setup) -> str:
    """`` The copy ran at 11 GB/s of the link's 63 GB/s (PCIe gen5 x16).``, as far as known."""
    if stats.copy_gbps is None:
        return ""
    link = None if setup.device is None else link_peak(setup.device)
    if link is None:
        return f" The copy ran at {stats.copy_gbps:.3g} GB/s."
    return (
        f" The copy ran at {stats.copy_gbps:.3g} GB/s of the link's {link.gb_per_s:.3g} GB/s "
        f"(PCIe gen{link.generation} x{link.width})."
    )


def _short(seconds: float) -> str:
    """A wait a batch: ``44 us`` under a millisecond, else as :func:`milliseconds` says."""
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else milliseconds(seconds)


def _workers_for(cpus: int, workers: int) -> int:
    """The ``num_workers`` to suggest on ``cpus`` cores to a DataLoader that has ``workers``."""
    return min(cpus, max(2 * workers, cpus // 2, 1))


def _reads_draw(setup: Setup, *, workers_help: bool) -> str:
    """Advice for an epoch read in the training thread because reading draws random numbers."""
    workers, cpus = setup.num_workers, setup.cpus
    if workers == 0 and cpus > 1 and workers_help:
        where = (
            f"in DataLoader workers (try num_workers={_workers_for(cpus, 0)}) or from a seeded "
            "torch.Generator of the dataset's own"
        )
    else:
        where = "from a seeded torch.Generator of the source's own"
    return (
        f"Reading each batch from the wrapped {setup.source} draws random numbers in the "
        "training process (augmentation, say), so every batch was read in the training "
        "thread when the loop asked for it, as a plain loop reads it, and none ahead "
        "(reading ahead would draw beside the loop's steps, and a seeded run would not "
        f"repeat). Draw them {where}, and the batches are read ahead."
    )
