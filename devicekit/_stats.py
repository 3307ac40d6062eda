"""Is the loop waiting for data? What DeviceDataLoader measures of an epoch, and concludes.

The training thread's time in an epoch splits in two, batch by batch: the *wait*, from
asking the loader for a batch to getting it, and the *step*, from getting it to asking
for the next (the loop's own work)::

    asked ──wait──> got ──step──> asked ──wait──> got ──step──> ...

An :class:`EpochRecorder` takes two clock readings per batch for that. On an
accelerator it also holds a timer per copy (events on the side stream), read once the
copy has finished, so that measuring never makes the training thread wait. A snapshot
of its figures is a :class:`LoaderStats`, whose ``verdict`` (:func:`verdict`) reads them
with what the loader knows of its source (:class:`Setup`) and says which side the loop
is bound by, and what to change, only where the figures say so.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import torch

from devicekit import _kinds
from devicekit._kinds import DICT, LIST, MOVE, TUPLE
from devicekit._tree import first_leaf

_Tensor = torch.Tensor  # one global lookup a batch instead of two

COMPUTE_BOUND: Final = 0.10
"""Below this share of the epoch spent waiting, the loop is compute-bound: input as fast
as can be would gain it less than a tenth."""
INPUT_BOUND: Final = 0.5
"""From this share of the epoch spent waiting, the loop is input-bound: its data, not its
steps, sets its pace. Between the two, faster input would save up to that share."""
_FIRST_BATCH: Final = 0.5  # a wait that is mostly the first batch is about starting up

CopyTimer = Callable[[bool], "float | None"]
"""A copy's timer: its seconds once it finished, else None; given True, waits for it."""


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """One epoch of a :class:`~devicekit.DeviceDataLoader`, measured: is the loop waiting?

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
    """Their samples, read from the first dimension of each batch's first tensor; None
    where a batch's first leaf is no tensor with a first dimension."""
    wait_s: float = 0.0
    step_s: float = 0.0
    elapsed_s: float = 0.0
    wait_fraction: float = 0.0
    """``wait_s / elapsed_s``: the share of the epoch the loop waited for data."""
    copy_s: float | None = None
    """Time the device spent copying batches in (events on the side stream); None where
    batches are not copied ahead on an accelerator, or no copy's time is known yet."""
    wait_per_batch: tuple[float, ...] = ()
    step_per_batch: tuple[float, ...] = ()
    """One step per batch whose next batch was asked for, so an epoch left early lacks
    its last step."""
    copy_per_batch: tuple[float, ...] | None = None
    """The copies whose time is known, in order; None as ``copy_s``."""
    finished: bool = False
    """Whether the epoch ran to its end; False while it runs, or when it was left early."""
    verdict: str = "No batch has been handed over yet: nothing to judge."
    """Whether the loop is input- or compute-bound, and what to change, in a sentence or two."""


class Setup(NamedTuple):
    """What the loader knows of how its batches are made, for :func:`verdict`."""

    source: str  # "DataLoader", or the type of what else is wrapped
    num_workers: int | None  # None: not a DataLoader
    persistent_workers: bool
    pinned: bool  # by the DataLoader or by devicekit
    accelerator: bool  # batches copied ahead on a side stream
    cpus: int


def machine_cpus() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def verdict(stats: LoaderStats, setup: Setup) -> str:
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
        f"({_ms(stats.wait_s)} of {_ms(stats.elapsed_s)})"
    )
    if share < COMPUTE_BOUND:
        return f"{head}: it is compute-bound, so faster input would not make it faster."
    if share >= INPUT_BOUND:
        return f"{head}: it is input-bound. {_advice(stats, setup)}"
    return f"{head}: faster input could save up to {share:.0%} of it. {_advice(stats, setup)}"


def _advice(stats: LoaderStats, setup: Setup) -> str:
    """What to change for an input-bound epoch, from the first cause the figures show."""
    waits, workers = stats.wait_per_batch, setup.num_workers
    if len(waits) >= 3 and waits[0] >= _FIRST_BATCH * stats.wait_s:
        if workers and not setup.persistent_workers:
            return (
                f"Most of it was the first batch, while the DataLoader's {workers} workers "
                "started: persistent_workers=True keeps them from one epoch to the next."
            )
        return "Most of it was the first batch; the later ones kept up with the loop."
    copies, steps = stats.copy_per_batch, stats.step_per_batch
    if copies and steps and sum(copies) / len(copies) >= sum(steps) / len(steps):
        copy, step = _ms(sum(copies) / len(copies)), _ms(sum(steps) / len(steps))
        if not setup.pinned:
            return (
                f"Copying a batch to the device takes {copy}, longer than a step ({step}), "
                "from memory that is not pinned: pin_memory=True makes the copy faster."
            )
        return (
            f"Copying a batch to the device takes {copy}, longer than a step ({step}): send "
            "fewer bytes, for example uint8 images normalised on the device with transform=."
        )
    if workers is None:
        return (
            f"devicekit cannot see how the wrapped {setup.source} makes its batches: make "
            "that cheaper, or load them with a DataLoader and worker processes (num_workers=)."
        )
    cpus = setup.cpus
    suggested = min(cpus, max(2 * workers, cpus // 2, 1))
    if workers == 0 and cpus > 1:
        return (
            f"The DataLoader loads every batch in the training process (num_workers=0) on a "
            f"{cpus}-core machine; try num_workers={suggested}."
        )
    if workers < suggested:
        return (
            f"The DataLoader has {workers} workers on a {cpus}-core machine; try "
            f"num_workers={suggested}."
        )
    return (
        f"The DataLoader's {workers} workers already have the machine's {cpus} cores: make "
        "each sample cheaper to load (decoded once and cached, lighter transforms, or "
        "augmentation on the device with transform=)."
    )


class EpochRecorder:
    """The figures of one epoch as it runs; the training thread alone writes them."""

    __slots__ = ("copies", "finished", "samples", "setup", "steps", "timers", "waits")

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.waits: list[float] = []
        self.steps: list[float] = []
        self.samples: int | None = 0
        self.copies: list[float] | None = [] if setup.accelerator else None
        self.timers: list[CopyTimer] = []  # copies handed over, time not read yet
        self.finished = False

    def count(self, batch: Any) -> None:
        """Count the samples of a batch: the first dimension of its first leaf, a tensor."""
        if self.samples is None:
            return
        # The batch's own first child is looked up here, as the table has its type: a
        # (images, labels) pair or a dict of tensors then needs no first_leaf, whose
        # walk would make counting cost 1.0 us a batch instead of 0.6 (an eighth of
        # moving a small batch to the CPU).
        node = _kinds._views[MOVE].get(type(batch))  # as _tree reads it: no call
        if node is DICT:
            leaf = next(iter(batch.values()), None)
        elif (node is LIST or node is TUPLE) and batch:
            leaf = batch[0]
        else:
            leaf = batch
        if type(leaf) is not _Tensor:
            leaf = first_leaf(leaf)
            if not isinstance(leaf, torch.Tensor):
                self.samples = None
                return
        shape = leaf.shape
        self.samples = self.samples + shape[0] if shape else None

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
        wait_s, step_s = sum(self.waits), sum(self.steps)
        elapsed = wait_s + step_s
        # No copy time known (none finished yet, or a seam that cannot time) is None, never 0.
        copies = tuple(self.copies) if self.copies else None
        stats = LoaderStats(
            batches=len(self.waits),
            samples=self.samples,
            wait_s=wait_s,
            step_s=step_s,
            elapsed_s=elapsed,
            wait_fraction=wait_s / elapsed if elapsed > 0 else 0.0,
            copy_s=None if copies is None else sum(copies),
            wait_per_batch=tuple(self.waits),
            step_per_batch=tuple(self.steps),
            copy_per_batch=copies,
            finished=self.finished,
        )
        return dataclasses.replace(stats, verdict=verdict(stats, self.setup))
