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


def test_staged_batches_are_pinned_in_exact_slabs_outside_pytorch_s_allocator(
    cuda: torch.device,
) -> None:
    size = (129 << 20) + (1 << 19)  # 129.5 MiB: PyTorch's allocator would pin 256 MiB
    batch = torch.ones(size // 4)
    stager = Stager(StagingPool(None, 2, ALLOCATORS["cuda"]), threads=4)
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    staged = stager.stage([batch], threading.Event())
    assert staged.batch[0].is_pinned()
    assert torch.equal(staged.batch[0], batch)
    assert stager.pool.figures.peak_bytes == size  # exactly its bytes
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    prefetcher = StreamPrefetcher(cuda, "auto")
    ticket = prefetcher.start(staged.batch)
    staged.copy_issued(prefetcher.timer(ticket))
    moved = prefetcher.hand_over(ticket)[0]
    stager.close()
    stager.pool.wait_for_copies()
    assert moved.sum().item() == size // 4


def test_pinned_memory_stays_within_the_cap_over_varying_batches(cuda: torch.device) -> None:
    sizes = [(1 + (i * 7) % 5) << 20 for i in range(40)]  # 1-5 MiB, varying
    batches = [torch.full((size // 4,), float(i)) for i, size in enumerate(sizes)]
    loader = dk.DeviceDataLoader(batches, cuda, prefetch=2)
    wrong = torch.zeros((), device=cuda)
    for step, moved in enumerate(loader):
        torch.cuda._sleep(50_000)
        wrong += (moved != step).sum()
    assert wrong.item() == 0
    stats = loader.stats
    assert stats.pinned_batches == len(batches) - 1  # the first is read in this thread
    assert stats.pinned_bytes <= stats.pinned_limit == 3 * max(sizes)
    assert stats.pinned_reused > 0
    assert stats.unpinned == 0
    assert (stats.copy_gbps or 0.0) > 1  # GB/s: a copy from pinned memory
    loader.close()
    assert loader._stager is None
