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

from devicekit._loader._staging import PoolFigures, StagingPool
from devicekit._loader._stats import (
    NOWHERE,
    WHOLE,
    LoaderStats,
    Setup,
    returned_count,
    samples_in,
    verdict,
)

CopyTimer = Callable[[bool], "float | None"]
"""A copy's timer: its seconds once it finished, else None; given True, waits for it."""

CROWDED: Final = (
    "the loader's pinned memory was held by batches another live epoch read ahead (a peek "
    "with next(iter(loader)), a nested loop): end that epoch first, or raise pin_memory_limit="
)
"""Why a batch read in the training thread was not pinned, where its pool was full."""
PER_BATCH_KEPT: Final = 10_000
"""Batches whose times the per-batch tuples keep, the latest; the sums cover every batch."""
_FOLD_AT: Final = 2 * PER_BATCH_KEPT


class EpochRecorder:
    """The figures of one epoch as it runs; the training thread alone writes them."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.waits: list[float] = []
        self.steps: list[float] = []
        self.samples: int | None = 0
        self.copies: list[float] | None = [] if setup.accelerator else None
        # Copies handed over, time not read yet, each with its bytes (None: not counted).
        self.timers: list[tuple[CopyTimer, int | None]] = []
        # The bytes and seconds of the copies whose bytes are known: the bandwidth.
        self.counted_bytes = 0
        self.counted_s = 0.0
        self.pool: StagingPool | None = None  # the loader's, where it pins
        self.pool_before = PoolFigures()
        self.finished = False
        self.closed = False  # ended by the loader's close(), not by the source's end
        # Where the loader reads this epoch's batches (see _pipeline.ahead).
        self.read_ahead = False
        self.reads_draw: bool | None = None
        # Where this epoch's batches hold their samples (see samples_in): the entry
        # ``key`` of a batch (WHOLE: the batch itself), its length or its first dimension.
        self.key: Any = NOWHERE
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
        if key is not NOWHERE and type(batch) is self.holder:
            try:
                value = batch if key is WHOLE else batch[key]
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
            self.key = NOWHERE  # so each batch is looked at anew, never indexed
        self.samples = None if number is None else self.samples + number

    def _call(self, batch: Any) -> None:
        """Count a batch's samples with the function given as ``samples=``."""
        if len(self.waits) >= _FOLD_AT:
            self._fold()
        function = self.setup.counting.function
        number = function(batch)  # type: ignore[misc]  # set where this is the counter
        if type(number) is not int or number < 0:
            number = returned_count(number, function, self.folded + len(self.waits) - 1)
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
            timer, size = self.timers[0]
            seconds = timer(wait)
            if seconds is None:
                return
            self.copies.append(seconds)
            if size is not None:
                self.counted_bytes += size
                self.counted_s += seconds
            del self.timers[0]

    def _pool_figures(self) -> dict[str, Any]:
        """The staging pool's figures over this epoch (its peak and cap: the loader's so far)."""
        if self.pool is None:
            return {}
        now, before = self.pool.figures, self.pool_before
        return {
            "pinned_bytes": now.peak_bytes,
            "pinned_limit": self.pool.cap,
            "pinned_batches": now.staged - before.staged,
            "pinned_reused": now.reused - before.reused,
            "unpinned": now.unpinned - before.unpinned,
            "unpinned_why": self.pool.failure
            or (CROWDED if now.crowded > before.crowded else None),
        }

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
            copy_bytes=self.counted_bytes,
            copy_gbps=self.counted_bytes / self.counted_s / 1e9 if self.counted_s > 0 else None,
            finished=self.finished,
            read_ahead=self.read_ahead,
            reads_draw=self.reads_draw,
            **self._pool_figures(),
        )
        said = verdict(stats, self.setup, first_wait=self.first_wait)
        return dataclasses.replace(stats, verdict=said)
