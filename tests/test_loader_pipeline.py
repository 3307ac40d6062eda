"""The prefetching pipeline's control flow, run on the CPU with a stand-in for the streams.

On an accelerator, DeviceDataLoader copies batches ahead on a side stream; every stream
and event call goes through one seam (a Prefetcher). Here a stand-in takes its place for
the ``meta`` device and checks how the pipeline uses it, so that every path through the
pipeline (every prefetch depth and source length, a full epoch, an early break, a source
or a transform that raises at each position, Ctrl-C in the loop body, the next epoch)
runs in CI. Where what matters is the data that arrives (a source that refills its
buffer, pinned memory shared by live epochs), the loader runs on the stand-in
accelerator of devicekit.testing instead, with its real side stream, events and pinned
slabs, and copies that read host memory as late as a wait allows. Each runs under a
watchdog, so a hang fails the test with the place it hung, and each must leave no
thread behind.
"""

from __future__ import annotations

import queue
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk
from devicekit._loader import _loader, _pipeline, _staging
from devicekit.testing import still_pinned

from .conftest import WATCHDOG_S, Hang
from .helpers import META

pytestmark = pytest.mark.usefixtures("watchdog")


def _feed_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "devicekit-feed"]


def _no_thread_left() -> None:
    """Every feed thread ends (within the watchdog): after close() it finishes its item."""
    while _feed_threads():
        time.sleep(0.005)


class Ticket:
    """A batch in flight; counts itself alive as device memory would be held."""

    def __init__(self, owner: StandIn, batch: int) -> None:
        self.owner, self.batch = owner, batch
        owner.alive += 1

    def __del__(self) -> None:
        self.owner.alive -= 1


COPY_S = 0.002  # what every copy of the stand-in takes


class StandIn:
    """A Prefetcher that copies in order on the host and checks how it is used.

    "Moving" a batch multiplies it by 10. It holds the pipeline to the seam's contract:
    tickets are handed over once each, in the order started; at most ``depth`` are held
    at any time (dropped ones count no more, as freed memory would not); the consumer
    is done with a batch before the next is handed over.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.alive = 0
        self.started: list[int] = []
        self.handed: list[int] = []
        self.pinned_in: set[str] = set()  # the threads that staged a batch (see _loader_for)
        self.consumer_done_since_hand_over = True

    def start(self, batch: int) -> Ticket:
        assert self.alive < self.depth, "more batches in flight than prefetch allows"
        self.started.append(batch)
        return Ticket(self, batch)

    def hand_over(self, ticket: Ticket) -> int:
        assert self.consumer_done_since_hand_over, "handed over again before consumer_done"
        self.handed.append(ticket.batch)
        self.consumer_done_since_hand_over = False
        return ticket.batch * 10

    def consumer_done(self) -> None:
        self.consumer_done_since_hand_over = True

    def timer(self, ticket: Ticket) -> Callable[[bool], float | None]:
        # Every copy "took" COPY_S, known at once; the timer holds no ticket, as the real
        # one holds no batch.
        return lambda wait: COPY_S


class Source:
    """A re-iterable source of ``length`` ints; raises at ``fail_at`` once, if given."""

    def __init__(self, length: int, fail_at: int | None = None) -> None:
        self.length, self.fail_at = length, fail_at
        self.error = ValueError("record is corrupt")
        self.iterations = 0

    def __iter__(self) -> Iterator[int]:
        self.iterations += 1
        for index in range(self.length):
            if index == self.fail_at:
                self.fail_at = None  # the next epoch reads it fine
                raise self.error
            yield index


def _loader_for(
    source: Any,
    prefetch: int,
    pin: bool,
    monkeypatch: pytest.MonkeyPatch,
    *,
    live: int = 1,
    **options: Any,
) -> tuple[dk.DeviceDataLoader[Any], list[StandIn]]:
    """A loader over ``source`` with the stand-in; ``live`` epochs may hold batches at once."""
    made: list[StandIn] = []

    def make(device: torch.device, non_blocking: object) -> StandIn:
        made.append(StandIn(prefetch * live))
        return made[-1]

    def stage(self: _staging.Stager, batch: Any, stop: threading.Event) -> _staging.Staged:
        for prefetcher in made[-1:]:  # none where another test's prefetcher stands in
            prefetcher.pinned_in.add(threading.current_thread().name)
        return staged(self, batch, stop)

    staged = _staging.Stager.stage
    monkeypatch.setitem(_loader.PREFETCHERS, "meta", make)
    monkeypatch.setattr(_staging.Stager, "stage", stage)
    loader = dk.DeviceDataLoader(source, META, prefetch=prefetch, pin_memory=pin, **options)
    return loader, made


def _expected(length: int, prefetch: int) -> list[int]:
    """The batches of an epoch: moved by the stand-in, or in line (ints stay as they are)."""
    return [index * 10 if prefetch else index for index in range(length)]


DEPTHS = range(5)
LENGTHS = range(1, 8)  # an empty source has a test of its own: it reaches no position
PINNING = [False, True]  # where devicekit pins in the feed thread, and where it does not
PIN_IDS = {False: "unpinned", True: "pinned"}


def _paths(lengths: Iterable[int] = LENGTHS) -> list[Any]:
    """Every (prefetch, length, pin) that takes its own path through the pipeline.

    With ``prefetch=0`` each batch moves in line and nothing is pinned, so pinned and
    unpinned would run the same case twice: only the unpinned one is kept.
    """
    return [
        pytest.param(prefetch, length, pin, id=f"{prefetch}-{length}-{PIN_IDS[pin]}")
        for prefetch in DEPTHS
        for length in lengths
        for pin in PINNING
        if prefetch or not pin
    ]


@pytest.mark.parametrize(("prefetch", "length", "pin"), _paths())
def test_full_epochs_and_the_next_ones(
    prefetch: int, length: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = Source(length)
    loader, made = _loader_for(source, prefetch, pin, monkeypatch)
    for epoch in range(3):
        assert list(loader) == _expected(length, prefetch)
        assert source.iterations == epoch + 1  # the wrapped loader is iterated once per epoch
    _no_thread_left()
    if prefetch:
        assert len(made) == 1  # one prefetcher (one side stream) for the loader's life
        assert made[0].handed == made[0].started == list(range(length)) * 3
        # The first batch is read in this thread (it might draw random numbers), and
        # pinned here; the feed thread pins the rest.
        here = {threading.current_thread().name}
        pinned_in = here | {"devicekit-feed"} if length > 1 else here
        assert made[0].pinned_in == (pinned_in if pin else set())


@pytest.mark.parametrize("prefetch", [0, 2], ids=["in-line", "ahead"])
def test_an_empty_source_yields_nothing_every_epoch(
    prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing is started or read, so the depth and pinning make no difference here.
    source = Source(0)
    loader, made = _loader_for(source, prefetch, True, monkeypatch)
    for epoch in range(3):
        assert list(loader) == []
        assert source.iterations == epoch + 1
        stats = loader.stats
        assert (stats.batches, stats.samples, stats.finished) == (0, 0, True)
        assert (stats.wait_fraction, stats.read_ahead) == (0.0, False)
        assert stats.verdict == "No batch has been handed over yet: nothing to judge."
    _no_thread_left()
    assert len(made) == (1 if prefetch else 0)
    if prefetch:
        assert made[0].started == made[0].handed == []
        assert made[0].pinned_in == set()


@pytest.mark.parametrize(("prefetch", "length", "pin"), _paths())
def test_breaking_out_at_each_position(
    prefetch: int, length: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader, _ = _loader_for(Source(length), prefetch, pin, monkeypatch)
    for stop in range(length):
        got = []
        for batch in loader:
            got.append(batch)
            if len(got) == stop + 1:
                break
        assert got == _expected(stop + 1, prefetch)
        _no_thread_left()
        assert list(loader) == _expected(length, prefetch)  # the next epoch starts afresh
    _no_thread_left()


@pytest.mark.parametrize(("prefetch", "length", "pin"), _paths())
def test_a_source_raising_at_each_position(
    prefetch: int, length: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for fail_at in range(length):
        source = Source(length, fail_at=fail_at)
        loader, _ = _loader_for(source, prefetch, pin, monkeypatch)
        got = []
        with pytest.raises(ValueError, match="record is corrupt") as info:
            for batch in loader:
                got.append(batch)  # noqa: PERF402 - collects up to the failure
        assert info.value is source.error  # the same object, not a copy or a wrapper
        assert got == _expected(fail_at, prefetch)  # every batch before it arrived first
        _no_thread_left()
        assert list(loader) == _expected(length, prefetch)
    _no_thread_left()


@pytest.mark.parametrize(("prefetch", "length", "pin"), _paths())
def test_a_transform_raising_at_each_position(
    prefetch: int, length: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for fail_at in range(length):
        error = RuntimeError("transform failed")

        def transform(batch: int, fail_at: int = fail_at, error: Exception = error) -> int:
            if batch == _expected(fail_at + 1, prefetch)[-1]:
                raise error
            return batch + 1

        loader, _ = _loader_for(Source(length), prefetch, pin, monkeypatch, transform=transform)
        got = []
        with pytest.raises(RuntimeError, match="transform failed") as info:
            for batch in loader:
                got.append(batch)  # noqa: PERF402 - collects up to the failure
        assert info.value is error
        assert got == [value + 1 for value in _expected(fail_at, prefetch)]
        _no_thread_left()


@pytest.mark.parametrize(("prefetch", "length", "pin"), _paths())
def test_ctrl_c_in_the_loop_body_at_each_position(
    prefetch: int, length: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader, _ = _loader_for(Source(length), prefetch, pin, monkeypatch)
    for stop in range(length):
        seen = 0
        with pytest.raises(KeyboardInterrupt):
            for _batch in loader:
                if seen == stop:
                    raise KeyboardInterrupt
                seen += 1
        _no_thread_left()
        assert list(loader) == _expected(length, prefetch)
    _no_thread_left()


def test_the_watchdog_fails_a_hang_instead_of_stalling() -> None:
    # What every test above relies on: a blocked queue.get() is interrupted.
    import queue  # noqa: PLC0415 - this test alone blocks on a queue

    signal.setitimer(signal.ITIMER_REAL, 0.2)
    with pytest.raises(Hang, match="did not finish"):
        queue.Queue[int]().get()


def _epoch_with_early_breaks(loader: Any, breaks: int, every: int) -> list[Any]:
    for _ in range(breaks):
        for index, _batch in enumerate(loader):
            if index == every:
                break
    return list(loader)


def test_a_dataloader_with_persistent_workers_survives_early_breaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A DataLoader with persistent workers resets its one iterator on iter(): the feed
    # thread of a loop left early must be out of it before the next epoch starts.
    data = TensorDataset(torch.arange(64))
    inner = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
    loader, _ = _loader_for(inner, 2, True, monkeypatch)
    monkeypatch.setattr(StandIn, "hand_over", lambda self, ticket: ticket.batch)
    last = _epoch_with_early_breaks(loader, breaks=5, every=3)
    assert torch.equal(torch.cat([batch[0] for batch in last]), torch.arange(64))
    _no_thread_left()


def test_a_dataloader_starts_its_workers_once_per_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    inner = DataLoader(TensorDataset(torch.arange(8)), batch_size=4)
    original: Callable[..., Any] = DataLoader.__iter__

    def counting_iter(self: DataLoader[Any]) -> Any:
        calls.append(1)
        return original(self)

    monkeypatch.setattr(DataLoader, "__iter__", counting_iter)
    for prefetch in (0, 1, 3):
        calls.clear()
        loader, _ = _loader_for(inner, prefetch, True, monkeypatch)
        monkeypatch.setattr(StandIn, "hand_over", lambda self, ticket: ticket.batch)
        for _ in range(3):
            assert len(list(loader)) == 2
        assert len(calls) == 3
    _no_thread_left()


# Several live epochs of one loader, as DataLoader allows: each has its own pipeline, and
# none waits for another.

AHEAD = [1, 2, 3]


@pytest.mark.parametrize("pin", PINNING, ids=["unpinned", "pinned"])
@pytest.mark.parametrize("prefetch", AHEAD)
def test_peeking_at_a_batch_then_training(
    prefetch: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # it = iter(loader); first = next(it): a notebook habit, before the real loop.
    loader, _ = _loader_for(Source(6), prefetch, pin, monkeypatch, live=2)
    peek = iter(loader)
    first = next(peek)
    assert list(loader) == _expected(6, prefetch)
    assert [first, *peek] == _expected(6, prefetch)  # the peeked epoch goes on, whole
    _no_thread_left()


@pytest.mark.parametrize("pin", PINNING, ids=["unpinned", "pinned"])
@pytest.mark.parametrize("prefetch", AHEAD)
def test_nested_loops_over_one_loader(
    prefetch: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader, _ = _loader_for(Source(4), prefetch, pin, monkeypatch, live=2)
    pairs = [(a, b) for a in loader for b in loader]
    batches = _expected(4, prefetch)
    assert pairs == [(a, b) for a in batches for b in batches]
    _no_thread_left()


@pytest.mark.parametrize("pin", PINNING, ids=["unpinned", "pinned"])
@pytest.mark.parametrize("prefetch", AHEAD)
def test_two_live_iterators_taken_in_turn(
    prefetch: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader, _ = _loader_for(Source(5), prefetch, pin, monkeypatch, live=2)
    first, second = iter(loader), iter(loader)
    batches = _expected(5, prefetch)
    assert list(zip(first, second, strict=True)) == list(zip(batches, batches, strict=True))
    _no_thread_left()


class StuckSource:
    """Re-iterable; its first epoch blocks before batch ``at`` until ``release`` is set."""

    def __init__(self, length: int, at: int) -> None:
        self.length, self.at = length, at
        self.release = threading.Event()
        self.stuck = threading.Event()  # set once the first epoch is blocked
        self.epochs = 0

    def __iter__(self) -> Iterator[int]:
        self.epochs += 1
        epoch = self.epochs
        for index in range(self.length):
            if epoch == 1 and index == self.at:
                self.stuck.set()
                assert self.release.wait(WATCHDOG_S)
            yield index


@pytest.mark.parametrize("keep_the_stuck_epoch", [True, False], ids=["live", "left"])
@pytest.mark.parametrize("prefetch", AHEAD)
def test_a_stuck_epoch_never_holds_up_the_next(
    prefetch: int, keep_the_stuck_epoch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two batches taken copy `prefetch` more ahead: the source blocks just after those.
    source = StuckSource(prefetch + 5, at=prefetch + 2)
    loader, _ = _loader_for(source, prefetch, True, monkeypatch, live=2)
    stuck = iter(loader)
    assert [next(stuck), next(stuck)] == _expected(2, prefetch)
    assert source.stuck.wait(WATCHDOG_S)  # its feed thread waits inside the source
    if not keep_the_stuck_epoch:
        del stuck  # a loop left early: its feed is told to stop, nobody waits for it
    assert list(loader) == _expected(prefetch + 5, prefetch)  # the next epoch runs meanwhile
    source.release.set()
    if keep_the_stuck_epoch:
        assert list(stuck) == _expected(prefetch + 5, prefetch)[2:]
    _no_thread_left()


_EXITS_WITH_A_STUCK_SOURCE = """
import threading, torch, devicekit as dk
from devicekit._loader import _loader
from devicekit._core._packing import PACK_MAX_BYTES

class Instant:
    def start(self, batch): return batch
    def hand_over(self, ticket): return ticket
    def consumer_done(self): pass
    def timer(self, ticket): return lambda wait: None

def stuck_forever():
    yield from range(3)  # what the first batch and the copies ahead of it need
    threading.Event().wait()  # then a worker blocked on I/O, for good
    yield 3

_loader.PREFETCHERS["meta"] = lambda device, non_blocking: Instant()
loader = dk.DeviceDataLoader(stuck_forever, "meta", pin_memory=True)
epoch = iter(loader)
assert next(epoch) == 0
print("stuck", flush=True)
{ending}
"""


@pytest.mark.parametrize("ending", ["pass", "del epoch"], ids=["epoch-live", "epoch-left"])
def test_the_interpreter_exits_while_a_source_is_stuck(ending: str, fresh_python: str) -> None:
    script = _EXITS_WITH_A_STUCK_SOURCE.format(ending=ending)
    # The child imports PyTorch, which under load took longer than the watchdog: the
    # run's own timeout bounds it instead (a hang still fails, by killing the child).
    signal.setitimer(signal.ITIMER_REAL, 0)
    result = subprocess.run(
        [fresh_python, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "stuck\n"


_THREADS_AFTER_A_FEED = """
import torch
from devicekit._loader._feed import BackgroundFeed

feed = BackgroundFeed(iter(range(3)), lambda item: torch.get_num_threads(), 1)
print(torch.get_num_threads() == {expected}, list(feed))
"""


def test_the_feed_leaves_the_training_threads_intra_op_count_alone(fresh_python: str) -> None:
    # In a fresh process: a thread takes, at its first parallel op, the count last set by
    # any thread, so the feed's set_num_threads(1) must come after the training thread's.
    signal.setitimer(signal.ITIMER_REAL, 0)  # the child's import of PyTorch: see above
    expected = torch.get_num_threads()
    result = subprocess.run(
        [fresh_python, "-c", _THREADS_AFTER_A_FEED.format(expected=expected)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "True [1, 1, 1]\n"


# Each trial forks a child that leaves its loop mid-epoch, as a training script does, while
# the feed thread is inside PyTorch (a matrix product), and the child's interpreter ends.
_LEAVES_MID_EPOCH = """
import os, sys, torch, devicekit as dk
from devicekit._loader import _loader

class Instant:
    def start(self, batch): return batch
    def hand_over(self, ticket): return ticket
    def consumer_done(self): pass
    def timer(self, ticket): return lambda wait: None

_loader.PREFETCHERS["meta"] = lambda device, non_blocking: Instant()

def products():  # draws nothing: read ahead by the feed thread
    while True:
        yield torch.ones(1024, 256) @ torch.ones(256, 256)

statuses = []
for trial in range(12):
    pid = os.fork()
    if pid == 0:
        for step, batch in enumerate(dk.DeviceDataLoader(products, "meta")):
            if step == trial % 4:
                {leave}
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(statuses)
"""


@pytest.mark.parametrize(
    ("leave", "status"),
    [("sys.exit(3)", 3), ("raise KeyError('the loop failed')", 1)],
    ids=["sys.exit", "an error"],
)
def test_a_loop_that_exits_mid_epoch_ends_with_its_own_status(
    leave: str, status: int, fresh_python: str
) -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)  # the run's own timeout bounds it, as above
    result = subprocess.run(
        [fresh_python, "-c", _LEAVES_MID_EPOCH.format(leave=leave)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # -6 is SIGABRT: "terminate called without an active exception", the thread ended mid-call.
    assert result.stdout.strip() == str([status] * 12), result.stderr[-3000:]


def test_a_new_epoch_of_a_persistent_dataloader_ends_the_live_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its iter() resets the one iterator every epoch shares: the live epoch ends first
    # (what it copied ahead still arrives), and the new one reads every batch.
    data = TensorDataset(torch.arange(32))
    inner = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
    loader, _ = _loader_for(inner, 2, True, monkeypatch, live=2)
    monkeypatch.setattr(StandIn, "hand_over", lambda self, ticket: ticket.batch)
    peek = iter(loader)
    first = next(peek)
    assert torch.equal(torch.cat([batch[0] for batch in loader]), torch.arange(32))
    rest = list(peek)
    assert len(rest) <= 2  # what was in flight when the new epoch began, then the end
    assert torch.equal(torch.cat([b[0] for b in [first, *rest]]), torch.arange(4 * len(rest) + 4))
    _no_thread_left()


class OneIterator:
    """What a DataLoader with persistent workers does: one iterator, reset on iter()."""

    persistent_workers = True

    def __init__(self) -> None:
        # Stuck on its third read: the feed reads the second, whether or not the loop's
        # thread has taken it yet, then the third.
        self.source = StuckSource(6, at=2)
        self.current: Iterator[int] = iter(())

    def __iter__(self) -> Iterator[int]:
        self.current = iter(self.source)
        return self.current


def test_a_persistent_loader_stuck_in_a_live_epoch_is_an_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_loader, "HANDOFF_S", 0.2)
    inner = OneIterator()
    loader, _ = _loader_for(inner, 1, True, monkeypatch, live=2)
    stuck = iter(loader)
    assert next(stuck) == 0
    assert inner.source.stuck.wait(WATCHDOG_S)
    with pytest.raises(RuntimeError, match=r"persistent_workers=True\) and iter\(\) resets"):
        iter(loader)
    inner.source.release.set()
    del stuck
    _no_thread_left()


# The feed thread, set up as PyTorch's pin-memory thread is, and pinning through its seam.


def test_the_feed_thread_pins_on_one_core_and_leaves_the_training_thread_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads_seen: list[int] = []
    stage = _staging.Stager.stage

    def counting(self: _staging.Stager, batch: Any, stop: threading.Event) -> _staging.Staged:
        threads_seen.append(torch.get_num_threads())
        return stage(self, batch, stop)

    loader, _ = _loader_for(Source(3), 1, True, monkeypatch)
    monkeypatch.setattr(_staging.Stager, "stage", counting)
    before = torch.get_num_threads()
    assert list(loader) == _expected(3, 1)
    # The first batch is read and pinned in this thread, the others in the feed's.
    assert threads_seen == [before, 1, 1]
    assert torch.get_num_threads() == before
    _no_thread_left()


# Seeded runs: reading that draws random numbers never runs beside the loop's draws.


class Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """Items that draw from a global generator as they are read, as augmentation does."""

    def __init__(self, draw: Callable[[], float] | None) -> None:
        self.draw = draw

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.0005)  # reading takes a while, as decoding does
        noise = 0.0 if self.draw is None else self.draw()
        return torch.full((3,), float(index)) + noise


def _seeded_run(loader: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, float]]:
    """Every batch of a run seeded as a script seeds it, with the loop's own draw after it."""
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    seen = []
    for batch in loader:
        step = torch.rand(1).item()  # the loop's draws: dropout, noise
        time.sleep(0.0005)
        seen.append((batch.clone(), step))
    return seen


DRAWS = {
    "torch": lambda: torch.rand(1).item(),
    "python": random.random,
    "numpy": lambda: float(np.random.rand()),
    "none": None,
}


@pytest.mark.parametrize("draw", DRAWS)
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_a_seeded_run_repeats_and_matches_the_plain_loop(
    prefetch: int, shuffle: bool, draw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = DataLoader(Augmented(DRAWS[draw]), batch_size=4, shuffle=shuffle)
    plain = _seeded_run(data)
    loader, made = _loader_for(data, prefetch, True, monkeypatch)
    monkeypatch.setattr(StandIn, "hand_over", lambda self, ticket: ticket.batch)
    for _ in range(5):
        run = _seeded_run(loader)
        assert [step for _, step in run] == [step for _, step in plain]
        assert all(torch.equal(got, want) for (got, _), (want, _) in zip(run, plain, strict=True))
    # Reading that draws nothing past a shuffle's seed is read ahead by the feed; reading
    # that draws is not, and the stats say why.
    assert ("devicekit-feed" in made[0].pinned_in) == (draw == "none")
    assert (loader.stats.read_ahead, loader.stats.reads_draw) == (draw == "none", draw != "none")


# Where each read is made follows from the draws of the epoch's first two reads, and a
# run equals the plain loop exactly where no read made ahead draws: the rule the loader
# guide states, for sources that draw on some reads only.

TRAINING, FEED = "T", "F"  # the thread a read was made in


class Drawing:
    """Batches 0 to ``length - 1``; reading one of ``draws`` draws from torch's generator.

    ``threads`` says where each read of the latest epoch was made: T in the training
    thread, F in the feed.
    """

    def __init__(self, length: int, draws: Iterable[int]) -> None:
        self.length, self.draws = length, frozenset(draws)
        self.threads = ""
        self.read = [threading.Event() for _ in range(length)]  # set as each read ends

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.threads = ""
        for event in self.read:
            event.clear()
        for index in range(self.length):
            noise = torch.rand(1).item() if index in self.draws else 0.0
            feed = threading.current_thread().name == "devicekit-feed"
            self.threads += FEED if feed else TRAINING
            self.read[index].set()
            yield torch.full((2,), float(index)) + noise


DRAW_PATTERNS = {
    # name: (the reads that draw, where the loader makes each read)
    "never": ((), "TFFFFF"),
    "first-only": ((0,), "TTFFFF"),  # a shuffled DataLoader: its sampler's seed
    "every-read": (range(6), "TTTTTT"),
    "first-two-then-off": ((0, 1), "TTTTTT"),  # augmentation switched off after a warm-up
    "first-two-then-every-other": ((0, 1, 3, 5), "TTTTTT"),
    "on-after-a-warm-up": ((2, 3, 4, 5), "TFFFFF"),
    "every-other-from-the-first": ((0, 2, 4), "TTFFFF"),
    "every-other-from-the-second": ((1, 3, 5), "TFFFFF"),
}


def _drawing_run(loader: Iterable[torch.Tensor]) -> list[tuple[list[float], float]]:
    torch.manual_seed(3)
    return [(batch.tolist(), torch.rand(1).item()) for batch in loader]


@pytest.mark.parametrize("prefetch", [1, 3])
@pytest.mark.parametrize("pattern", DRAW_PATTERNS)
def test_where_each_read_is_made_and_when_a_run_equals_the_plain_loop(
    pattern: str, prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    draws, where = DRAW_PATTERNS[pattern]
    source = Drawing(6, draws)
    plain = _drawing_run(source)
    loader, _ = _loader_for(source, prefetch, True, monkeypatch)
    monkeypatch.setattr(StandIn, "hand_over", lambda self, ticket: ticket.batch)
    for _ in range(3):
        run = _drawing_run(loader)
        assert source.threads == where
        stats = loader.stats
        assert stats.read_ahead == (FEED in where)
        assert stats.reads_draw == (FEED not in where)  # and so every read was made here
        # Equal to the plain loop where every read that draws is made in the training
        # thread, as the loop asks for it; a drawing read made ahead runs beside a step.
        if all(where[index] == TRAINING for index in source.draws):
            assert run == plain
    _no_thread_left()


def test_a_read_made_ahead_that_draws_runs_before_the_step_it_follows_in_a_plain_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Why the guide does not promise the plain loop's run to a source that starts drawing
    # after its first reads: the feed reads batch k+1 while step k runs. Here each step
    # draws only once that read has ended, so the order is certain, and the run differs.
    source = Drawing(6, range(2, 6))
    plain = _drawing_run(source)
    loader, _ = _loader_for(source, 1, True, monkeypatch)
    monkeypatch.setattr(StandIn, "hand_over", lambda self, ticket: ticket.batch)
    torch.manual_seed(3)
    run = []
    for index, batch in enumerate(loader):
        if index + 1 < source.length:
            assert source.read[index + 1].wait(ACTION_WAIT_S)  # read ahead, beside the step
        run.append((batch.tolist(), torch.rand(1).item()))
    assert source.threads == "TFFFFF"
    assert [batch for batch, _ in run[:2]] == [batch for batch, _ in plain[:2]]  # no draws
    assert run[2][0] != plain[2][0]  # batch 2's draw came before step 1's, not after it
    _no_thread_left()


# A ready batch is handed over at once: the loader never waits for a later read while it
# holds one. A source whose next item waits for the step (an environment stepped by the
# policy, active learning) shows it: each read after the first waits for the action the
# loop posts after receiving the item before it. Had the loader read ahead before handing
# over, the read would wait for an action never posted (it fails after ACTION_WAIT_S).

ACTION_WAIT_S = WATCHDOG_S / 2


class Environment:
    """Yields a state, then waits for the loop's action to compute the next one."""

    def __init__(self, steps: int, *, draws: bool) -> None:
        self.steps, self.draws = steps, draws
        self.actions: queue.Queue[int] = queue.Queue()

    def __iter__(self) -> Iterator[int]:
        state = 1
        for _ in range(self.steps):
            state += random.randrange(3) if self.draws else 0  # an exploration draw
            yield state
            try:
                action = self.actions.get(timeout=ACTION_WAIT_S)
            except queue.Empty:
                msg = "the loader read the next state before handing over this one"
                raise AssertionError(msg) from None
            state = state * 3 % 1000 + action


def _episode(loader: Iterable[int], environment: Environment, moved: int) -> list[int]:
    """The states a loop sees, acting on each (``moved``: what the loader multiplies by)."""
    random.seed(0)
    states = []
    for state in loader:
        states.append(state // moved)
        environment.actions.put(states[-1] % 7 + random.randrange(2))  # the policy draws too
    return states


@pytest.mark.parametrize("draws", [False, True], ids=["no-draws", "draws"])
@pytest.mark.parametrize("pin", PINNING, ids=["unpinned", "pinned"])
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_a_source_that_waits_for_the_step_never_deadlocks(
    prefetch: int, pin: bool, draws: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 6
    plain = Environment(steps, draws=draws)
    expected = _episode(plain, plain, 1)
    environment = Environment(steps, draws=draws)
    loader, made = _loader_for(environment, prefetch, pin, monkeypatch)
    assert _episode(loader, environment, 10) == expected  # the states the plain loop saw
    assert len(expected) == steps
    assert made[0].handed == made[0].started  # every read was copied and handed over
    _no_thread_left()


@pytest.mark.parametrize("pin", PINNING, ids=["unpinned", "pinned"])
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_the_first_batch_arrives_while_the_second_is_still_being_read(
    prefetch: int, pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    received = threading.Event()  # set by the loop once it holds the first batch
    reads_before: list[bool] = []

    class SlowSecond:
        def __iter__(self) -> Iterator[int]:
            yield 0
            reads_before.append(received.wait(timeout=ACTION_WAIT_S))  # a slow read
            yield from range(1, 5)

    loader, _ = _loader_for(SlowSecond(), prefetch, pin, monkeypatch)
    got = []
    for batch in loader:
        received.set()
        got.append(batch)
    assert got == [0, 10, 20, 30, 40]
    assert reads_before == [True]  # the second read ended once the first batch was out
    _no_thread_left()


# Round seven: a source that refills one buffer, close() from another thread, an epoch
# after a staging error, and the process's thread count, each under the watchdog.


class Refilled:
    """A reader that refills one preallocated buffer for every batch it yields.

    As memory-mapped readers, rings of buffers and ``torch.from_numpy`` over a reused
    array do: batch k's tensors are batch k's until batch k+1 is read.
    """

    def __init__(self, length: int, numel: int) -> None:
        self.length = length
        self.images = torch.empty(numel)
        self.labels = torch.empty(4, dtype=torch.int64)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for index in range(self.length):
            self.images.fill_(float(index))
            self.labels.fill_(index)
            yield {"image": self.images, "label": self.labels}


@pytest.mark.parametrize("pin", PINNING, ids=["unpinned", "pinned"])
@pytest.mark.parametrize("numel", [16, 1 << 14], ids=["small", "large"])
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_a_source_that_refills_one_buffer_gets_every_batch_right(
    prefetch: int, numel: int, pin: bool, stand_in_device: torch.device
) -> None:
    # On the stand-in each copy reads the host memory when it runs, as late as a wait
    # allows: a refill before then would give the wrong batch, or poison (NaN).
    pinned = set(still_pinned())
    source = Refilled(8, numel)
    plain = [(batch["image"].clone(), batch["label"].clone()) for batch in source]
    loader = dk.DeviceDataLoader(source, stand_in_device, prefetch=prefetch, pin_memory=pin)
    for _ in range(2):
        got = [(batch["image"].cpu(), batch["label"].cpu()) for batch in loader]
        assert len(got) == len(plain)
        for (image, label), (expected_image, expected_label) in zip(got, plain, strict=True):
            assert torch.equal(image, expected_image)  # one batch's, whole
            assert torch.equal(label, expected_label)
    loader.close()
    assert set(still_pinned()) <= pinned  # every slab it registered, unregistered
    _no_thread_left()


@pytest.mark.parametrize("loop", ["peek", "nested"])
def test_live_epochs_of_large_batches_share_the_pinned_memory_without_a_hang(
    loop: str, stand_in_device: torch.device
) -> None:
    pinned = set(still_pinned())
    batches = [torch.full((1 << 14,), float(index)) for index in range(6)]
    loader = dk.DeviceDataLoader(batches, stand_in_device)

    def value(batch: torch.Tensor) -> float:
        whole = batch.cpu()
        assert torch.equal(whole, torch.full_like(whole, whole[0].item()))  # no poison
        return whole[0].item()

    expected = [float(index) for index in range(6)]
    if loop == "peek":
        peek = iter(loader)
        first = next(peek)
        time.sleep(0.05)  # its feed reads ahead, holding slabs, until its loop comes back
        assert [value(batch) for batch in loader] == expected
        assert (
            loader.stats.unpinned_why is None or "another live epoch" in loader.stats.unpinned_why
        )
        assert [value(first)] + [value(batch) for batch in peek] == expected
    else:
        pairs = [(value(a), value(b)) for a in loader for b in loader]
        assert pairs == [(a, b) for a in expected for b in expected]
    loader.close()
    assert set(still_pinned()) <= pinned  # every slab it registered, unregistered
    _no_thread_left()


def test_close_from_another_thread_ends_an_epoch_waiting_for_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = StuckSource(6, at=3)
    loader, _ = _loader_for(source, 1, True, monkeypatch)
    got: list[int] = []
    loop = threading.Thread(target=lambda: got.extend(loader), name="training loop")
    loop.start()
    assert source.stuck.wait(WATCHDOG_S)
    loader.close()
    loop.join(WATCHDOG_S / 2)
    ended = not loop.is_alive()
    source.release.set()
    loop.join()
    assert ended  # woken by close(), not by the source
    assert got == _expected(len(got), 1)
    assert not loader.stats.finished  # ended by close(), not run to its end
    _no_thread_left()


def test_an_epoch_ended_by_close_is_not_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    loader, _ = _loader_for(Source(6), 1, True, monkeypatch)
    epoch = iter(loader)
    assert next(epoch) == 0
    loader.close()
    rest = list(epoch)  # what was copied ahead still arrives, then the epoch ends
    assert rest == _expected(len(rest) + 1, 1)[1:]
    assert not loader.stats.finished
    assert list(loader) == _expected(6, 1)  # a later epoch opens the loader again
    assert loader.stats.finished
    _no_thread_left()


class FailsToPin:
    """Moves itself; its pin_memory() raises in the first epoch only."""

    failed = False

    def to(self, *args: Any, **kwargs: Any) -> FailsToPin:
        return self

    def pin_memory(self) -> FailsToPin:
        if not FailsToPin.failed:
            FailsToPin.failed = True
            msg = "cannot pin this record"
            raise OSError(msg)
        return self


def test_an_epoch_after_a_staging_error_runs_to_its_end(
    monkeypatch: pytest.MonkeyPatch, stand_in_device: torch.device
) -> None:
    monkeypatch.setattr(FailsToPin, "failed", False)
    pinned = set(still_pinned())
    large = 1 << 14  # float32 elements: staged in a slab

    def batches() -> Iterator[list[Any]]:
        for index in range(6):
            yield [torch.full((large,), float(index)), FailsToPin() if index == 3 else None]

    loader = dk.DeviceDataLoader(batches, stand_in_device, prefetch=1, pin_memory_limit=4 * large)
    with pytest.raises(OSError, match="cannot pin this record"):
        for _ in loader:
            pass
    got = [batch[0].cpu() for batch in loader]  # no slab kept by the error: no hang
    assert [tensor.tolist() for tensor in got] == [[float(index)] * large for index in range(6)]
    loader.close()
    assert set(still_pinned()) <= pinned  # every slab it registered, unregistered
    _no_thread_left()


def test_reading_ahead_leaves_the_process_s_thread_count_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The feed sets its own thread to one core; a thread started later (an evaluation
    # thread, MKL's next call) must still get the process's count.
    count = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loader, _ = _loader_for(Source(4), 1, True, monkeypatch)
        assert list(loader) == _expected(4, 1)
        seen: list[int] = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert seen == [2]
    finally:
        torch.set_num_threads(count)
    _no_thread_left()


class CopyEvent:
    """An event recorded after a copy that ends at the ``queries``-th query.

    ``synchronize()`` stands for cudaEventSynchronize on an event made without the
    blocking flag, which spins a core until the copy ends: it must not be called.
    """

    def __init__(self, queries: int) -> None:
        self.queries, self.asked = queries, 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > self.queries

    def synchronize(self) -> None:
        msg = "waited by spinning a core (cudaEventSynchronize on a non-blocking event)"
        raise AssertionError(msg)

    def elapsed_time(self, end: CopyEvent) -> float:
        return 2.0  # milliseconds


def test_waiting_for_a_copy_sleeps_between_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(_pipeline, "_sleep", slept.append)
    begin, ready = CopyEvent(0), CopyEvent(5)
    timer = _pipeline.StreamPrefetcher.timer(None, (None, begin, ready))  # type: ignore[arg-type]
    assert timer(False) is None  # still running: no wait
    assert timer(True) == 0.002
    assert len(slept) == 3  # a sleep between each look, none after the last
    assert slept == sorted(slept)  # longer as the copy runs on, up to a bound
    assert max(slept) <= _pipeline.WAIT_LOOK_MAX_S
