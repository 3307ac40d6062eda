"""Copying ahead: the copies in flight, the seam they go through, and when to read ahead.

Steps 2 and 3 of the pipeline that :mod:`devicekit._loader._loader` draws, over the seam it
describes (:class:`Prefetcher`; :class:`StreamPrefetcher` on an accelerator's side
stream), and when its first stage (:mod:`devicekit._loader._feed`) may read ahead (:func:`ahead`).
"""

from __future__ import annotations

import collections
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

import torch

from devicekit._base import new_event, new_stream, profiler_running
from devicekit._core import NonBlocking, to_device
from devicekit._loader._feed import NOT_READY, STOP_POLL_S, BackgroundFeed
from devicekit._loader._recorder import CopyTimer, EpochRecorder
from devicekit._loader._staging import Staged, measured

__all__ = ["Prefetcher", "StreamPrefetcher", "ahead", "profiling"]

_END: Final = object()
_READS_CHECKED: Final = 2
"""An epoch's reads watched for random draws before it reads ahead (see :func:`ahead`): the
first read of a shuffled DataLoader draws the sampler's seed, however plain its data."""
WAIT_LOOK_MIN_S: Final = 50e-6
WAIT_LOOK_MAX_S: Final = 1e-3
"""A wait for a copy looks whether it ended, sleeping between looks from 50 us, twice as
long each time, up to 1 ms: a copy's end is seen within a millisecond of it, for about 2%
of a core (a 200 ms copy: 4.4 ms of the waiting thread's CPU, this project's CI machine,
an event standing in). ``event.synchronize()`` would spin a core for the whole copy
(cudaEventSynchronize on an event made without the blocking flag, which ``torch.Event``
cannot set)."""
_sleep = time.sleep  # the seam the tests watch the waits through


class Prefetcher(Protocol):
    """The seam between the loader's pipeline and an accelerator's streams and events.

    The pipeline calls :meth:`start` for a batch ``prefetch`` batches before it is
    needed, :meth:`hand_over` when the consumer asks for it, and :meth:`consumer_done`
    each time the consumer comes back for the next one.
    """

    def start(self, batch: Any) -> Any:
        """Issue the batch's copy to the device without waiting; return a ticket for it."""

    def hand_over(self, ticket: Any) -> Any:
        """The moved batch of ``ticket``, safe for the consumer's stream to read."""

    def consumer_done(self) -> None:
        """Order later copies after everything the consumer has queued so far."""

    def timer(self, ticket: Any) -> CopyTimer:
        """How long the ticket's copy took on the device; it holds nothing of the batch."""


profiling: Final = profiler_running
"""Whether a torch.profiler session runs: a range costs 15 us even when none does (this
0.1 us), so the loader names its work only while one does."""


def _in_range(name: str, work: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``work``, each call a range called ``name`` in the profiler's trace while one runs."""

    def run(item: Any) -> Any:
        if not profiling():
            return work(item)
        with torch.profiler.record_function(name):
            return work(item)

    return run


def random_state() -> tuple[Any, ...]:
    """Where the process's global random generators stand: torch's (CPU), Python's, numpy's.

    About 100 us (numpy's copy of its state is most of it): taken twice an epoch at most.
    """
    numpy = sys.modules.get("numpy")
    at = None if numpy is None else numpy.random.get_state(legacy=False)
    if at is not None:  # what a draw moves, comparable with ==
        at = at["state"]["key"].tobytes(), at["state"]["pos"], at["has_gauss"]
    return torch.default_generator.get_state(), random.getstate(), at


def drew_since(before: tuple[Any, ...]) -> bool:
    """Whether anything drew from those generators since ``before`` was taken."""
    after = random_state()
    return not torch.equal(before[0], after[0]) or before[1:] != after[1:]


class StreamPrefetcher:
    """The accelerator side of the pipeline: one side stream for the loader's whole life."""

    def __init__(self, device: torch.device, non_blocking: NonBlocking) -> None:
        self._device = device
        self._non_blocking = non_blocking
        self._stream = new_stream(device)

    def start(self, batch: Any) -> tuple[Any, torch.Event, torch.Event]:
        # Timing events, recorded around the copy: its time, read later, costs no wait.
        begin, ready = (new_event(self._device, enable_timing=True) for _ in "br")
        with self._stream:
            begin.record(self._stream)
            moved = to_device(batch, self._device, non_blocking=self._non_blocking)
            ready.record(self._stream)
        return moved, begin, ready

    def hand_over(self, ticket: tuple[Any, torch.Event, torch.Event]) -> Any:
        moved, _, ready = ticket
        torch.accelerator.current_stream(self._device).wait_event(ready)
        return moved

    def timer(self, ticket: tuple[Any, torch.Event, torch.Event]) -> CopyTimer:
        _, begin, ready = ticket

        def seconds(wait: bool) -> float | None:
            if not ready.query():
                if not wait:
                    return None
                _wait_for(ready)
            return begin.elapsed_time(ready) / 1e3

        return seconds

    def consumer_done(self) -> None:
        self._stream.wait_stream(torch.accelerator.current_stream(self._device))


def _wait_for(event: torch.Event) -> None:
    """Wait for ``event`` without spinning a core: look, sleep, look again (see WAIT_LOOK_*)."""
    look = WAIT_LOOK_MIN_S
    while not event.query():
        _sleep(look)
        look = min(2 * look, WAIT_LOOK_MAX_S)


def _prefetched(
    batches: Iterator[Staged],
    prefetcher: Prefetcher,
    depth: int,
    finish: Callable[[Any], Any],
    record: EpochRecorder,
    *,
    ready: Callable[[], Any] | None = None,
    first: Staged | None = None,
) -> Iterator[Any]:
    """The pipeline: copies up to ``depth`` batches ahead, hands them over in order.

    Later batches are taken only where ``ready()`` has them already (a feed that reads
    ahead), so a source whose next batch is slow, or depends on the step's result, holds
    back no batch in hand; the next is waited for only where nothing is in flight.
    ``first``, where given, was read already.

    An exception from the source or from starting a copy surfaces in its place, after
    every batch before it; one from ``finish`` (the transform) surfaces at once. Each
    copy's timer goes to ``record`` as its batch is handed over.
    """
    start = _in_range("devicekit.copy", prefetcher.start)
    in_flight: collections.deque[Any] = collections.deque()
    failure: list[Exception] = []  # the source's: raised once the batches before it are out
    ended = False

    def issue(staged: Staged) -> None:
        """Start the batch's copy; its slab, and the source's memory, wait for no more."""
        ticket = start(staged.batch)
        staged.copy_issued(prefetcher.timer(ticket))
        in_flight.append((ticket, staged.nbytes))

    def take(read: Callable[[], Any]) -> bool:
        """Start the copy of what ``read`` gives; whether it gave a batch."""
        nonlocal ended
        try:
            # No local holds the batch or its ticket: the source's exception, kept until
            # raised (and maybe by the caller after), would keep them alive.
            item = read()
            if item is NOT_READY:
                return False
            issue(item)
        except StopIteration:
            ended = True
            return False
        except Exception as error:  # re-raised below, unchanged, in its place
            item = None  # its traceback holds this frame: the batch is not kept with it
            failure.append(error)
            ended = True
            return False
        return True

    def top_up() -> None:  # what is ready, no more: the batch in hand is never held back
        while ready is not None and not ended and len(in_flight) < depth and take(ready):
            pass

    # An epoch left early never came back for its last batch: order this epoch's first
    # copies after whatever the consumer queued since, as every later resume does.
    prefetcher.consumer_done()
    if first is not None:
        issue(first)
        del first
    while True:
        if not in_flight and not ended:
            take(batches.__next__)  # nothing in flight: wait for the source
        top_up()
        if not in_flight:
            break
        ticket, size = in_flight.popleft()
        record.timers.append((prefetcher.timer(ticket), size))
        batch = prefetcher.hand_over(ticket)
        del ticket
        record.read_copies()
        top_up()  # the next copies run while the consumer's step does
        yield finish(batch)
        del batch
        prefetcher.consumer_done()
    if failure:
        raise failure[0]


def _read_once_free(
    batches: Iterator[Any], last: list[threading.Event], stop: threading.Event
) -> Iterator[Any]:
    """``batches``, each read once the batch before it no longer reads the source's memory.

    ``last`` holds the ``source_read`` of the batch read last (see
    :class:`~devicekit._loader._staging.Staged`), where it has one. A source may refill
    the memory of the batch it yielded when it reads the next (memory-mapped readers, a
    ring of buffers, ``torch.from_numpy`` over one array), as a plain loop allows: the
    next read waits until that batch's copy has read it, or until the feed stops.
    """
    while True:
        while last:
            if last[-1].wait(STOP_POLL_S):
                last.clear()
            elif stop.is_set():
                return
        batch = next(batches, _END)
        if batch is _END:
            return
        yield batch
        del batch


def ahead(
    batches: Iterator[Any],
    prefetcher: Prefetcher,
    device: torch.device,
    record: EpochRecorder,
    *,
    depth: int,
    finish: Callable[[Any], Any],
    stage: Callable[[Any, threading.Event | None], Staged] | None,
    feeds: weakref.WeakSet[BackgroundFeed],
) -> Iterator[Any]:
    """An epoch's ``batches``, copied up to ``depth`` ahead, read ahead where reads draw nothing.

    The feed that reads ahead goes into ``feeds`` while it lives. Every batch is pinned
    with ``stage`` (None: devicekit does not pin), in the thread that reads it; ``finish``
    is the transform, ``record`` the epoch's figures.
    """
    ready_it = stage or measured
    # In this thread: a full pool waits for none of the batches it holds (they wait for it).
    stage_here = _in_range("devicekit.pin", lambda batch: ready_it(batch, None))
    # Reads that draw from the global random generators (augmentation without workers,
    # a sampler's shuffle, graph sampling) are made in this thread, between the loop's
    # steps, as in a plain loop: a thread reading ahead would interleave its draws with
    # the loop's by timing, and a seeded run would repeat neither. A read's draws cannot
    # be known before it is made, nor told apart from the loop's once a thread makes it
    # beside them (the generators are the process's), and read k's follow step k-1's: so
    # the first read is made here, the second where the first drew, and every read where
    # both drew (``reads_draw``); else the rest is read ahead. A source that draws only
    # from a later read on (after a warm-up) is read ahead, and the guide says so.
    checks = _READS_CHECKED
    while True:
        before = random_state() if checks else None
        batch = next(batches, _END)
        if batch is _END:
            return
        if before is not None:
            if not drew_since(before):
                record.reads_draw = False
                break  # reading draws nothing: from this batch on, read ahead
            checks -= 1
            if not checks:
                record.reads_draw = True  # every read is made here, from now on
        yield from _prefetched(iter((stage_here(batch),)), prefetcher, 1, finish, record)
        del batch
    # The rest is read by a feed thread, pinned there where devicekit pins, so that a
    # batch ready on the device is handed over whatever the next one's read costs.
    first = stage_here(batch)
    del batch
    stop = threading.Event()
    last = [] if first.source_read is None else [first.source_read]

    def ready_there(batch: Any) -> Staged:
        staged = ready_it(batch, stop)
        if staged.source_read is not None:
            last.append(staged.source_read)  # the next read waits for its copy
        return staged

    pin = _in_range("devicekit.pin", ready_there)
    feed = BackgroundFeed(_read_once_free(batches, last, stop), pin, depth, device, stop)
    feeds.add(feed)
    record.read_ahead = True
    pipeline = _prefetched(feed, prefetcher, depth, finish, record, ready=feed.ready, first=first)
    del first
    try:
        yield from pipeline
        record.closed = feed.closed_early
    finally:
        # The end, an error, or a loop left early: the thread stops, the prefetched go.
        feed.close()
