"""DeviceDataLoader on a real GPU: pinning, stream hand-over, memory bounds, no syncs."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk
from devicekit._loader._pipeline import StreamPrefetcher
from devicekit._loader._staging import ALLOCATORS, Stager, StagingPool

pytestmark = pytest.mark.cuda


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_pinning_keeps_structure_and_aliases() -> None:
    shared = torch.ones(1 << 16)  # 256 KiB: large enough to be pinned, not packed
    small = torch.zeros(2)
    stager = Stager(StagingPool(None, 2, ALLOCATORS["cuda"]), threads=2)
    pinned = stager.stage({"a": shared, "b": [shared, small], "n": 3}, threading.Event()).batch
    assert pinned["a"].is_pinned()
    assert pinned["a"] is pinned["b"][0]
    assert pinned["b"][1] is small  # small tensors travel packed through pinned staging
    assert pinned["n"] == 3
    assert not shared.is_pinned()  # the input is not changed


@pytest.mark.parametrize("prefetch", [1, 2, 3, 4])
def test_each_batch_is_complete_when_handed_over_even_under_in_place_use(
    cuda: torch.device, prefetch: int
) -> None:
    batches = [torch.full((1 << 18,), float(i)) for i in range(300)]
    wrong = torch.zeros((), device=cuda)
    for step, batch in enumerate(dk.DeviceDataLoader(batches, cuda, prefetch=prefetch)):
        torch.cuda._sleep(20_000)  # a busy step: copies of later batches overlap it
        wrong += (batch != step).sum()
        batch.add_(1)  # the consumer mutates its batch in place
        wrong += (batch != step + 1).sum()
    assert wrong.item() == 0


@pytest.mark.parametrize("prefetch", [1, 2, 3, 4])
def test_device_memory_stays_within_the_prefetched_batches(
    cuda: torch.device, prefetch: int
) -> None:
    batch_bytes = 16 << 20
    batches = [torch.ones(batch_bytes // 4) for _ in range(40)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    for batch in dk.DeviceDataLoader(batches, cuda, prefetch=prefetch):
        batch.mul_(2)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    # prefetch in flight + the one handed over + the loop variable's previous batch.
    assert peak <= (prefetch + 2) * batch_bytes + (1 << 20)
    assert torch.cuda.memory_allocated() - baseline <= batch_bytes


def test_one_side_stream_for_the_loader_s_whole_life(cuda: torch.device) -> None:
    loader = dk.DeviceDataLoader([torch.ones(4)] * 3, cuda)
    streams, prefetchers = set(), set()
    for _ in range(3):
        for _batch in loader:
            pass
        prefetcher = loader._prefetcher
        assert isinstance(prefetcher, StreamPrefetcher)
        streams.add(prefetcher._stream)
        prefetchers.add(id(prefetcher))
    assert len(streams) == 1
    assert len(prefetchers) == 1
    assert streams.pop() != torch.cuda.current_stream(cuda)


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
def test_no_synchronisation_while_iterating_pinned_batches(cuda: torch.device) -> None:
    data = TensorDataset(torch.randn(256, 32), torch.arange(256))
    loader = dk.DeviceDataLoader(DataLoader(data, batch_size=32, pin_memory=True), cuda)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for features, labels in loader:
            features.mul_(2)
            labels.add_(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_dataset_error_surfaces_through_the_feed_thread(cuda: torch.device) -> None:
    def batches() -> object:
        yield from (torch.ones(2) for _ in range(5))
        msg = "bad record"
        raise ValueError(msg)

    seen = 0
    with pytest.raises(ValueError, match="bad record"):
        for _batch in dk.DeviceDataLoader(batches, cuda, prefetch=2):
            seen += 1
    assert seen == 5


def test_every_copy_is_timed_on_the_side_stream(cuda: torch.device) -> None:
    # 4 MiB a batch: a copy of tens of microseconds, timed by events on the side stream.
    data = TensorDataset(torch.randn(64, 1 << 14), torch.arange(64))
    loader = dk.DeviceDataLoader(DataLoader(data, batch_size=8), cuda)
    for images, _labels in loader:
        torch.cuda._sleep(100_000)  # a step the copies hide behind
        assert images.is_cuda
    stats = loader.stats
    assert stats.finished
    assert stats.copy_per_batch is not None
    assert len(stats.copy_per_batch) == stats.batches == 8
    assert all(seconds > 0 for seconds in stats.copy_per_batch)
    assert stats.copy_s == pytest.approx(sum(stats.copy_per_batch))
    assert stats.samples == 64
    # Reading the DataLoader draws nothing (it does not shuffle): read ahead from batch 2.
    assert (stats.read_ahead, stats.reads_draw) == (True, False)
