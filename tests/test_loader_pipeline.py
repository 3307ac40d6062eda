"""The prefetching pipeline's control flow, run on the CPU with a stand-in for the streams.

On an accelerator, DeviceDataLoader copies batches ahead on a side stream; every stream
and event call goes through one seam (a Prefetcher). Here a stand-in takes its place for
the ``meta`` device and checks how the pipeline uses it, so that every path through the
pipeline (every prefetch depth and source length, a full epoch, an early break, a source
or a transform that raises at each position, Ctrl-C in the loop body, the next epoch)
runs in CI. Each runs under a watchdog, so a hang fails the test with the place it hung,
and each must leave no thread behind.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk
from devicekit import _loader

META = torch.device("meta")
WATCHDOG_S = 10


class Hang(Exception):  # noqa: N818 - what it reports is a hang
    """Raised in the test's thread when the watchdog fires."""


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    """Fail, instead of stalling CI, when a test blocks for WATCHDOG_S seconds."""

    def fire(signum: int, frame: object) -> None:
        msg = f"the test did not finish within {WATCHDOG_S} s: it hangs where this was raised"
        raise Hang(msg)

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
        self.pinned_in: set[str] = set()
        self.consumer_done_since_hand_over = True

    def pin(self, batch: int) -> int:
        self.pinned_in.add(threading.current_thread().name)
        return batch

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
    source: Any, prefetch: int, pin: bool, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> tuple[dk.DeviceDataLoader[Any], list[StandIn]]:
    made: list[StandIn] = []

    def make(device: torch.device, non_blocking: object) -> StandIn:
        made.append(StandIn(prefetch))
        return made[-1]

    monkeypatch.setitem(_loader.PREFETCHERS, "meta", make)
    loader = dk.DeviceDataLoader(source, META, prefetch=prefetch, pin_memory=pin, **options)
    return loader, made


def _expected(length: int, prefetch: int) -> list[int]:
    """The batches of an epoch: moved by the stand-in, or in line (ints stay as they are)."""
    return [index * 10 if prefetch else index for index in range(length)]


DEPTHS = range(5)
LENGTHS = range(8)
PINNING = [False, True]  # without and with the background feed thread


@pytest.mark.parametrize("pin", PINNING, ids=["in-thread", "feed-thread"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("prefetch", DEPTHS)
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
        assert made[0].pinned_in == ({"devicekit-feed"} if pin and length else set())


@pytest.mark.parametrize("pin", PINNING, ids=["in-thread", "feed-thread"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("prefetch", DEPTHS)
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


@pytest.mark.parametrize("pin", PINNING, ids=["in-thread", "feed-thread"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("prefetch", DEPTHS)
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


@pytest.mark.parametrize("pin", PINNING, ids=["in-thread", "feed-thread"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("prefetch", DEPTHS)
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


@pytest.mark.parametrize("pin", PINNING, ids=["in-thread", "feed-thread"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("prefetch", DEPTHS)
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
