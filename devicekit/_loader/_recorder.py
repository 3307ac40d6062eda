"""EpochRecorder: an epoch measured as it runs, in the training thread, without waiting.

Per batch it takes two clock readings (the wait and the step, see :mod:`devicekit._loader._stats`)
and counts the batch's samples; on an accelerator it also holds a timer per copy (events
on the side stream), read once the copy has finished, so that measuring never makes the
training thread wait. This is the loader's per-batch path, so it is written for speed
(a call per batch, the samples read where the first batch of a structure held them);
a :meth:`~EpochRecorder.snapshot` is a :class:`~devicekit.LoaderStats` with its verdict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final

import torch

from devicekit._base import TransferError
from devicekit._core import ITEM, LIST, READ, TUPLE, Node, decide, flatten
from devicekit._loader._stats import LoaderStats, Setup, verdict, whole_number

_Tensor = torch.Tensor  # one global lookup a batch instead of two

CopyTimer = Callable[[bool], "float | None"]
"""A copy's timer: its seconds once it finished, else None; given True, waits for it."""

PER_BATCH_KEPT: Final = 10_000
"""Batches whose times the per-batch tuples keep, the latest; the sums cover every batch."""
_WHOLE: Final = object()  # where samples are read: the batch itself
_NOWHERE: Final = object()  # no entry of the batch reads them: each batch looked at whole
_FOLD_AT: Final = 2 * PER_BATCH_KEPT


class EpochRecorder:
    """The figures of one epoch as it runs; the training thread alone writes them."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.waits: list[float] = []
        self.steps: list[float] = []
        self.samples: int | None = 0
        self.copies: list[float] | None = [] if setup.accelerator else None
        self.timers: list[CopyTimer] = []  # copies handed over, time not read yet
        self.finished = False
        # Where the loader reads this epoch's batches (see _pipeline.ahead).
        self.read_ahead = False
        self.reads_draw: bool | None = None
        # Where this epoch's batches hold their samples (see samples_in): the entry
        # ``key`` of a batch (_WHOLE: the batch itself), its length or its first dimension.
        self.key: Any = _NOWHERE
        self.holder: Any = None  # the type of the batch the key was found in
        self.length = False
        # Folded away past PER_BATCH_KEPT: the sums of waits, steps and copies, and the
        # batches whose waits they were.
        self.earlier = [0.0, 0.0, 0.0]
        self.folded = 0
        self.first_wait: float | None = None
        self.dim = setup.counting.dim
        # Called for each batch handed over: a count per batch (samples=N, a DataLoader's
        # batch_size) tells the samples from the batch count alone, and only the figures'
        # bound is kept there.
        self.count: Callable[[Any], None] = (
            self._keep_bounded
            if setup.counting.per_batch is not None
            else self._call
            if setup.counting.function is not None
            else self._count
        )

    def _keep_bounded(self, batch: Any) -> None:
        if len(self.waits) >= _FOLD_AT:
            self._fold()

    def _count(self, batch: Any) -> None:
        """Count a batch's samples where the epoch's batches were found to hold them.

        Read inline, not through a function per kind: a call would cost a tenth of
        moving a small batch to the CPU (benchmarks/bench_loader.py).
        """
        if len(self.waits) >= _FOLD_AT:
            self._fold()
        key = self.key
        if key is not _NOWHERE and type(batch) is self.holder:
            try:
                value = batch if key is _WHOLE else batch[key]
                self.samples += len(value) if self.length else value.shape[self.dim]  # type: ignore[operator]
            except (LookupError, TypeError, AttributeError):  # another structure: look anew
                pass
            else:
                return
        if self.samples is None:
            return
        number, self.key, self.length = samples_in(batch, self.dim)
        self.holder = type(batch)
        if hasattr(self.holder, "__missing__"):  # batch[key] would add the key (defaultdict)
            self.key = _NOWHERE  # so each batch is looked at anew, never indexed
        self.samples = None if number is None else self.samples + number

    def _call(self, batch: Any) -> None:
        """Count a batch's samples with the function given as ``samples=``."""
        if len(self.waits) >= _FOLD_AT:
            self._fold()
        function = self.setup.counting.function
        number = function(batch)  # type: ignore[misc]  # set where this is the counter
        if type(number) is not int or number < 0:
            number = _whole_number(number, function, self.folded + len(self.waits) - 1)
        self.samples += number  # type: ignore[operator]  # never None here

    def _fold(self) -> None:
        """Keep the latest PER_BATCH_KEPT figures; sum the older ones into ``earlier``."""
        if self.first_wait is None and self.waits:
            self.first_wait = self.waits[0]
        self.folded += max(0, len(self.waits) - PER_BATCH_KEPT)
        for slot, values in enumerate((self.waits, self.steps, self.copies)):
            if values is not None and len(values) > PER_BATCH_KEPT:
                self.earlier[slot] += sum(values[:-PER_BATCH_KEPT])
                del values[:-PER_BATCH_KEPT]

    def read_copies(self, *, wait: bool = False) -> None:
        """Take the times of the copies that have finished, in order; with ``wait``, all."""
        while self.timers and self.copies is not None:
            seconds = self.timers[0](wait)
            if seconds is None:
                return
            self.copies.append(seconds)
            del self.timers[0]

    def snapshot(self) -> LoaderStats:
        """The figures so far, with their verdict."""
        earlier_waits, earlier_steps, copied = self.earlier
        wait_s = earlier_waits + sum(self.waits)
        step_s = earlier_steps + sum(self.steps)
        elapsed = wait_s + step_s
        batches = self.folded + len(self.waits)
        samples = self.samples
        per_batch, epoch = self.setup.counting.per_batch, self.setup.counting.epoch
        if per_batch is not None:
            samples = batches * per_batch
            if epoch is not None:
                samples = min(samples, epoch)
        # No copy time known (none finished yet, or a seam that cannot time) is None, never 0.
        copies = tuple(self.copies[-PER_BATCH_KEPT:]) if self.copies else None
        stats = LoaderStats(
            batches=batches,
            samples=samples,
            samples_rule=self.setup.counting.rule,
            wait_s=wait_s,
            step_s=step_s,
            elapsed_s=elapsed,
            wait_fraction=wait_s / elapsed if elapsed > 0 else 0.0,
            copy_s=None if copies is None and not copied else copied + sum(self.copies or ()),
            wait_per_batch=tuple(self.waits[-PER_BATCH_KEPT:]),
            step_per_batch=tuple(self.steps[-PER_BATCH_KEPT:]),
            copy_per_batch=copies,
            finished=self.finished,
            read_ahead=self.read_ahead,
            reads_draw=self.reads_draw,
        )
        said = verdict(stats, self.setup, first_wait=self.first_wait)
        return dataclasses.replace(stats, verdict=said)


def _whole_number(number: Any, function: Any, batch: int) -> int:
    """``number`` as returned by ``samples=function`` for a batch, where it is a count.

    Raises:
        TypeError: It is not an integer (a bool, a float, a tensor, ...).
        ValueError: It is negative.
    """
    name = getattr(function, "__qualname__", None) or repr(function)
    where = f"batch {batch} of this epoch (numbered from 0, as enumerate() numbers them)"
    if not whole_number(number):
        hint = (
            " (.item() makes a Python int of a one-element tensor)"
            if isinstance(number, _Tensor)
            else ""
        )
        msg = (
            f"Expected samples={name} to return the samples of {where} as an int, got "
            f"{type(number).__name__} {number!r}{hint}."
        )
        raise TypeError(msg)
    if int(number) < 0:
        msg = f"Expected samples={name} to return the samples of {where}, 0 or more, got {number}."
        raise ValueError(msg)
    return int(number)


def _per_sample(value: Any) -> bool:
    """Whether ``value`` is a list or tuple of per-sample tensors (images of any size)."""
    return (
        type(value) in (list, tuple)
        and len(value) >= 2
        and all(type(item) is _Tensor for item in value)
        and len({item.dim() for item in value}) == 1
    )


def samples_in(batch: Any, dim: int = 0) -> tuple[int | None, Any, bool]:
    """A batch's samples by the default rule, and where batches of its structure hold them.

    The rule is :attr:`LoaderStats.samples <devicekit.LoaderStats.samples>`'s, read along
    dimension ``dim`` (from the last where negative, as PyTorch indexes) of the tensors
    that have it, as the type table sees them (the READ view, which
    also looks inside objects that move themselves); a one-element tensor is left out of
    the sharing, so that two of them never outvote the batch's tensors.
    Where: the batch's entry (a key or an index, :data:`_WHOLE` for the batch itself) and
    whether its length counts, else its dimension ``dim``; :data:`_NOWHERE` where the
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
    # A tensor has dimension dim where its rank is above this: dim=-1 needs one dimension.
    below = dim if dim >= 0 else -dim - 1
    if type(batch) is _Tensor:
        return (batch.shape[dim], _WHOLE, False) if batch.dim() > below else (None, _NOWHERE, False)
    node = decide(type(batch)).read
    if not isinstance(node, Node):
        return None, _NOWHERE, False
    try:
        leaves = flatten(batch, view=READ).leaves
    except TransferError:
        return None, _NOWHERE, False
    sequence = node is LIST or node is TUPLE
    # The children with the key or index each is read by again (_NOWHERE: none): only an
    # item is, not a dataclass's fields, a namedtuple's attributes or an object's contents.
    entries = [
        (key.name if key.form == ITEM else _NOWHERE, child)
        for key, child in zip(node.keys(batch), node.children(batch), strict=True)
    ]
    # (a per-sample list's length, its entry)
    lengths = [(len(child), key) for key, child in entries if dim == 0 and _per_sample(child)]
    if sequence and dim == 0 and _per_sample(batch):
        lengths.insert(0, (len(batch), _WHOLE))
    # The entries that are tensors themselves, by identity: the first entry that holds one.
    direct = {id(child): key for key, child in reversed(entries) if isinstance(child, _Tensor)}
    # (a size along dim, the entry it is read from, whether it may share)
    sizes = [
        (leaf.shape[dim], direct.get(id(leaf), _NOWHERE), leaf.numel() != 1)
        for leaf in leaves
        if isinstance(leaf, _Tensor) and leaf.dim() > below
    ]
    voters = [size for size, _, votes in sizes if votes]
    shared = [size for size in set(voters) if voters.count(size) >= 2]
    found = max(shared or [size for size, _, _ in sizes], default=None)
    longest = max((length for length, _ in lengths), default=None)
    if longest is not None and (found is None or longest > found):
        return longest, next(key for length, key in lengths if length == longest), True
    if found is None:
        return None, _NOWHERE, False
    key = next((key for size, key, _ in sizes if size == found and key is not _NOWHERE), _NOWHERE)
    return found, key, False
