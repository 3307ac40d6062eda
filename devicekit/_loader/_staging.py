"""Pinning: a batch's large tensors copied into page-locked memory of the loader's own.

A copy to an accelerator runs asynchronously only from page-locked (pinned) memory, so
the feed thread stages each batch's large host tensors there before its copy is issued.
``tensor.pin_memory()`` per batch, as a pinning DataLoader does, is slow in two ways, and
this room avoids both:

- PyTorch's pinned allocator rounds each block up to a power of two (a 129.5 MB batch
  pins 256 MB) and keeps every block it made, and a new block costs milliseconds of
  page-locking. A :class:`StagingPool` instead holds *slabs* of the exact bytes its
  batches need (ordinary memory registered with the driver, where the accelerator
  allows it), page-locked once and reused batch after batch, within a cap.
- One thread copies into pinned memory at about 7 GiB/s, eight at 30-48 GiB/s (a 16 MiB
  pin on an H100 host: 2.1-2.3 ms against 0.33-0.52 ms). A batch's bytes are copied in
  pieces of at least :data:`PIECE_MIN_BYTES` on up to :func:`pin_threads` threads.

A slab's life (the pool's invariant: its slabs' bytes never exceed its cap)::

    free ──acquire──> held ──its copy issued──> copying ──the copy done──> free
                        └──the batch dropped before its copy──────────────> free

The feed thread acquires (waiting for a copy to finish where the cap is reached); the
training thread issues the copy and hands the lease the copy's timer, which says when the
slab may be filled again. A batch larger than the cap, or one met after page-locking
failed, is copied from pageable memory, and the stats count it.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, NamedTuple

import torch

from devicekit._base import nbytes, warn
from devicekit._core import PACK_MAX_BYTES, Leaf, flatten, leaf_how, map_flat

__all__ = [
    "ALLOCATORS",
    "PIECE_MIN_BYTES",
    "PoolFigures",
    "Staged",
    "Stager",
    "StagingPool",
    "measured",
    "pin_threads",
    "pinned_by_torch",
]

ALIGN: Final = 64
"""Where each tensor starts in a slab: a cache line, a multiple of every dtype's size."""
PIECE_MIN_BYTES: Final = 1 << 20
"""The least bytes a pinning thread is handed: below it the hand-off (about 22 us, a
ThreadPoolExecutor's submit and result on this project's 2-core CI machine) would cost
more than a second thread saves (1 MiB takes about 150 us on one thread at 7 GiB/s)."""
MAX_PIN_THREADS: Final = 8
"""Pinning threads at most: host memory bandwidth, not cores, bounds a copy; 8 threads
reached 30-48 GiB/s on an H100 host, near what one socket's memory gives."""
_WAIT_POLL_S: Final = 0.05  # how often a wait for a held slab looks whether to stop

CopyDone = Callable[[bool], "float | None"]
"""A copy's timer (the pipeline's CopyTimer): None while it runs; given True, waits."""
SlabAllocator = Callable[[int], tuple[torch.Tensor, Callable[[], None]]]
"""``nbytes`` -> (a page-locked uint8 tensor of exactly that many bytes, its release)."""


def pin_threads(cpus: int) -> int:
    """Threads that pin a batch: half the CPUs this process may use, 1 to 8.

    The other half is the training thread's and the DataLoader workers': on the 2-CPU CI
    machine, with its cores busy, two pinning threads took 1.1-1.2x one's time
    (``benchmarks/bench_loader.py --pinning``), so there a batch is pinned on one.

    >>> pin_threads(1), pin_threads(2), pin_threads(12), pin_threads(64)
    (1, 1, 6, 8)
    """
    return max(1, min(MAX_PIN_THREADS, cpus // 2))


def _registered(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Ordinary host memory of exactly ``nbytes``, page-locked with the CUDA driver.

    cudaHostRegister pins the pages of memory the process already has, so the slab is
    the size asked for (PyTorch's pinned allocator would round it up to a power of two).

    Raises:
        RuntimeError: The driver refused (the memlock limit, a cgroup's, no memory).
    """
    slab = torch.empty(nbytes, dtype=torch.uint8)
    runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # untyped in PyTorch
    pointer = slab.data_ptr()
    error = runtime.cudaHostRegister(pointer, nbytes, 1)  # portable: pinned for every device
    if int(error) != 0:
        msg = f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(error)}."
        raise RuntimeError(msg)

    def release() -> None:
        runtime.cudaHostUnregister(pointer)

    return slab, release


def pinned_by_torch(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Page-locked memory from PyTorch's allocator, for accelerators without registration."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), lambda: None


ALLOCATORS: dict[str, SlabAllocator] = {
    # ROCm's builds are "cuda" too, but registration is CUDA's: there, PyTorch's allocator.
    "cuda": _registered if torch.version.hip is None else pinned_by_torch,
}
"""How slabs are page-locked, by device type; others use PyTorch's pinned allocator. The
seam: tests and the benchmarks register a stand-in for their device here."""


class PoolFigures(NamedTuple):
    """What a pool did, counted since it was made (an epoch's are the difference)."""

    staged: int = 0  # batches staged in a slab
    reused: int = 0  # of them, in a slab the pool had already page-locked
    unpinned: int = 0  # batches copied from pageable memory instead
    peak_bytes: int = 0  # the most page-locked bytes the pool held at once


class Lease:
    """A slab in use, from its batch's staging until its copy has finished."""

    __slots__ = ("copy_done", "finished", "pool", "slab")

    def __init__(self, pool: StagingPool, slab: torch.Tensor) -> None:
        self.pool, self.slab = pool, slab
        self.copy_done: CopyDone | None = None  # set when the copy is issued
        self.finished = False  # waited for: its copy has ended

    def copying(self, copy_done: CopyDone) -> None:
        """The batch's copy was issued: the slab is free again once ``copy_done`` says so."""
        self.pool.copying(self, copy_done)


class StagingPool:
    """Page-locked slabs of exact sizes, reused across batches, within a cap in bytes.

    ``limit`` is the cap; None caps it at ``batches`` times the largest batch staged so
    far (what that many batches in flight need). Thread-safe: the feed thread acquires,
    the training thread marks copies issued, a dropped batch releases from anywhere.
    """

    def __init__(self, limit: int | None, batches: int, allocate: SlabAllocator) -> None:
        self.limit, self._batches, self._allocate = limit, batches, allocate
        self._largest = 0
        self._free: list[torch.Tensor] = []
        self._releases: dict[int, Callable[[], None]] = {}  # by slab id: its unlock
        self._held: set[Lease] = set()
        self._copying: collections.deque[Lease] = collections.deque()
        self._bytes = 0  # every slab's, free or in use
        self._figures = PoolFigures()
        self.failure: str | None = None  # why page-locking failed, once it has
        self._closed = False
        # Reentrant: a batch dropped (and its lease released) by the collector while this
        # thread holds the lock must not wait for itself.
        self._changed = threading.Condition(threading.RLock())

    @property
    def cap(self) -> int:
        """The most page-locked bytes the pool may hold now."""
        return self.limit if self.limit is not None else self._batches * self._largest

    @property
    def figures(self) -> PoolFigures:
        """What the pool did so far."""
        with self._changed:
            return self._figures

    def acquire(self, size: int, stop: threading.Event) -> Lease | None:
        """A slab of at least ``size`` bytes, held; None: copy this batch from pageable memory.

        Waits while the cap is reached for a copy to finish (or a held batch to be
        dropped), and gives up where ``stop`` is set. None where the batch is larger than
        the cap, page-locking failed, or the pool is closed.
        """
        while True:
            with self._changed:
                lease, oldest = self._try(size)
                if lease is not None or oldest is None:
                    if lease is None:
                        self._count(unpinned=1)
                    return lease
                if oldest is _HELD:  # only batches not yet copied hold the slabs
                    self._changed.wait(_WAIT_POLL_S)
                    if stop.is_set():
                        return None
                    continue
            oldest.copy_done(True)  # outside the lock: the copy the slab waits for ends
            # Ended, whatever the timer says: one that cannot time says None even then.
            oldest.finished = True

    def _try(self, size: int) -> tuple[Lease | None, Any]:
        """A lease now, or what to wait for: the oldest copy's lease, or _HELD; else None."""
        if self._closed or self.failure is not None:
            return None, None
        if self.limit is None and size > self._largest:
            self._largest = size
        if size > self.cap:
            return None, None
        self._reclaim()
        fits = [index for index, slab in enumerate(self._free) if slab.numel() >= size]
        if fits:
            slab = self._free.pop(min(fits, key=lambda index: self._free[index].numel()))
            self._count(staged=1, reused=1)
            return self._lease(slab), None
        self._free.sort(key=torch.Tensor.numel)  # the smallest go first: least use later
        while self._free and self._bytes + size > self.cap:
            self._drop(self._free.pop(0))
        if self._bytes + size > self.cap:
            return None, self._copying[0] if self._copying else _HELD
        try:
            slab, release = self._allocate(size)
        except RuntimeError as error:
            self._failed(error, size)
            return None, None
        self._releases[id(slab)] = release
        self._bytes += size
        self._count(staged=1, peak_bytes=self._bytes)
        return self._lease(slab), None

    def _lease(self, slab: torch.Tensor) -> Lease:
        lease = Lease(self, slab)
        self._held.add(lease)
        return lease

    def _reclaim(self) -> None:
        """Free the slabs whose copies have finished, in the order they were issued."""
        while self._copying and (
            self._copying[0].finished or self._copying[0].copy_done(False) is not None  # type: ignore[misc]
        ):
            self._give_back(self._copying.popleft().slab)

    def copying(self, lease: Lease, copy_done: CopyDone) -> None:
        """``lease``'s copy was issued; its slab is reused once ``copy_done`` says it ended."""
        with self._changed:
            if lease in self._held:
                self._held.discard(lease)
                lease.copy_done = copy_done
                self._copying.append(lease)
                self._changed.notify_all()  # a wait for held slabs now waits for this copy

    def release(self, lease: Lease) -> None:
        """Give back the slab of a batch dropped before its copy was issued."""
        with self._changed:
            if lease in self._held:
                self._held.discard(lease)
                self._give_back(lease.slab)
                self._changed.notify_all()

    def _give_back(self, slab: torch.Tensor) -> None:
        if self._closed or self._bytes > self.cap:  # a cap lowered since: shrink to it
            self._drop(slab)
        else:
            self._free.append(slab)

    def _drop(self, slab: torch.Tensor) -> None:
        self._bytes -= slab.numel()
        self._releases.pop(id(slab))()

    def _count(self, **more: int) -> None:
        figures = self._figures
        peak = max(figures.peak_bytes, more.pop("peak_bytes", 0))
        self._figures = figures._replace(
            **{name: getattr(figures, name) + value for name, value in more.items()},
            peak_bytes=peak,
        )

    def _failed(self, error: RuntimeError, size: int) -> None:
        # Free slabs are given back first: the limit may allow this slab without them.
        while self._free:
            self._drop(self._free.pop())
        self.failure = (
            f"page-locking {nbytes(size)} failed ({error}); the memlock limit (ulimit -l) "
            "or a container's limit may be too low for it"
        )
        msg = (
            f"DeviceDataLoader could not pin a batch: {self.failure}. Its batches are copied "
            "from pageable memory from now on, slower and blocking the training thread. "
            "Raise the limit, or lower pin_memory_limit=."
        )
        warn(msg, RuntimeWarning)

    def close(self) -> None:
        """Give back every free slab now, and each one in use as its copy finishes."""
        with self._changed:
            self._closed = True
            self._reclaim()
            while self._free:
                self._drop(self._free.pop())
            self._changed.notify_all()

    def wait_for_copies(self) -> None:
        """Wait until every issued copy has finished, and give their slabs back."""
        while True:
            with self._changed:
                self._reclaim()
                if not self._copying:
                    return
                oldest = self._copying[0]
            oldest.copy_done(True)  # type: ignore[misc]  # set when the lease began copying
            oldest.finished = True


_HELD: Final = object()  # what a full pool waits for: a batch that was not yet copied


class Staged:
    """A batch as the feed thread readied it: its large tensors in a slab, its bytes known.

    Dropped before its copy was issued (an epoch left early), it gives its slab back.
    """

    __slots__ = ("batch", "lease", "nbytes")

    def __init__(self, batch: Any, lease: Lease | None, size: int) -> None:
        self.batch, self.lease, self.nbytes = batch, lease, size

    def copy_issued(self, copy_done: CopyDone) -> None:
        """The batch's copy was issued; ``copy_done`` says when its slab may be reused."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.copying(copy_done)

    def __del__(self) -> None:
        if self.lease is not None:
            self.lease.pool.release(self.lease)


def _stageable(tensor: torch.Tensor) -> bool:
    """A large host tensor worth its own copy into a slab: plain, strided, not pinned."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and not tensor.is_quantized
        and not tensor.is_pinned()
    )


class Stager:
    """The feed thread's pinning: a pool of slabs, and the threads that fill them.

    Tensors of at most PACK_MAX_BYTES are left alone: they travel packed, through a
    staging buffer pinned already, and staging them too would copy them twice. Objects
    that move themselves (a TensorDict, a graph, a PackedSequence) are pinned by their
    own ``pin_memory()`` on a shallow copy, as PyTorch's pin-memory thread pins them.
    """

    def __init__(self, pool: StagingPool, threads: int) -> None:
        self.pool = pool
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None

    def stage(self, batch: Any, stop: threading.Event) -> Staged:
        """``batch`` with its large host tensors in one slab (aliases stay aliases)."""
        found: list[tuple[Lease | None, int]] = []  # the slab and the bytes to move
        moved = map_flat(self._staged_leaves, batch, (found, stop))
        return Staged(moved, *found[0]) if found else Staged(moved, None, 0)

    def _staged_leaves(
        self,
        leaves: list[Any],
        active: Any,
        state: tuple[list[tuple[Lease | None, int]], threading.Event],
    ) -> list[Any]:
        found, stop = state  # leaves: a list of flatten's own, changed in place
        large: dict[int, torch.Tensor] = {}
        moving = 0  # every host tensor's bytes: what the copy will move
        selves: dict[int, Any] = {}
        for index in active:
            leaf = leaves[index]
            if isinstance(leaf, torch.Tensor):
                if leaf.is_cpu:
                    size = leaf.nbytes
                    moving += size
                    if size > PACK_MAX_BYTES and id(leaf) not in large and _stageable(leaf):
                        large[id(leaf)] = leaf
            elif callable(getattr(leaf, "pin_memory", None)) and (
                leaf_how(type(leaf)).leaf is Leaf.TO_METHOD
            ):
                if id(leaf) not in selves:
                    selves[id(leaf)] = copy.copy(leaf).pin_memory()
                leaves[index] = selves[id(leaf)]
        lease = None
        if large:
            offsets, size = _layout(large.values())
            lease = self.pool.acquire(size, stop)
            if lease is not None:
                copies = self._fill(lease.slab, large.values(), offsets)
                for index in active:
                    leaf = leaves[index]
                    if isinstance(leaf, torch.Tensor) and id(leaf) in copies:
                        leaves[index] = copies[id(leaf)]
        found.append((lease, moving))
        return leaves

    def _fill(
        self, slab: torch.Tensor, tensors: Any, offsets: list[int]
    ) -> dict[int, torch.Tensor]:
        """Copy ``tensors`` into ``slab`` at ``offsets``, in pieces on the pinning threads."""
        copies: dict[int, torch.Tensor] = {}
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor, offset in zip(tensors, offsets, strict=True):
            target = slab[offset : offset + tensor.nbytes].view(tensor.dtype)
            if tensor.is_contiguous():
                target = target.view(tensor.shape)
            else:  # the strides .to() would keep (channels_last stays so); 23 us, so not always
                like = torch.empty_like(tensor, device="meta")
                target = target.as_strided(like.shape, like.stride())
            copies[id(tensor)] = target
            pieces += _pieces(target, tensor, self.threads)
        if len(pieces) == 1 or self.threads == 1:
            for target, source in pieces:
                target.copy_(source)
            return copies
        executor = self._executor
        if executor is None:
            executor = self._executor = ThreadPoolExecutor(
                self.threads - 1, "devicekit-pin", initializer=torch.set_num_threads, initargs=(1,)
            )
        # This thread copies the first piece itself: one hand-off fewer.
        futures: list[Future[Any]] = [
            executor.submit(target.copy_, source) for target, source in pieces[1:]
        ]
        first_target, first_source = pieces[0]
        first_target.copy_(first_source)
        for future in futures:
            future.result()
        return copies

    def close(self) -> None:
        """Stop the pinning threads; the pool gives its slabs back as their copies end."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
        self.pool.close()


def _layout(tensors: Any) -> tuple[list[int], int]:
    """Each tensor's offset in a slab (aligned to ALIGN bytes), and the slab's size."""
    offsets, size = [], 0
    for tensor in tensors:
        size = -(-size // ALIGN) * ALIGN
        offsets.append(size)
        size += tensor.nbytes
    return offsets, size


def _pieces(
    target: torch.Tensor, source: torch.Tensor, threads: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) slices of at least PIECE_MIN_BYTES, at most ``threads`` of them.

    Cut along the outermost dimension long enough, so each piece is one copy_ call.
    """
    count = min(threads, max(1, source.nbytes // PIECE_MIN_BYTES))
    dim = next((d for d in range(source.dim()) if source.shape[d] >= count), None)
    if count == 1 or dim is None:
        yield target, source
        return
    yield from zip(target.tensor_split(count, dim), source.tensor_split(count, dim), strict=True)


def measured(batch: Any, stop: threading.Event) -> Staged:
    """``batch`` as it is, with the bytes its copy will move: where devicekit does not pin."""
    tensors = (leaf for leaf in flatten(batch).leaves if isinstance(leaf, torch.Tensor))
    return Staged(batch, None, sum(tensor.nbytes for tensor in tensors if tensor.is_cpu))
