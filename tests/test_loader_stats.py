"""DeviceDataLoader measures each epoch and says whether the loop waits for its data.

Sources and loop bodies that take a known time per batch stand for slow data and
heavy steps. Where a figure or a verdict is asserted, they take it on the loader's clock
(:class:`FakeClock`), not the machine's: the figures are then exactly what they imply,
on an idle machine or a busy one (no test asserts a timing, docs/contributing.rst).
The profiler's ranges are looked for in a real ``torch.profiler`` trace on the CPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import re
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import devicekit as dk
from devicekit._base import LinkPeak
from devicekit._core._tree import MAX_DEPTH
from devicekit._loader import _loader, _staging, _stats
from devicekit._loader._recorder import PER_BATCH_KEPT
from devicekit._loader._stats import HANDOVER_S, Counting, LoaderStats, Setup, samples_in, verdict

from .helpers import META, HostCopies

SOURCE_S, STEP_S = 0.030, 0.005  # input-bound: the loop waits 30 of every 35 ms
COPY_S = 0.004


class FakeClock:
    """The loader's clock (``_loader._clock``), moved on only by :meth:`sleep`.

    A source or a step that sleeps on it takes exactly that long for the loader, however
    busy the machine is, and no real time passes.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()  # a feed thread may read ahead, and sleep, meanwhile
        monkeypatch.setattr(_loader, "_clock", lambda: self.now)

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    return FakeClock(monkeypatch)


class Sleepy(Dataset[torch.Tensor]):
    """A dataset whose every sample takes ``seconds`` to load (on ``sleep``'s clock)."""

    def __init__(
        self, count: int, seconds: float, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.count, self.seconds, self.sleep = count, seconds, sleep

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        self.sleep(self.seconds)
        return torch.full((3,), float(index))


def _run(
    loader: dk.DeviceDataLoader[Any],
    step_s: float,
    *,
    stop_after: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    for index, _batch in enumerate(loader):
        if stop_after is not None and index == stop_after:
            break
        sleep(step_s)


@pytest.fixture
def sixteen_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine of 16 cores, whatever this one has: the advice depends on it."""
    monkeypatch.setattr(_loader, "machine_cpus", lambda: 16)


@pytest.mark.usefixtures("sixteen_cores")
def test_an_input_bound_loop_is_measured_and_told_what_to_change(clock: FakeClock) -> None:
    inner = DataLoader(Sleepy(12, SOURCE_S, clock.sleep), batch_size=1)  # one sample a batch
    loader = dk.DeviceDataLoader(inner, "cpu")
    _run(loader, STEP_S, sleep=clock.sleep)
    stats = loader.stats
    assert stats.wait_fraction == pytest.approx(SOURCE_S / (SOURCE_S + STEP_S))
    assert (stats.batches, stats.samples, stats.finished) == (12, 12, True)
    assert stats.wait_per_batch == pytest.approx((SOURCE_S,) * 12)
    assert stats.step_per_batch == pytest.approx((STEP_S,) * 12)
    assert stats.wait_s == pytest.approx(sum(stats.wait_per_batch))
    assert stats.elapsed_s == pytest.approx(stats.wait_s + stats.step_s)
    assert stats.copy_s is None  # nothing is copied ahead on the CPU
    expected = (
        f"The loop waited for data {stats.wait_fraction:.0%} of this epoch "
        f"({stats.wait_s * 1e3:.1f} ms of {stats.elapsed_s * 1e3:.1f} ms): it is input-bound. "
        "The DataLoader loads every batch in the training process (num_workers=0) on a "
        "16-core machine; try num_workers=8."
    )
    assert stats.verdict == expected


def test_a_compute_bound_loop_is_told_so(clock: FakeClock) -> None:
    batches = [{"x": torch.randn(4, 3), "y": torch.arange(4)} for _ in range(10)]

    def source() -> Iterator[dict[str, torch.Tensor]]:
        for batch in batches:
            clock.sleep(0.001)  # 1 ms to read a batch, against 20 ms steps
            yield batch

    loader = dk.DeviceDataLoader(source, "cpu")
    _run(loader, 0.020, sleep=clock.sleep)
    stats = loader.stats
    assert stats.wait_fraction == pytest.approx(1 / 21)
    assert (stats.batches, stats.samples) == (10, 40)  # from each batch's first tensor
    assert (stats.wait_s, stats.step_s) == pytest.approx((0.010, 0.200))
    assert stats.verdict == (
        "The loop waited for data 5% of this epoch (10.0 ms of 210.0 ms): it is "
        "compute-bound, so faster input would not make it faster."
    )


def test_a_source_with_no_dataloader_gets_a_verdict_without_worker_advice(
    clock: FakeClock,
) -> None:
    def slow_batches() -> Iterator[torch.Tensor]:
        for index in range(6):
            clock.sleep(SOURCE_S)
            yield torch.full((2,), float(index))

    loader = dk.DeviceDataLoader(slow_batches, "cpu")
    _run(loader, STEP_S, sleep=clock.sleep)
    assert "it is input-bound. devicekit cannot see how the wrapped function makes its " in (
        loader.stats.verdict
    )
    assert "num_workers=" in loader.stats.verdict  # the way out: a DataLoader with workers
    assert not re.search(r"try num_workers=\d", loader.stats.verdict)


def test_before_any_epoch_no_batch_is_reported_and_the_verdict_says_so() -> None:
    stats = dk.DeviceDataLoader([torch.zeros(1)], "cpu").stats
    assert (stats.batches, stats.samples, stats.finished) == (0, 0, False)
    assert (stats.wait_s, stats.step_s, stats.elapsed_s, stats.wait_fraction) == (0, 0, 0, 0)
    assert (stats.wait_per_batch, stats.step_per_batch) == ((), ())
    assert (stats.copy_s, stats.copy_per_batch) == (None, None)
    assert stats.verdict == "No batch has been handed over yet: nothing to judge."


def test_an_epoch_left_early_reports_what_it_measured() -> None:
    loader = dk.DeviceDataLoader([torch.zeros(2)] * 10, "cpu")
    _run(loader, 0.002, stop_after=3)  # three batches used, the fourth fetched
    stats = loader.stats
    assert (stats.batches, stats.finished, stats.samples) == (4, False, 8)
    assert len(stats.step_per_batch) == 3  # the fourth's step never ended
    assert stats.verdict.startswith("The loop waited for data ")
    assert " of this epoch so far " in stats.verdict


def test_the_running_epoch_is_read_as_it_runs() -> None:
    loader = dk.DeviceDataLoader([torch.zeros(1)] * 5, "cpu")
    seen = [(loader.stats.batches, loader.stats.finished) for _batch in loader]
    assert seen == [(1, False), (2, False), (3, False), (4, False), (5, False)]
    assert loader.stats.finished
    # A new epoch takes the stats over with its first batch: a peek (next(iter(loader)))
    # inside a loop has them for that batch only, then the loop's epoch again.
    epoch = iter(loader)
    assert (loader.stats.batches, loader.stats.finished) == (5, True)
    next(epoch)
    assert loader.stats.batches == 1
    seen = []
    for _batch in loader:
        next(iter(loader))  # a peek
        seen.append(loader.stats.batches)
    assert seen == [1, 1, 1, 1, 1]  # the peek's, one batch
    assert (loader.stats.batches, loader.stats.finished) == (5, True)  # the loop's epoch


class Timed:
    """A stand-in for the side stream: copies in line, each copy "taking" COPY_S."""

    def __init__(self, device: torch.device, non_blocking: object) -> None:
        self.device = device
        self.read_with_wait: list[bool] = []

    def pin(self, batch: Any) -> Any:
        return batch

    def start(self, batch: Any) -> Any:
        return dk.to_device(batch, self.device)

    def hand_over(self, ticket: Any) -> Any:
        return ticket

    def consumer_done(self) -> None:
        pass

    def timer(self, ticket: Any) -> Callable[[bool], float | None]:
        done = iter([None, COPY_S])  # unknown when first asked: read later, never waited for

        def seconds(wait: bool) -> float | None:
            self.read_with_wait.append(wait)
            return COPY_S if wait else next(done, COPY_S)

        return seconds


def test_copy_times_come_from_the_seam_without_waiting_during_the_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[Timed] = []

    def make(device: torch.device, non_blocking: object) -> Timed:
        made.append(Timed(device, non_blocking))
        return made[-1]

    monkeypatch.setitem(_loader.PREFETCHERS, "meta", make)
    loader = dk.DeviceDataLoader([torch.zeros(2)] * 6, META, prefetch=2, pin_memory=False)
    reads = [len(made[0].read_with_wait) for _batch in loader]
    stats = loader.stats
    assert stats.copy_per_batch == (COPY_S,) * 6
    assert stats.copy_s == pytest.approx(6 * COPY_S)
    assert stats.copy_bytes == 6 * 8  # two float32 each: the bandwidth is theirs over that time
    assert stats.copy_gbps == pytest.approx(6 * 8 / (6 * COPY_S) / 1e9)
    # During the epoch no timer was waited for; at its end, the last one was.
    waits = made[0].read_with_wait
    assert True not in waits[: reads[-1]]
    assert waits[-1] is True


def test_the_profiler_sees_the_waits_and_copies_and_nothing_is_recorded_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loader = dk.DeviceDataLoader([torch.zeros(2)] * 3, "cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _run(loader, 0.0)
    names = [event.name for event in profile.events()]
    assert names.count("devicekit.wait") == 4  # three batches and the end
    assert names.count("devicekit.copy") == 3
    assert loader.stats.finished

    opened: list[str] = []
    real = torch.profiler.record_function

    def counting(name: str, *args: Any) -> Any:
        opened.append(name)
        return real(name, *args)

    monkeypatch.setattr(torch.profiler, "record_function", counting)
    _run(loader, 0.0)
    assert opened == []


def test_the_feed_thread_pins_inside_a_named_range(monkeypatch: pytest.MonkeyPatch) -> None:
    config = pytest.importorskip("torch._C._profiler")._ExperimentalConfig
    try:
        all_threads = config(profile_all_threads=True)
    except TypeError:
        pytest.skip("this PyTorch's profiler cannot record other threads")
    monkeypatch.setitem(_loader.PREFETCHERS, "meta", Timed)
    loader = dk.DeviceDataLoader([torch.zeros(2)] * 4, META, pin_memory=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=all_threads
    ) as profile:
        _run(loader, 0.0)
    names = [event.name for event in profile.events()]
    assert names.count("devicekit.pin") == 4  # the first in this thread, as it is read
    assert names.count("devicekit.copy") == 4


@pytest.mark.usefixtures("sixteen_cores")
def test_what_the_verdict_knows_is_read_from_the_dataloader() -> None:
    inner = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2)
    loader = dk.DeviceDataLoader(inner, "cpu")
    counting = Counting(per_batch=2, epoch=8, rule="the DataLoader's batch_size (2)")
    setup = Setup("DataLoader", 0, False, False, False, 16, counting, torch.device("cpu"))
    assert loader._setup(ahead=False) == setup


GPU = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("link", "said"),
    [
        (None, " The copy ran at 11.2 GB/s."),
        (
            LinkPeak(5, 16, 63.0),
            " The copy ran at 11.2 GB/s of the link's 63 GB/s (PCIe gen5 x16).",
        ),
    ],
    ids=["link-unknown", "pcie-gen5-x16"],
)
def test_a_copy_bound_verdict_names_the_copy_s_bandwidth_against_the_link(
    link: LinkPeak | None, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[torch.device] = []

    def read(device: torch.device) -> LinkPeak | None:
        asked.append(device)
        return link

    monkeypatch.setattr(_stats, "link_peak", read)
    stats = dataclasses.replace(SLOW_COPIES, copy_gbps=11.2)
    told = verdict(stats, Setup("DataLoader", 8, False, True, True, 16, device=GPU))
    assert told.endswith("normalised on the device with transform=." + said)
    assert asked == [GPU]
    # Unknown bandwidth says nothing of it; a loop that is not copy-bound asks no link.
    assert verdict(SLOW_COPIES, Setup("DataLoader", 8, False, True, True, 16)).endswith(
        "transform=."
    )
    asked.clear()
    verdict(
        dataclasses.replace(INPUT_BOUND, copy_gbps=11.2),
        Setup("list", None, False, True, True, 16, device=GPU),
    )
    assert asked == []


def test_a_copy_bound_epoch_with_unpinned_batches_says_why_they_were_not_pinned() -> None:
    stats = dataclasses.replace(SLOW_COPIES, unpinned=3, pinned_limit=2 << 30)
    setup = Setup("DataLoader", 8, False, True, True, 16)
    assert verdict(stats, setup) == HEAD + (
        "Copying a batch to the device takes 200.0 ms, longer than a step (100.0 ms), and 3 "
        "of this epoch's batches were not pinned: they were larger than the 2.0 GiB the "
        "loader may pin: raise pin_memory_limit=."
    )
    failed = dataclasses.replace(stats, unpinned_why="page-locking 1.0 GiB failed (...)")
    assert verdict(failed, setup).endswith("were not pinned: page-locking 1.0 GiB failed (...).")


# Each piece of advice, from the figures that call for it.

INPUT_BOUND = LoaderStats(
    batches=4,
    wait_s=0.6,
    step_s=0.4,
    elapsed_s=1.0,
    wait_fraction=0.6,
    wait_per_batch=(0.15,) * 4,
    step_per_batch=(0.1,) * 4,
    finished=True,
)
SLOW_FIRST = dataclasses.replace(INPUT_BOUND, wait_per_batch=(0.5, 0.05, 0.03, 0.02))
SLOW_COPIES = dataclasses.replace(INPUT_BOUND, copy_per_batch=(0.2,) * 4)
HEAD = "The loop waited for data 60% of this epoch (600.0 ms of 1.0 s): it is input-bound. "


@pytest.mark.parametrize(
    ("stats", "setup", "advice"),
    [
        pytest.param(
            INPUT_BOUND,
            Setup("DataLoader", 2, False, True, False, 16),
            "The DataLoader has 2 workers on a 16-core machine; try num_workers=8.",
            id="few-workers",
        ),
        pytest.param(
            INPUT_BOUND,
            Setup("DataLoader", 16, True, True, False, 16),
            "The DataLoader's 16 workers already have the machine's 16 cores: make each "
            "sample cheaper to load (decoded once and cached, lighter transforms, or "
            "augmentation on the device with transform=).",
            id="every-core",
        ),
        pytest.param(
            INPUT_BOUND,
            Setup("list", None, False, False, False, 16),
            "devicekit cannot see how the wrapped list makes its batches: make that "
            "cheaper, or load them with a DataLoader and worker processes (num_workers=).",
            id="no-dataloader",
        ),
        pytest.param(
            SLOW_FIRST,
            Setup("DataLoader", 4, False, True, False, 16),
            "Most of it was the first batch, while the DataLoader's 4 workers started: "
            "persistent_workers=True keeps them from one epoch to the next.",
            id="workers-starting",
        ),
        pytest.param(
            SLOW_FIRST,
            Setup("DataLoader", 4, True, True, False, 16),
            "Most of it was the first batch; the later ones kept up with the loop.",
            id="first-batch",
        ),
        pytest.param(
            SLOW_COPIES,
            Setup("DataLoader", 8, False, False, True, 16),
            "Copying a batch to the device takes 200.0 ms, longer than a step (100.0 ms), "
            "from memory that is not pinned: pin_memory=True makes the copy faster.",
            id="copy-unpinned",
        ),
        pytest.param(
            SLOW_COPIES,
            Setup("DataLoader", 8, False, True, True, 16),
            "Copying a batch to the device takes 200.0 ms, longer than a step (100.0 ms): "
            "send fewer bytes, for example uint8 images normalised on the device with "
            "transform=.",
            id="copy-pinned",
        ),
        # One worker is said in the singular.
        pytest.param(
            INPUT_BOUND,
            Setup("DataLoader", 1, False, True, False, 16),
            "The DataLoader has 1 worker on a 16-core machine; try num_workers=8.",
            id="one-worker",
        ),
        pytest.param(
            SLOW_FIRST,
            Setup("DataLoader", 1, False, True, False, 16),
            "Most of it was the first batch, while the DataLoader's 1 worker started: "
            "persistent_workers=True keeps it from one epoch to the next.",
            id="one-worker-starting",
        ),
        pytest.param(
            INPUT_BOUND,
            Setup("DataLoader", 1, True, True, False, 1),
            "The DataLoader's 1 worker already has the machine's 1 core: make each sample "
            "cheaper to load (decoded once and cached, lighter transforms, or augmentation "
            "on the device with transform=).",
            id="one-worker-every-core",
        ),
    ],
)
def test_each_advice_follows_from_the_figures(
    stats: LoaderStats, setup: Setup, advice: str
) -> None:
    assert verdict(stats, setup) == HEAD + advice


# Reading that draws random numbers is done in the training thread: said, never silent.

DRAWING = dataclasses.replace(INPUT_BOUND, reads_draw=True)
READ_HERE = (
    "so every batch was read in the training thread when the loop asked for it, as a plain "
    "loop reads it, and none ahead (reading ahead would draw beside the loop's steps, and a "
    "seeded run would not repeat). Draw them "
)


@pytest.mark.parametrize(
    ("setup", "advice"),
    [
        pytest.param(
            Setup("DataLoader", 0, False, True, True, 16),
            "Reading each batch from the wrapped DataLoader draws random numbers in the "
            "training process (augmentation, say), "
            + READ_HERE
            + "in DataLoader workers (try num_workers=8) or from a seeded torch.Generator of "
            "the dataset's own, and the batches are read ahead.",
            id="no-workers",
        ),
        pytest.param(
            Setup("DataLoader", 4, False, True, True, 16),  # a sampler that draws a batch
            "Reading each batch from the wrapped DataLoader draws random numbers in the "
            "training process (augmentation, say), "
            + READ_HERE
            + "from a seeded torch.Generator of the source's own, and the batches are read "
            "ahead.",
            id="workers",
        ),
        pytest.param(
            Setup("function", None, False, True, True, 16),
            "Reading each batch from the wrapped function draws random numbers in the "
            "training process (augmentation, say), "
            + READ_HERE
            + "from a seeded torch.Generator of the source's own, and the batches are read "
            "ahead.",
            id="function",
        ),
    ],
)
def test_an_epoch_read_in_the_training_thread_because_reads_draw_is_told_so(
    setup: Setup, advice: str
) -> None:
    assert verdict(DRAWING, setup) == HEAD + advice
    # What the figures show first still comes first; a compute-bound loop needs nothing.
    slow_copies = dataclasses.replace(SLOW_COPIES, reads_draw=True)
    assert verdict(slow_copies, setup).startswith(HEAD + "Copying a batch to the device takes")
    compute_bound = dataclasses.replace(DRAWING, wait_s=0.05, step_s=0.95, wait_fraction=0.05)
    assert verdict(compute_bound, setup).endswith(
        "it is compute-bound, so faster input would not make it faster."
    )


class Augmenting(Sleepy):
    """A dataset whose samples draw from Python's generator as they load."""

    def __getitem__(self, index: int) -> torch.Tensor:
        return super().__getitem__(index) + random.random()


@pytest.mark.usefixtures("sixteen_cores", "watchdog")
@pytest.mark.parametrize("augmented", [True, False], ids=["draws", "no-draws"])
def test_whether_batches_were_read_ahead_is_in_the_stats_and_the_verdict(
    augmented: bool, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    monkeypatch.setitem(_loader.PREFETCHERS, "meta", Timed)
    dataset = (Augmenting if augmented else Sleepy)(6, SOURCE_S, clock.sleep)
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=1), META)
    _run(loader, STEP_S, sleep=clock.sleep)
    stats = loader.stats
    assert (stats.read_ahead, stats.reads_draw) == (not augmented, augmented)
    assert (READ_HERE in stats.verdict) == augmented, stats.verdict
    if augmented:
        assert stats.verdict.endswith(
            "Draw them in DataLoader workers (try num_workers=8) or from a seeded "
            "torch.Generator of the dataset's own, and the batches are read ahead."
        )
    in_line = dk.DeviceDataLoader(DataLoader(dataset, batch_size=1), "cpu")
    _run(in_line, 0.0)
    assert (in_line.stats.read_ahead, in_line.stats.reads_draw) == (False, None)


def test_copies_shorter_than_a_step_are_not_blamed() -> None:
    stats = dataclasses.replace(INPUT_BOUND, copy_per_batch=(0.01,) * 4)
    told = verdict(stats, Setup("DataLoader", 0, False, True, True, 16))
    assert "Copying" not in told
    assert told.endswith("try num_workers=8.")


@pytest.mark.parametrize(
    ("fraction", "judged"),
    [
        (0.094, "9% of this epoch (94.0 ms of 1.0 s): it is compute-bound"),
        (0.096, "10% of this epoch (96.0 ms of 1.0 s): faster input could save up to 10% of it."),
        (0.496, "50% of this epoch (496.0 ms of 1.0 s): it is input-bound."),
    ],
)
def test_the_share_is_judged_as_it_is_written(fraction: float, judged: str) -> None:
    stats = LoaderStats(
        batches=10,
        wait_s=fraction,
        step_s=1 - fraction,
        elapsed_s=1.0,
        wait_fraction=fraction,
        wait_per_batch=(fraction / 10,) * 10,
        finished=True,
    )
    assert judged in verdict(stats, Setup("list", None, False, False, False, 2))


def test_copies_that_cannot_be_timed_are_unknown_not_free(monkeypatch: pytest.MonkeyPatch) -> None:
    class Untimed(Timed):
        def timer(self, ticket: Any) -> Callable[[bool], float | None]:
            return lambda wait: None  # a seam without events

    monkeypatch.setitem(_loader.PREFETCHERS, "meta", Untimed)
    loader = dk.DeviceDataLoader([torch.zeros(2)] * 3, META, pin_memory=False)
    for _batch in loader:
        pass
    assert (loader.stats.copy_s, loader.stats.copy_per_batch) == (None, None)
    assert loader.stats.batches == 3


def test_samples_are_counted_as_the_type_table_sees_a_batch() -> None:
    # With a rule for list, a list is a leaf: it has no first tensor to count, whatever
    # it holds, as find_devices and to_device see it.
    @dk.register_transfer(list)
    def move_list(batch: list[Any], device: torch.device, **options: Any) -> list[Any]:
        return batch

    try:
        loader = dk.DeviceDataLoader([[torch.zeros(4)]] * 2, "cpu")
        for _batch in loader:
            pass
    finally:
        dk.unregister_transfer(list)
    assert (loader.stats.batches, loader.stats.samples) == (2, None)
    again = dk.DeviceDataLoader([[torch.zeros(4)]] * 2, "cpu")
    for _batch in again:
        pass
    assert again.stats.samples == 8


# Samples, as a person counts them.


def _samples(source: Any) -> int | None:
    loader = dk.DeviceDataLoader(source, "cpu")
    for _batch in loader:
        pass
    return loader.stats.samples


IMAGE = torch.zeros(3, 5, 5)


@pytest.mark.parametrize(
    ("source", "samples"),
    [
        ([[IMAGE] * 8 for _ in range(8)], 64),  # lists of per-sample images
        ([[IMAGE, torch.zeros(3, 7, 6)] * 4 for _ in range(8)], 64),  # of varied sizes
        (DataLoader([IMAGE] * 64, batch_size=8, collate_fn=list), 64),
        ([{"step": torch.tensor([5]), "x": torch.zeros(8, 2), "y": torch.zeros(8)}] * 3, 24),
        ([{"ids": ["a"] * 8, "x": torch.zeros(8, 2)}] * 3, 24),
        ([(torch.zeros(4, 3), torch.zeros(4, 3))] * 5, 20),  # a pair of one shape
        (DataLoader(TensorDataset(torch.zeros(10, 3)), batch_size=4), 10),  # 4, 4, 2
        (DataLoader(TensorDataset(torch.zeros(10, 3)), batch_size=4, drop_last=True), 8),
        ([[torch.zeros(4)]] * 2, 8),
        ([{"text": ["a", "b"]}] * 2, None),  # no tensor: nothing to count
    ],
    ids=[
        "image-lists",
        "ragged-images",
        "list-collate",
        "bookkeeping-first",
        "strings-first",
        "same-shape-pair",
        "last-batch-short",
        "drop-last",
        "one-tensor",
        "no-tensor",
    ],
)
def test_samples_are_counted_as_a_person_counts_them(source: Any, samples: int | None) -> None:
    assert _samples(source) == samples


def test_a_packed_sequence_batch_counts_its_sequences() -> None:
    packed = torch.nn.utils.rnn.pack_sequence(
        [torch.zeros(3, 2), torch.zeros(2, 2), torch.zeros(4, 2)], enforce_sorted=False
    )
    assert _samples([packed] * 2) == 6


def test_per_batch_figures_are_bounded_and_the_sums_cover_every_batch() -> None:
    count = 2 * PER_BATCH_KEPT + 500
    loader = dk.DeviceDataLoader(range(count), "cpu")  # ints: nothing to count, or move
    for _batch in loader:
        pass
    stats = loader.stats
    assert stats.batches == count
    assert len(stats.wait_per_batch) == len(stats.step_per_batch) == PER_BATCH_KEPT
    assert stats.wait_s >= sum(stats.wait_per_batch)
    assert stats.elapsed_s == pytest.approx(stats.wait_s + stats.step_s)
    assert len(repr(stats)) < 800  # no per-batch floats in it (20,000 of them, each ~20)
    assert "wait_per_batch" not in repr(stats)


def test_counting_samples_never_adds_a_key_to_a_defaultdict_batch() -> None:
    # Found by Hypothesis: batch[key] on a defaultdict adds the key (its __missing__).
    empty = collections.defaultdict(list)
    loader = dk.DeviceDataLoader([{"x": torch.ones(4)}, empty], "meta")
    assert [dict(batch) for batch in loader][1] == {}
    assert empty == {}
    rows = [collections.defaultdict(list, {"x": torch.ones(n)}) for n in (4, 3)]
    counted = dk.DeviceDataLoader(rows, "meta")
    assert [list(batch) for batch in counted] == [["x"], ["x"]]
    assert counted.stats.samples == 7  # still counted, each batch looked at anew


# Counting walks a batch as to_device does: iteratively, refused at the same depth.


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@contextlib.contextmanager
def _low_recursion_limit(frames: int = 60) -> Iterator[None]:
    """Python's recursion limit ``frames`` above the current stack: any recursion fails."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(len(traceback.extract_stack()) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def test_samples_are_counted_in_batches_3000_deep_under_a_low_recursion_limit() -> None:
    deep = {"x": _nested(3_000, torch.zeros(5, 2)), "y": _nested(3_000, torch.zeros(5))}
    loader = dk.DeviceDataLoader([deep] * 2, "cpu")
    with _low_recursion_limit():
        for _batch in loader:
            pass
        counted = samples_in(deep)
    assert counted[0] == 5
    assert loader.stats.samples == 10


def test_samples_are_counted_as_deep_as_to_device_walks_and_no_deeper() -> None:
    deepest = _nested(MAX_DEPTH, torch.zeros(5, 2))
    dk.to_device(deepest, META)  # accepted
    assert samples_in(deepest)[0] == 5
    too_deep = [deepest]
    with pytest.raises(dk.TransferError, match="containers deep"):
        dk.to_device(too_deep, META)
    assert samples_in(too_deep)[0] is None  # refused alike: a count it cannot tell


def test_a_transform_returning_a_cycle_leaves_samples_unknown_not_the_loop_broken() -> None:
    def cyclic(batch: list[torch.Tensor]) -> list[Any]:
        looped: list[Any] = [batch[0]]
        looped.append(looped)
        return looped

    loader = dk.DeviceDataLoader([[torch.zeros(4)]] * 3, "cpu", transform=cyclic)
    assert len(list(loader)) == 3
    assert (loader.stats.batches, loader.stats.samples) == (3, None)


# Issue 35: what a batch's samples are, when the default rule cannot tell, is the user's.

SEQUENCE_FIRST = [(torch.zeros(35, 20), torch.zeros(700))] * 10  # (time, batch), flat targets


def _counted(source: Any, samples: Any) -> LoaderStats:
    loader = dk.DeviceDataLoader(source, "cpu", samples=samples)
    for _batch in loader:
        pass
    return loader.stats


def test_a_sequence_first_batch_counts_its_sequences_when_told_so() -> None:
    # PyTorch's word-language-model batches: data (35, 20), 700 targets. The default
    # rule counts 700 a batch (the targets' first dimension) and says it used it.
    default = _counted(SEQUENCE_FIRST, None)
    assert (default.samples, default.samples_rule) == (
        7_000,
        "dimension 0 of the batch's tensors (the default rule)",
    )
    told = _counted(SEQUENCE_FIRST, "dim=1")
    assert (told.samples, told.samples_rule) == (
        200,
        "dimension 1 of the batch's tensors (samples='dim=1')",
    )


def test_samples_as_a_count_per_batch_or_a_function_of_the_batch() -> None:
    by_count = _counted(SEQUENCE_FIRST, 20)
    assert (by_count.samples, by_count.samples_rule) == (200, "20 samples a batch (samples=20)")

    def sequences(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return batch[0].shape[1]

    by_function = _counted(SEQUENCE_FIRST, sequences)
    assert by_function.samples == 200
    assert by_function.samples_rule == (
        "test_samples_as_a_count_per_batch_or_a_function_of_the_batch.<locals>.sequences(batch) "
        "(samples=test_samples_as_a_count_per_batch_or_a_function_of_the_batch.<locals>"
        ".sequences)"
    )
    # What the user says wins over a DataLoader's batch_size too.
    inner = DataLoader(TensorDataset(torch.zeros(10, 3)), batch_size=4)
    assert (_counted(inner, None).samples, _counted(inner, 1).samples) == (10, 3)
    assert _counted(inner, None).samples_rule == "the DataLoader's batch_size (4)"
    # Before any epoch, the stats say already how they will count.
    assert dk.DeviceDataLoader(inner, "cpu", samples="dim=1").stats.samples_rule == (
        "dimension 1 of the batch's tensors (samples='dim=1')"
    )


def test_images_beside_one_element_values_count_the_images() -> None:
    # Two (1,)-shaped values (a step, a temperature) used to outvote the images: 4, not 256.
    images = [(torch.zeros(64, 3, 4, 4), torch.zeros(1), torch.zeros(1))] * 4
    assert _counted(images, None).samples == 256
    # A batch of one sample still counts one, its label a one-element tensor too.
    assert _counted([(torch.zeros(1, 3, 4, 4), torch.zeros(1))] * 4, None).samples == 4


@pytest.mark.parametrize(
    ("returned", "error", "message"),
    [
        (2.5, TypeError, " to be a whole number of 0 or more, got 2.5."),
        (
            torch.tensor(3),
            TypeError,
            (
                " to be a whole number of 0 or more, got tensor(3) (.item() makes a Python int "
                "of a one-element tensor)."
            ),
        ),
        (True, TypeError, " to be a whole number of 0 or more, got True."),
        (-1, ValueError, " to be a whole number of 0 or more, got -1."),
    ],
    ids=["float", "tensor", "bool", "negative"],
)
def test_a_samples_function_that_returns_no_count_is_named_with_its_batch(
    returned: Any, error: type[Exception], message: str
) -> None:
    def tokens(batch: torch.Tensor) -> Any:
        return returned if batch.item() == 2 else 4

    loader = dk.DeviceDataLoader([torch.tensor(float(i)) for i in range(4)], "cpu", samples=tokens)
    where = (
        "Expected what samples=test_a_samples_function_that_returns_no_count_is_named_with_its"
        "_batch.<locals>.tokens returned for batch 2 of this epoch (numbered from 0, as "
        "enumerate() numbers them)"
    )
    seen: list[float] = []
    with pytest.raises(error, match=re.escape(where + message)):
        seen.extend(batch.item() for batch in loader)
    assert seen == [0.0, 1.0]
    # numpy's integers, and any other Integral, count as ints.
    np = pytest.importorskip("numpy")
    assert _counted([torch.zeros(2)] * 3, lambda batch: np.int64(2)).samples == 6


@pytest.mark.parametrize(
    ("samples", "error", "message"),
    [
        (0, ValueError, "Expected samples to be a whole number of 1 or more, got 0."),
        (
            "dim1",
            ValueError,
            (
                "Expected samples as a string to name the dimension of the batch's tensors that "
                "indexes their samples, 'dim=N' with N a whole number, such as 'dim=1' or "
                "'dim=-1' (the last dimension), got 'dim1'."
            ),
        ),
        (
            "dim=1.5",
            ValueError,
            (
                "'dim=N' with N a whole number, such as 'dim=1' or 'dim=-1' (the last "
                "dimension), got 'dim=1.5'."
            ),
        ),
        (
            "dim=-",
            ValueError,
            (
                "'dim=N' with N a whole number, such as 'dim=1' or 'dim=-1' (the last "
                "dimension), got 'dim=-'."
            ),
        ),
        (
            2.5,
            TypeError,
            (
                "Expected samples to be a number of samples per batch (an int), a dimension such "
                "as 'dim=1', or a function of the batch returning its count, got float 2.5."
            ),
        ),
        (
            True,
            TypeError,
            (
                "Expected samples to be a number of samples per batch (an int), a dimension such "
                "as 'dim=1', or a function of the batch returning its count, got bool True."
            ),
        ),
    ],
    ids=["zero", "no-equals", "fraction", "no-number", "float", "bool"],
)
def test_samples_that_say_no_count_are_refused_when_the_loader_is_made(
    samples: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        dk.DeviceDataLoader([torch.zeros(2)], "cpu", samples=samples)


# Issue 46: numpy's integers are counts, and a dimension counts from the end as PyTorch's.


def test_samples_as_a_numpy_integer_is_a_count_per_batch() -> None:
    np = pytest.importorskip("numpy")
    counted = _counted(SEQUENCE_FIRST, np.int64(20))
    assert (counted.samples, counted.samples_rule) == (200, "20 samples a batch (samples=20)")
    assert _counted([torch.zeros(2)] * 3, np.uint8(4)).samples == 12
    # Still whole numbers of 1 or more, and numpy's bools and floats are no counts.
    zero = "Expected samples to be a whole number of 1 or more, got 0."
    with pytest.raises(ValueError, match=re.escape(zero)):
        dk.DeviceDataLoader([torch.zeros(2)], "cpu", samples=np.int64(0))
    for refused, shown in ((np.bool_(True), "bool"), (np.float64(4.0), "float64")):
        with pytest.raises(TypeError, match=re.escape(f"got {shown} ")):
            dk.DeviceDataLoader([torch.zeros(2)], "cpu", samples=refused)


def test_a_negative_dimension_counts_from_each_tensors_last() -> None:
    # Batch-last tensors of different ranks: (time, batch) data, (classes, batch) targets.
    batches = [(torch.zeros(35, 20), torch.zeros(3, 7, 20), torch.tensor(2.0))] * 10
    last = _counted(batches, "dim=-1")
    assert (last.samples, last.samples_rule) == (
        200,
        "dimension -1 of the batch's tensors (samples='dim=-1')",
    )
    # -2 reads what each tensor of two or more dimensions has second from the end.
    assert _counted([{"x": torch.zeros(35, 20), "n": torch.zeros(5)}] * 2, "dim=-2").samples == 70
    # Where no tensor has the dimension, nothing tells: None, as with "dim=3".
    assert _counted([torch.tensor(1.0)] * 2, "dim=-1").samples is None
    assert samples_in(torch.zeros(4, 6), -1)[0] == 6


def test_the_guides_point_to_the_one_statement_of_the_default_rule() -> None:
    # The rule is stated once, in LoaderStats.samples; the guides link to it.
    docs = Path(__file__).parent.parent / "docs" / "guide"
    for page in ("loader.rst", "waiting-for-data.rst"):
        text = " ".join((docs / page).read_text(encoding="utf-8").split())
        assert ":attr:`LoaderStats.samples <devicekit.LoaderStats.samples>`" in text, page
        assert "first dimension" not in text, page  # no second wording of the rule
    loader_doc = " ".join((dk.DeviceDataLoader.__doc__ or "").split())
    assert ":attr:`LoaderStats.samples <devicekit.LoaderStats.samples>` states." in loader_doc


# Issue 35: workers only where a batch costs more to read than a worker's hand-over.

CHEAP_READS = LoaderStats(
    batches=100,
    wait_s=100 * 44e-6,
    step_s=100 * 11e-6,
    elapsed_s=100 * 55e-6,
    wait_fraction=0.8,
    wait_per_batch=(44e-6,) * 100,
    step_per_batch=(11e-6,) * 100,
    finished=True,
)
CHEAP_HEAD = "The loop waited for data 80% of this epoch (4.4 ms of 5.5 ms): it is input-bound. "


@pytest.mark.parametrize(
    ("setup", "advice"),
    [
        pytest.param(
            Setup("generator", None, False, False, False, 16),
            "The loop waited 44 us a batch, less than a DataLoader worker takes to hand one "
            "over (about 450 us), so worker processes would cost more than they save: make "
            "reading a batch cheaper, or read fewer, larger batches.",
            id="generator",
        ),
        pytest.param(
            Setup("DataLoader", 0, False, False, False, 16),
            "The loop waited 44 us a batch, less than a DataLoader worker takes to hand one "
            "over (about 450 us), so worker processes would cost more than they save: make "
            "reading a batch cheaper, or read fewer, larger batches.",
            id="no-workers",
        ),
        pytest.param(
            Setup("DataLoader", 2, True, False, False, 16),
            "The loop waited 44 us a batch, no more than a DataLoader worker takes to hand "
            "one over (about 450 us), so more workers would not shorten it: read fewer, "
            "larger batches.",
            id="workers",
        ),
    ],
)
def test_batches_cheaper_to_read_than_a_worker_s_hand_over_get_no_worker_advice(
    setup: Setup, advice: str
) -> None:
    assert HANDOVER_S == 450e-6
    assert verdict(CHEAP_READS, setup) == CHEAP_HEAD + advice
    drawing = dataclasses.replace(CHEAP_READS, reads_draw=True)
    assert "num_workers" not in verdict(drawing, setup)
    # The first batch (workers starting) is left out of a read's cost: 44 us, not 54.
    slow_start = dataclasses.replace(
        CHEAP_READS, wait_per_batch=(1e-3, *(44e-6,) * 99), wait_s=1e-3 + 99 * 44e-6
    )
    assert "waited 44 us a batch" in verdict(slow_start, setup)


@pytest.mark.usefixtures("sixteen_cores")
def test_a_loop_over_cheap_batches_from_a_generator_is_not_told_to_add_workers() -> None:
    loader = dk.DeviceDataLoader(lambda: (torch.zeros(2) for _ in range(500)), "cpu")
    for _batch in loader:
        pass
    stats = loader.stats
    assert stats.batches == 500
    assert "num_workers" not in stats.verdict, stats.verdict


# Round seven: the figures say what happened.


LARGE = 1 << 14  # float32 elements: a tensor staged in the loader's pinned pool


@pytest.mark.usefixtures("watchdog")
def test_batches_read_in_the_training_thread_are_pinned_and_counted(
    stand_in_device: torch.device,
) -> None:
    read: list[torch.Tensor] = []

    def drawing() -> Iterator[torch.Tensor]:  # augmentation: every read draws
        for _ in range(5):
            read.append(torch.rand(LARGE))
            yield read[-1]

    loader = dk.DeviceDataLoader(drawing, stand_in_device)
    got = [batch.cpu() for batch in loader]
    assert all(torch.equal(a, b) for a, b in zip(got, read, strict=True))
    stats = loader.stats
    assert stats.reads_draw
    assert (stats.pinned_batches, stats.unpinned) == (5, 0)
    assert stats.copy_bytes == 5 * 4 * LARGE
    loader.close()


@pytest.mark.usefixtures("watchdog")
@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
def test_a_tensor_in_two_places_of_a_batch_is_copied_and_counted_once(
    pin: bool, stand_in_device: torch.device
) -> None:
    images = [torch.randn(LARGE) for _ in range(6)]
    # An autoencoder's batch: the input is its own target.
    loader = dk.DeviceDataLoader([(x, x) for x in images], stand_in_device, pin_memory=pin)
    for (x, target), image in zip(loader, images, strict=True):
        assert x is target  # one copy, in both places
        assert torch.equal(x.cpu(), image)
    assert loader.stats.copy_bytes == 6 * 4 * LARGE
    loader.close()


@pytest.mark.usefixtures("watchdog")
@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
def test_a_sparse_tensor_in_a_batch_is_copied_and_counted(
    pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copies on the host, and pageable slabs, stand in for an accelerator's: the stand-in
    # accelerator of devicekit.testing moves no sparse tensor yet.
    monkeypatch.setitem(_loader.PREFETCHERS, "meta", HostCopies)
    monkeypatch.setitem(_staging.ALLOCATORS, "meta", _staging.PAGEABLE)
    adjacency = torch.eye(4).to_sparse()  # 2 x 4 int64 indices, 4 float32 values: 80 bytes
    batches = [{"adjacency": adjacency, "features": torch.randn(LARGE)} for _ in range(4)]
    loader = dk.DeviceDataLoader(batches, META, pin_memory=pin)
    got = list(loader)
    assert all(torch.equal(batch["adjacency"].to_dense(), torch.eye(4)) for batch in got)
    assert loader.stats.copy_bytes == 4 * (80 + 4 * LARGE)
    loader.close()


def test_a_nested_tensor_counts_its_components_as_samples() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
        ragged = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(5, 3)])
        jagged = torch.nested.nested_tensor(
            [torch.zeros(2, 3), torch.zeros(5, 3)], layout=torch.jagged
        )
    for nested in (ragged, jagged):
        assert _samples([{"tokens": nested, "label": torch.zeros(2)}] * 3) == 6
        loader = dk.DeviceDataLoader([{"tokens": nested}] * 3, "cpu", samples="dim=1")
        for _batch in loader:
            pass
        assert loader.stats.samples is None  # a ragged dimension counts no samples
