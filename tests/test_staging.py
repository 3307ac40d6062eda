"""The loader's pinned staging pool and pinning threads, on the CPU through their seams.

The page-locking allocator is replaced by ordinary memory (nothing can be pinned without
an accelerator), and a copy's end by a timer the test controls, so the pool's accounting
(exact sizes, reuse, the cap, release, the fallback) and its waits run here. A loader
that stages its batches runs on the stand-in accelerator of devicekit.testing, which
page-locks and copies (as late as a wait allows), the pool's slabs recorded on the way.
"""

from __future__ import annotations

import gc
import random
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._core._packing import PACK_MAX_BYTES
from devicekit._loader import _loader, _staging
from devicekit._loader._staging import ALIGN, PIECE_MIN_BYTES, Staged, Stager, StagingPool
from devicekit.testing import still_pinned

from .conftest import WATCHDOG_S
from .helpers import META

pytestmark = pytest.mark.usefixtures("watchdog")

LARGE = PACK_MAX_BYTES + 4  # a float32 tensor of this many bytes is staged


Allocate = Callable[[int], tuple[torch.Tensor, Callable[[], None]]]


def _ordinary(size: int) -> tuple[torch.Tensor, Callable[[], None]]:
    return torch.empty(size, dtype=torch.uint8), lambda: None


class Memory:
    """Stands in for page-locking: ordinary memory, every slab's life recorded.

    Or records the page-locking of ``pinning`` (a :class:`~devicekit._loader._staging.Pinning`'s
    ``allocate``, the stand-in accelerator's), which then does the page-locking.
    A slab collected before its release stands for memory freed while still registered
    with the driver (CUDA's next registration of those pages fails): counted in ``lost``.
    """

    def __init__(self, fail_from: int | None = None, pinning: Allocate = _ordinary) -> None:
        self.sizes: list[int] = []  # each slab asked for, in bytes
        self.live = 0  # bytes not yet given back
        self.most = 0
        self.fail_from = fail_from  # the slab (counted from 0) from which allocation fails
        self.pinning = pinning
        self.threads: set[str] = set()
        self.lost = 0  # slabs collected while still page-locked

    def __call__(self, size: int) -> tuple[torch.Tensor, Callable[[], None]]:
        self.threads.add(threading.current_thread().name)
        if self.fail_from is not None and len(self.sizes) >= self.fail_from:
            msg = "CUDA error: out of memory (cudaHostRegister)"
            raise RuntimeError(msg)
        self.sizes.append(size)
        self.live += size
        self.most = max(self.most, self.live)
        slab, unpin = self.pinning(size)
        released = threading.Event()

        def release() -> None:
            assert not released.is_set(), "a slab was given back twice"
            released.set()
            self.live -= size
            unpin()

        def collected() -> None:
            if not released.is_set():
                self.lost += 1

        weakref.finalize(slab, collected)
        return slab, release


class Copy:
    """A copy's timer: running until ``end()``; waiting for it ends it, and is counted."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def end(self) -> None:
        self.done = True

    def __call__(self, wait: bool) -> float | None:
        if wait:
            self.waited += 1
            self.done = True
        return 0.001 if self.done else None


def _floats(size: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((size // 4,), float(value))


def _stager(memory: Memory, *, limit: int | None = None, batches: int = 2) -> Stager:
    return Stager(StagingPool(limit, batches, memory), threads=1)


NEVER = threading.Event()  # a stop that is never set


def test_a_batch_is_staged_in_one_slab_of_its_size_rounded_to_an_eighth() -> None:
    memory = Memory()
    a, b = _floats(LARGE, 1.0), _floats(LARGE + 8, 2.0)
    small = torch.ones(3)
    staged = _stager(memory).stage({"a": a, "b": [b, a], "small": small, "n": 7}, NEVER)
    needed = -(-LARGE // ALIGN) * ALIGN + b.nbytes
    assert memory.sizes == [_staging.slab_size(needed)]
    assert needed <= memory.sizes[0] <= needed * 9 / 8  # not rounded to a power of two
    batch = staged.batch
    assert torch.equal(batch["a"], a)
    assert torch.equal(batch["b"][0], b)
    assert batch["b"][1] is batch["a"]  # aliases stay aliases
    assert batch["small"] is small  # travels packed: staging it would copy it twice
    assert batch["n"] == 7
    assert batch["a"].untyped_storage().data_ptr() == batch["b"][0].untyped_storage().data_ptr()
    assert staged.nbytes == a.nbytes + b.nbytes + small.nbytes  # what the copy moves, once each


def test_a_staged_tensor_keeps_the_strides_its_copy_would_keep() -> None:
    images = torch.randn(4, 3, 64, 64).to(memory_format=torch.channels_last)
    every_other = torch.randn(64, 2048)[:, ::2]  # not dense: staged contiguous, as .to() makes it
    staged = _stager(Memory()).stage([images, every_other], NEVER).batch
    assert staged[0].stride() == images.stride()
    assert staged[0].is_contiguous(memory_format=torch.channels_last)
    assert staged[1].is_contiguous()
    assert torch.equal(staged[0], images)
    assert torch.equal(staged[1], every_other)


def test_tensors_not_worth_staging_are_left_as_they_are() -> None:
    class Marked(torch.Tensor):
        pass

    marked = _floats(LARGE).as_subclass(Marked)
    on_meta = torch.empty(LARGE, device="meta")
    memory = Memory()
    staged = _stager(memory).stage([marked, on_meta, _floats(PACK_MAX_BYTES)], NEVER)
    assert staged.batch[0] is marked  # a subclass moves by its own rules
    assert staged.batch[1] is on_meta
    assert memory.sizes == []
    assert staged.lease is None


def test_a_pinned_tensor_is_not_staged_again(monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = _floats(LARGE)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: self is tensor)
    memory = Memory()
    assert _stager(memory).stage([tensor], NEVER).batch[0] is tensor
    assert memory.sizes == []


def test_equal_batches_reuse_one_slab_once_their_copies_end() -> None:
    memory = Memory()
    stager = _stager(memory)
    for step in range(5):
        staged = stager.stage([_floats(LARGE, step)], NEVER)
        copy = Copy()
        staged.copy_issued(copy)
        copy.end()
    slab = _staging.slab_size(LARGE)
    assert memory.sizes == [slab]
    assert stager.pool.figures == _staging.PoolFigures(
        staged=5, reused=4, unpinned=0, peak_bytes=slab, slabs=1
    )


def test_varying_batches_never_hold_more_than_the_default_cap() -> None:
    memory = Memory()
    stager = _stager(memory, batches=2)  # prefetch 1: two batches' worth
    sizes = [LARGE * k for k in (3, 1, 4, 2, 4, 1, 3, 5, 2, 5, 1)]
    in_flight: list[tuple[Staged, Copy]] = []
    for step, size in enumerate(sizes):
        staged = stager.stage([_floats(size, step)], NEVER)
        copy = Copy()
        staged.copy_issued(copy)
        in_flight.append((staged, copy))
        if len(in_flight) > 1:  # the copy before ends while this one runs, as on a GPU
            in_flight.pop(0)[1].end()
        largest = _staging.slab_size(max(sizes[: step + 1]))
        assert memory.live <= stager.pool.cap == 2 * largest
        assert torch.equal(staged.batch[0], _floats(size, step))
    assert memory.most <= 2 * _staging.slab_size(max(sizes))
    assert stager.pool.figures.unpinned == 0


def test_a_full_pool_waits_for_the_oldest_copy_then_reuses_its_slab() -> None:
    memory = Memory()
    stager = _stager(memory, limit=2 * LARGE)
    copies = []
    for _ in range(2):
        staged = stager.stage([_floats(LARGE)], NEVER)
        copies.append(Copy())
        staged.copy_issued(copies[-1])
    stager.stage([_floats(LARGE)], NEVER)
    assert [copy.waited for copy in copies] == [1, 0]  # only the oldest was waited for
    assert memory.sizes == [LARGE, LARGE]


def test_a_pool_full_of_batches_not_yet_copied_waits_until_one_is_dropped() -> None:
    memory = Memory()
    stager = _stager(memory, limit=LARGE)
    queued = stager.stage([_floats(LARGE)], NEVER)  # staged, its copy not yet issued
    got: list[Staged] = []
    waiting = threading.Thread(target=lambda: got.append(stager.stage([_floats(LARGE)], NEVER)))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()  # no slab free, and no copy to wait for
    del queued  # an epoch left early drops it: its slab goes back
    gc.collect()
    waiting.join()
    assert got[0].lease is not None
    assert memory.sizes == [LARGE]


def test_a_wait_for_a_slab_ends_when_the_feed_stops() -> None:
    stager = _stager(Memory(), limit=LARGE)
    stop = threading.Event()
    queued = stager.stage([_floats(LARGE)], stop)  # the feed's own batch, not yet copied
    got: list[Staged] = []
    waiting = threading.Thread(target=lambda: got.append(stager.stage([_floats(LARGE)], stop)))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()  # waits for its own epoch's batch to be copied
    stop.set()
    waiting.join()
    assert got[0].lease is None  # given up: the feed drops it unread
    assert queued.lease is not None


def test_batches_of_another_live_epoch_holding_every_slab_are_not_waited_for() -> None:
    # A peek's feed read ahead and holds the slabs until its loop comes back; that loop
    # may be the one now running this epoch, which waiting would hang.
    memory = Memory()
    stager = _stager(memory, limit=LARGE)
    peeked = stager.stage([_floats(LARGE)], threading.Event())
    for stop in (threading.Event(), None):  # this epoch's feed, then its training thread
        staged = stager.stage([_floats(LARGE, 1.0)], stop)
        assert staged.lease is None
        assert torch.equal(staged.batch[0], _floats(LARGE, 1.0))  # copied from pageable
    assert stager.pool.figures.unpinned == stager.pool.figures.crowded == 2
    assert peeked.lease is not None


def test_a_batch_larger_than_the_cap_is_copied_from_pageable_memory() -> None:
    memory = Memory()
    stager = _stager(memory, limit=LARGE)
    tensor = _floats(2 * LARGE)
    staged = stager.stage([tensor], NEVER)
    assert staged.batch[0] is tensor
    assert memory.sizes == []
    assert stager.pool.figures.unpinned == 1


def test_when_page_locking_fails_the_loader_says_so_once_and_copies_pageable() -> None:
    memory = Memory(fail_from=1)
    stager = _stager(memory)
    first = stager.stage([_floats(LARGE)], NEVER)
    first.copy_issued(Copy())
    with pytest.warns(RuntimeWarning, match="could not pin a batch: page-locking") as said:
        second = stager.stage([_floats(2 * LARGE)], NEVER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = stager.stage([_floats(LARGE)], NEVER)  # no second warning
    assert len(said) == 1
    assert "memlock limit (ulimit -l)" in str(said[0].message)
    assert second.lease is None
    assert third.lease is None
    assert stager.pool.figures.unpinned == 2
    assert stager.pool.failure is not None


def test_large_copies_are_cut_into_pieces_for_the_threads() -> None:
    source = torch.randn(8, PIECE_MIN_BYTES // 4)  # 8 MiB
    target = torch.empty_like(source)
    pieces = list(_staging._pieces(target, source, threads=4))
    assert len(pieces) == 4
    assert sum(piece[1].nbytes for piece in pieces) == source.nbytes
    small = torch.randn(PIECE_MIN_BYTES // 4)
    assert len(list(_staging._pieces(torch.empty_like(small), small, threads=4))) == 1
    wide = torch.randn(1, 3 * PIECE_MIN_BYTES // 4)  # cut along the first long dimension
    assert [piece[1].shape for piece in _staging._pieces(torch.empty_like(wide), wide, 3)] == [
        torch.Size([1, PIECE_MIN_BYTES // 4])
    ] * 3


def test_several_pinning_threads_copy_every_byte_in_place() -> None:
    memory = Memory()
    stager = Stager(StagingPool(None, 2, memory), threads=3)
    batch = {
        "images": torch.randn(6, 3, 128, 128),  # 1.1 MiB a 2 pieces
        "masks": torch.randint(0, 2, (6, 1, 512, 512), dtype=torch.uint8),
        "depth": torch.randn(6, 256, 256).transpose(1, 2),
    }
    try:
        staged = stager.stage(batch, NEVER).batch
        pinners = {t.name for t in threading.enumerate() if t.name.startswith("devicekit-pin")}
    finally:
        stager.close()
    for key, tensor in batch.items():
        assert torch.equal(staged[key], tensor), key
    assert pinners  # the pieces went to the pinning threads


def test_the_loader_stages_read_ahead_batches_and_reports_the_pool(
    monkeypatch: pytest.MonkeyPatch, stand_in_device: torch.device
) -> None:
    # The stand-in copies as late as its waits allow, and page-locks each slab
    # (host_register); Memory records each slab on the way. A slab reused before the
    # copy that reads it ran would give the wrong batch, or poison (NaN).
    ledger = set(still_pinned())
    memory = Memory(pinning=_staging.pinning_of(stand_in_device.type).allocate)
    monkeypatch.setitem(
        _staging.ALLOCATORS, stand_in_device.type, _staging.Pinning(memory, _staging.exact)
    )
    batches = [[_floats(LARGE, i)] for i in range(8)]
    loader = dk.DeviceDataLoader(batches, stand_in_device, prefetch=2)
    got = [batch[0].cpu() for batch in loader]
    assert all(torch.equal(g, b[0]) for g, b in zip(got, batches, strict=True))
    stats = loader.stats
    assert stats.pinned_batches == 8  # the first is read, and pinned, in this thread
    assert stats.pinned_reused == stats.pinned_batches - len(memory.sizes)
    assert stats.pinned_bytes == memory.most <= stats.pinned_limit
    assert stats.pinned_limit == 3 * _staging.slab_size(LARGE)
    assert stats.unpinned == 0
    assert stats.copy_bytes == 8 * LARGE  # bandwidth: in test_loader_stats, where copies take time
    assert memory.threads == {"MainThread", "devicekit-feed"}
    assert len(set(still_pinned()) - ledger) == len(memory.sizes)  # each slab registered
    loader.close()
    assert memory.live == 0
    assert set(still_pinned()) <= ledger  # and unregistered


def test_the_pool_limit_is_read_as_a_size() -> None:
    with pytest.raises(ValueError, match="Expected pin_memory_limit as a number of bytes"):
        dk.DeviceDataLoader([1], META, pin_memory_limit="lots")
    loader = dk.DeviceDataLoader([1], META, pin_memory_limit="2GiB")
    assert loader._pin_memory_limit == 2 << 30


def test_a_copy_whose_timer_cannot_time_frees_its_slab_once_waited_for() -> None:
    memory = Memory()
    stager = _stager(memory, limit=LARGE)
    for _ in range(3):  # a stand-in's timer says None even when waited for: no hang
        stager.stage([_floats(LARGE)], NEVER).copy_issued(lambda wait: None)
    assert memory.sizes == [LARGE]
    assert stager.pool.figures.reused == 2


def test_a_collected_loader_gives_its_pinned_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = Memory()

    class Instant:
        def __init__(self, device: torch.device, non_blocking: object) -> None:
            pass

        def start(self, batch: Any) -> Any:
            return batch

        def hand_over(self, ticket: Any) -> Any:
            return ticket

        def consumer_done(self) -> None:
            pass

        def timer(self, ticket: Any) -> Callable[[bool], float | None]:
            return lambda wait: 0.0  # copied at once

    monkeypatch.setitem(_loader.PREFETCHERS, "meta", Instant)
    monkeypatch.setitem(_staging.ALLOCATORS, "meta", _staging.Pinning(memory, _staging.exact))
    loader = dk.DeviceDataLoader([[_floats(LARGE)] for _ in range(4)], META)
    for _ in loader:
        pass
    assert memory.live > 0  # kept for the next epoch
    del loader
    gc.collect()
    assert memory.live == 0


# Round seven: no slab leaked, none freed while page-locked, none kept by an error; reuse
# that holds up on growing and varying batches.


def test_closing_waits_for_the_copies_in_flight_and_gives_back_every_slab() -> None:
    memory = Memory()
    stager = _stager(memory, batches=3)
    done, running = Copy(), Copy()
    for copy in (done, running):
        stager.stage([_floats(LARGE)], NEVER).copy_issued(copy)
    done.end()
    stager.close()
    assert running.waited == 1  # at most prefetch copies: close waits for them
    assert memory.live == 0
    del stager
    gc.collect()
    assert memory.lost == 0


def test_a_copy_issued_after_close_gives_its_slab_back_as_it_ends() -> None:
    memory = Memory()
    stager = _stager(memory)
    staged = stager.stage([_floats(LARGE)], NEVER)  # read ahead, not yet copied
    stager.close()  # from another thread, say, while the batch waits in the queue
    copy = Copy()
    staged.copy_issued(copy)
    assert copy.waited == 1
    assert memory.live == 0
    del stager, staged
    gc.collect()
    assert memory.lost == 0


class PinFails:
    """An object that moves itself, whose pin_memory() raises (a library's bug, a full disk)."""

    def to(self, *args: Any, **kwargs: Any) -> PinFails:
        return self

    def pin_memory(self) -> PinFails:
        msg = "pinning failed"
        raise OSError(msg)


def test_a_pin_that_raises_keeps_no_slab() -> None:
    memory = Memory()
    stager = _stager(memory, limit=LARGE)  # room for one slab
    with pytest.raises(OSError, match="pinning failed"):
        stager.stage([_floats(LARGE), PinFails()], NEVER)
    stopped = threading.Event()
    stopped.set()  # a held slab would be waited for: here, given up at once
    assert stager.stage([_floats(LARGE)], stopped).lease is not None
    assert len(memory.sizes) <= 1


def test_a_fill_that_raises_keeps_no_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = Memory()
    stager = _stager(memory, limit=4 * LARGE)

    def fails(*args: Any) -> Any:
        msg = "cannot read the source"
        raise RuntimeError(msg)

    with monkeypatch.context() as patch:
        patch.setattr(Stager, "_fill", fails)
        with pytest.raises(RuntimeError, match="cannot read the source"):
            stager.stage([_floats(LARGE), _floats(LARGE)], NEVER)
    stopped = threading.Event()
    stopped.set()
    for _ in range(4):  # every slab is free again: four batches fit without a wait
        assert stager.stage([_floats(LARGE)], stopped).lease is not None
    stager.close()
    assert memory.live == 0


def _epoch_of_sizes(stager: Stager, sizes: list[int]) -> None:
    """Stage a batch of each size, each copy ending while the next batch is staged."""
    running: list[Copy] = []
    for step, size in enumerate(sizes):
        staged = stager.stage([_floats(size, step)], NEVER)
        assert staged.lease is not None
        assert torch.equal(staged.batch[0], _floats(size, step))
        copy = Copy()
        staged.copy_issued(copy)
        running.append(copy)
        if len(running) > 1:
            running.pop(0).end()
        assert stager.pool.figures.peak_bytes <= stager.pool.cap


def test_growing_batches_reuse_their_slabs() -> None:
    memory = Memory()
    stager = _stager(memory)
    sizes = [int(4 * LARGE * 1.01**step) // 4 * 4 for step in range(100)]  # 1% more each
    _epoch_of_sizes(stager, sizes)
    # Exact sizes page-locked a slab for each of the 100; rounded to eight sizes between
    # powers of two, a slab is new only where the batches cross into the next size.
    assert len(memory.sizes) <= 30
    assert memory.most <= stager.pool.cap


def test_varying_batches_reuse_their_slabs() -> None:
    memory = Memory()
    stager = _stager(memory)
    shuffled = random.Random(0)
    sizes = [shuffled.randrange(2 * LARGE, 8 * LARGE) // 4 * 4 for _ in range(100)]
    _epoch_of_sizes(stager, sizes)
    # The largest batch so far sets a new slab's size: once it is near the top, each
    # batch finds a free slab that fits (exact sizes page-locked 9 here).
    assert len(memory.sizes) <= 8
    assert memory.most <= stager.pool.cap


def test_slabs_from_torch_s_pinned_allocator_count_the_power_of_two_it_keeps() -> None:
    kept: list[int] = []  # what the allocator holds: PyTorch's rounds up to a power of two

    def rounding(size: int) -> tuple[torch.Tensor, Callable[[], None]]:
        kept.append(1 << (size - 1).bit_length())
        return torch.empty(size, dtype=torch.uint8), lambda: kept.remove(kept[0])

    pool = StagingPool(None, 2, rounding, _staging.power_of_two)
    stager = Stager(pool, threads=1)
    _epoch_of_sizes(stager, [3 * LARGE] * 4)
    assert sum(kept) <= pool.cap
    assert pool.figures.peak_bytes == sum(kept)


def test_a_tensor_that_requires_grad_is_left_to_its_copy() -> None:
    # Filled into a slab, the copy would record autograd on several threads at once, and
    # the gradient would stop at the slab; to_device(batch) keeps it flowing to the source.
    weights = _floats(LARGE).requires_grad_()
    memory = Memory()
    staged = _stager(memory).stage([weights, _floats(LARGE)], NEVER)
    assert staged.batch[0] is weights
    assert memory.sizes == [_staging.slab_size(LARGE)]


def test_close_between_a_slab_and_its_fill_starts_no_pinning_threads_again() -> None:
    def pinners() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("devicekit-pin")}

    before = pinners()
    memory = Memory()
    stager = Stager(StagingPool(None, 2, memory), threads=3)
    big = torch.randn(8, PIECE_MIN_BYTES // 4)  # 8 MiB: pieces for the threads
    stager.stage([big], NEVER)
    acquire = stager.pool.acquire

    def closed_meanwhile(size: int, stop: Any) -> Any:
        lease = acquire(size, stop)
        stager.close()  # another thread's close(), between the slab and its fill
        return lease

    stager.pool.acquire = closed_meanwhile  # type: ignore[method-assign]
    staged = stager.stage([big.clone()], NEVER)
    assert torch.equal(staged.batch[0], big)
    for thread in pinners() - before:
        thread.join(WATCHDOG_S)
    assert not pinners() - before


def test_pinning_threads_leave_the_process_s_thread_count_alone() -> None:
    # A thread takes, at its first parallel op, the count last set by any thread: pinning
    # threads that set theirs to one must not leave later threads (and MKL) on one core.
    count = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        stager = Stager(StagingPool(None, 2, Memory()), threads=3)
        stager.stage([torch.randn(8, PIECE_MIN_BYTES // 4)], NEVER)
        seen: list[int] = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        stager.close()
        assert seen == [2]
    finally:
        torch.set_num_threads(count)


def test_a_page_locking_failure_not_for_memory_does_not_blame_the_memlock_limit() -> None:
    def registered_already(size: int) -> tuple[torch.Tensor, Callable[[], None]]:
        msg = (
            "cudaHostRegister of 36864 bytes failed with CUDA error 712 (part or all of the "
            "requested memory range is already mapped)"
        )
        raise RuntimeError(msg)

    stager = Stager(StagingPool(None, 2, registered_already), threads=1)
    with pytest.warns(RuntimeWarning, match="could not pin a batch") as said:
        assert stager.stage([_floats(LARGE)], NEVER).lease is None
    assert "CUDA error 712 (part or all of the requested memory range is already mapped)" in str(
        said[0].message
    )
    assert "memlock" not in str(said[0].message)
