"""Pinning: a batch's large tensors copied into page-locked memory of the loader's own.

A copy to an accelerator runs asynchronously only from page-locked (pinned) memory, so
the feed thread stages each batch's large host tensors there before its copy is issued.
``tensor.pin_memory()`` per batch, as a pinning DataLoader does, is slow in two ways, and
this room avoids both:

- PyTorch's pinned allocator rounds each block up to a power of two (a 129.5 MB batch
  pins 256 MB) and keeps every block it made, and a new block costs milliseconds of
  page-locking. A :class:`StagingPool` instead holds *slabs* (ordinary memory registered
  with the driver, where the accelerator allows it), page-locked once and reused batch
  after batch, within a cap. A slab is the size of the largest batch so far, rounded up
  to one of eight sizes between powers of two (:func:`slab_size`, at most 12.5% more), so
  that growing or varying batches find a free slab that fits instead of each needing
  a new one.
- One thread copies into pinned memory at about 7 GiB/s, eight at 30-48 GiB/s (a 16 MiB
  pin on an H100 host: 2.1-2.3 ms against 0.33-0.52 ms). A batch's bytes are copied in
  pieces of at least :data:`PIECE_MIN_BYTES` on up to :func:`pin_threads` threads.

A slab's life (the pool's invariant: its slabs' bytes never exceed its cap, and a slab
is given back to the driver, unregistered, before its memory can be freed)::

    free ──acquire──> held ──its copy issued──> copying ──the copy done──> free
                        └──the batch dropped, or its staging failed──────> free

The feed thread acquires (waiting for a copy to finish where the cap is reached); the
training thread issues the copy and hands the lease the copy's timer, which says when the
slab may be filled again. A batch larger than the cap, or one met after page-locking
failed, is copied from pageable memory, and the stats count it. Closing the pool waits
for the copies in flight (at most ``prefetch`` of them), so that no slab outlives it
still registered.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import mmap
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, NamedTuple

import torch

from devicekit._base import nbytes, stored_bytes, warn
from devicekit._core import PACK_MAX_BYTES, Leaf, flatten, leaf_how, map_flat
from devicekit._loader._cpus import start_on_one_core

__all__ = [
    "ALLOCATORS",
    "PAGEABLE",
    "PIECE_MIN_BYTES",
    "Pinning",
    "PoolFigures",
    "Staged",
    "Stager",
    "StagingPool",
    "exact",
    "measured",
    "pin_threads",
    "pinning_of",
    "power_of_two",
    "slab_size",
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
SIZES_PER_DOUBLING: Final = 8
"""The slab sizes between two powers of two: a slab holds at most 1/8 more than asked.
Batches growing 1% a step page-lock a new slab every twelfth step or so, where exact
sizes page-locked one for each (``tests/test_staging.py``)."""
PAGE: Final = mmap.PAGESIZE
_WAIT_POLL_S: Final = 0.05  # how often a wait for a held slab looks whether to stop
# A refusal for want of memory (cudaErrorMemoryAllocation is 2), where a limit is the cause.
_OUT_OF_MEMORY: Final = re.compile(r"out of memory|\berror 2\b")

CopyDone = Callable[[bool], "float | None"]
"""A copy's timer (the pipeline's CopyTimer): None while it runs; given True, waits."""


class Pinning(NamedTuple):
    """How a device family page-locks host memory for the pool."""

    allocate: Callable[[int], tuple[torch.Tensor, Callable[[], None]]]
    """``nbytes`` -> (a page-locked uint8 tensor of that many bytes, its release)."""
    kept: Callable[[int], int]
    """The bytes it page-locks when asked for ``nbytes``: what the pool counts."""


def exact(size: int) -> int:
    """What registering ordinary memory page-locks for ``size`` bytes: those bytes."""
    return size


def slab_size(size: int) -> int:
    """The bytes of the slab for ``size`` bytes: whole pages, one of 8 sizes per doubling.

    >>> slab_size(1), slab_size(5000), slab_size(1_000_000), slab_size(1 << 20)
    (4096, 8192, 1048576, 1048576)
    >>> slab_size((1 << 20) + 1)  # 1/8 above a power of two, not twice it
    1179648
    """
    if size <= PAGE:
        return PAGE
    step = max(PAGE, (1 << (size.bit_length() - 1)) // SIZES_PER_DOUBLING)
    return -(-size // step) * step


def power_of_two(size: int) -> int:
    """What PyTorch's pinned allocator keeps for ``size`` bytes: the power of two above.

    >>> power_of_two(3), power_of_two(4096), power_of_two(4097)
    (4, 4096, 8192)
    """
    return 1 << (size - 1).bit_length()


def pin_threads(cpus: int) -> int:
    """Threads that pin a batch: half the CPUs this process may use, 1 to 8.

    The other half is the training thread's and the DataLoader workers': on the 2-CPU CI
    machine, with its cores busy, two pinning threads took 1.1-1.2x one's time
    (``benchmarks/bench_loader.py --pinning``), so there a batch is pinned on one.

    >>> pin_threads(1), pin_threads(2), pin_threads(12), pin_threads(64)
    (1, 1, 6, 8)
    """
    return max(1, min(MAX_PIN_THREADS, cpus // 2))


def _registered(size: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Ordinary host memory of exactly ``size`` bytes, page-locked with the CUDA driver.

    cudaHostRegister pins the pages of memory the process already has, so the slab is
    the size asked for (PyTorch's pinned allocator would round it up to a power of two).
    Its pages are touched first, one byte each, as PyTorch does before registering:
    the driver would otherwise fault them in itself, under its global lock.

    Raises:
        RuntimeError: The driver refused (the memlock limit, a cgroup's, no memory).
    """
    slab = torch.empty(size, dtype=torch.uint8)
    slab[::PAGE].zero_()
    runtime = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # untyped in PyTorch
    pointer = slab.data_ptr()
    error = runtime.cudaHostRegister(pointer, size, 1)  # portable: for every device
    if int(error) != 0:
        msg = f"cudaHostRegister of {size} bytes failed with CUDA error {int(error)}"
        # Its name where the binding gives it: 2 is out of memory, 712 registered already.
        with contextlib.suppress(TypeError, RuntimeError):
            msg += f" ({runtime.cudaGetErrorString(error)})"
        raise RuntimeError(msg)

    def release() -> None:
        runtime.cudaHostUnregister(pointer)

    return slab, release


def _pinned_by_torch(size: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Page-locked memory from PyTorch's allocator, for accelerators without registration.

    Its release gives the block back to PyTorch's cache of pinned blocks, which keeps it.
    """
    return torch.empty(size, dtype=torch.uint8, pin_memory=True), lambda: None


def _pageable(size: int) -> tuple[torch.Tensor, Callable[[], None]]:
    return torch.empty(size, dtype=torch.uint8), lambda: None


BY_TORCH: Final = Pinning(_pinned_by_torch, power_of_two)
"""PyTorch's pinned allocator: a block of the power of two above, kept once released."""
PAGEABLE: Final = Pinning(_pageable, exact)
"""Ordinary memory standing in for page-locked memory where nothing can be pinned: what
the tests and the benchmarks register for their stand-in device."""


def _registered_by(module: Any, size: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Ordinary host memory of ``size`` bytes, registered through a backend's own module.

    A backend registered from Python (the stand-in of :mod:`devicekit.testing`) page-locks
    memory with ``host_register``, as CUDA's ``cudaHostRegister``.
    """
    slab = torch.empty(size, dtype=torch.uint8)
    module.host_register(slab)
    return slab, functools.partial(module.host_unregister, slab)


def pinning_of(device_type: str) -> Pinning:
    """How slabs for ``device_type`` are page-locked.

    As :data:`ALLOCATORS` says; else with a backend's own ``host_register``; else
    :data:`BY_TORCH`.
    """
    found = ALLOCATORS.get(device_type)
    if found is not None:
        return found
    module = getattr(torch, device_type, None)
    if callable(getattr(module, "host_register", None)):
        return Pinning(functools.partial(_registered_by, module), exact)
    return BY_TORCH


ALLOCATORS: dict[str, Pinning] = {
    # ROCm's builds are "cuda" too, but registration is CUDA's: there, PyTorch's allocator.
    "cuda": Pinning(_registered, exact) if torch.version.hip is None else BY_TORCH,
}
"""How slabs are page-locked, by device type; others use :data:`BY_TORCH`. The seam:
tests and the benchmarks register :data:`PAGEABLE` for their stand-in device here."""


class PoolFigures(NamedTuple):
    """What a pool did, counted since it was made (an epoch's are the difference)."""

    staged: int = 0  # batches staged in a slab
    reused: int = 0  # of them, in a slab the pool had already page-locked
    unpinned: int = 0  # batches copied from pageable memory instead
    crowded: int = 0  # of them, because batches of other live epochs held every slab
    peak_bytes: int = 0  # the most page-locked bytes the pool held at once
    slabs: int = 0  # slabs page-locked


class Lease:
    """A slab in use, from its batch's staging until its copy has finished."""

    __slots__ = ("copy_done", "epoch", "finished", "pool", "slab")

    def __init__(self, pool: StagingPool, slab: torch.Tensor, epoch: object) -> None:
        self.pool, self.slab = pool, slab
        self.epoch = epoch  # the feed's stop event: which live epoch's batch holds it
        self.copy_done: CopyDone | None = None  # set when the copy is issued
        self.finished = False  # waited for: its copy has ended

    def copying(self, copy_done: CopyDone) -> None:
        """The batch's copy was issued: the slab is free again once ``copy_done`` says so."""
        self.pool.copying(self, copy_done)

    def release(self) -> None:
        """The batch was dropped before its copy (or its staging failed): free at once."""
        self.pool.release(self)


class StagingPool:
    """Page-locked slabs, reused across batches, within a cap in bytes.

    ``limit`` is the cap; None caps it at ``batches`` slabs for the largest batch staged
    so far (what that many batches in flight need). ``kept`` is what page-locking keeps
    for a request (see :class:`Pinning`). Thread-safe: the feed thread acquires, the
    training thread marks copies issued, a dropped batch releases from anywhere.
    """

    def __init__(
        self,
        limit: int | None,
        batches: int,
        allocate: Callable[[int], tuple[torch.Tensor, Callable[[], None]]],
        kept: Callable[[int], int] = exact,
    ) -> None:
        self.limit, self._batches, self._allocate, self._kept = limit, batches, allocate, kept
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
        if self.limit is not None:
            return self.limit
        return self._batches * self._kept(slab_size(self._largest)) if self._largest else 0

    @property
    def figures(self) -> PoolFigures:
        """What the pool did so far."""
        with self._changed:
            return self._figures

    def acquire(self, size: int, stop: threading.Event | None) -> Lease | None:
        """A slab of at least ``size`` bytes, held; None: copy this batch from pageable memory.

        ``stop`` is the asking feed's (None: the thread that issues the copies asks). Waits
        while the cap is reached for a copy to finish, or for a batch this feed read ahead
        to be copied, giving up where ``stop`` is set. None, counted as unpinned, where the
        batch is larger than the cap, page-locking failed, the pool is closed, or only
        batches of other live epochs (a peek, a nested loop) hold the slabs: their loop
        may be the one waiting for this batch.
        """
        while True:
            with self._changed:
                lease, oldest = self._try(size, stop)
                if lease is not None or oldest is None:
                    if lease is None:
                        self._count(unpinned=1)
                    return lease
                if oldest is _HELD:  # only batches not yet copied hold the slabs
                    if stop is None or all(held.epoch is not stop for held in self._held):
                        self._count(unpinned=1, crowded=1)
                        return None
                    self._changed.wait(_WAIT_POLL_S)
                    if stop.is_set():
                        return None
                    continue
            oldest.copy_done(True)  # outside the lock: the copy the slab waits for ends
            # Ended, whatever the timer says: one that cannot time says None even then.
            oldest.finished = True

    def _try(self, size: int, epoch: object) -> tuple[Lease | None, Any]:
        """A lease now, or what to wait for: the oldest copy's lease, or _HELD; else None."""
        if self._closed or self.failure is not None:
            return None, None
        self._largest = max(self._largest, size)
        if self._kept(size) > self.cap:
            return None, None
        self._reclaim()
        fits = [index for index, slab in enumerate(self._free) if slab.numel() >= size]
        if fits:
            slab = self._free.pop(min(fits, key=lambda index: self._free[index].numel()))
            self._count(staged=1, reused=1)
            return self._lease(slab, epoch), None
        self._free.sort(key=torch.Tensor.numel)  # the smallest go first: least use later
        want = self._kept(self._new_slab(size))
        while self._free and self._bytes + want > self.cap:
            self._drop(self._free.pop(0))
        if self._bytes + want > self.cap:
            want = self._kept(size)  # room for this batch alone
        if self._bytes + want > self.cap:
            return None, self._copying[0] if self._copying else _HELD
        try:
            slab, release = self._allocate(want)
        except RuntimeError as error:
            self._failed(error, want)
            return None, None
        self._releases[id(slab)] = release
        self._bytes += want
        self._count(staged=1, slabs=1, peak_bytes=self._bytes)
        return self._lease(slab, epoch), None

    def _new_slab(self, size: int) -> int:
        """The bytes of a new slab for a batch of ``size``: the largest batch's, rounded.

        Batches after it then fit it too. Under a user's limit, rounded no further than
        leaves room for as many batches of ``size`` as exact slabs would.
        """
        rounded = slab_size(self._largest)
        if self.limit is not None:
            rounded = min(rounded, max(size, self.limit // max(1, self.limit // size)))
        return rounded

    def _lease(self, slab: torch.Tensor, epoch: object) -> Lease:
        lease = Lease(self, slab, epoch)
        self._held.add(lease)
        return lease

    def _reclaim(self) -> None:
        """Free the slabs whose copies have finished, in the order they were issued."""
        while self._copying and (
            self._copying[0].finished or self._copying[0].copy_done(False) is not None  # type: ignore[misc]
        ):
            self._give_back(self._copying.popleft().slab)

    def copying(self, lease: Lease, copy_done: CopyDone) -> None:
        """``lease``'s copy was issued; its slab is reused once ``copy_done`` says it ended.

        On a closed pool the copy is waited for here, and the slab given back: nothing
        else would look at it again.
        """
        with self._changed:
            if lease not in self._held:
                return
            self._held.discard(lease)
            lease.copy_done = copy_done
            self._copying.append(lease)
            self._changed.notify_all()  # a wait for held slabs now waits for this copy
            closed = self._closed
        if closed:
            self.wait_for_copies()

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
        said = str(error).rstrip(".")
        self.failure = f"page-locking {nbytes(size)} failed ({said})"
        if _OUT_OF_MEMORY.search(said):
            self.failure += (
                "; the memlock limit (ulimit -l) or a container's limit may be too low for it"
            )
        msg = (
            f"DeviceDataLoader could not pin a batch: {self.failure}. Its batches are copied "
            "from pageable memory from now on, slower and blocking the training thread. "
            "Raise the limit, or lower pin_memory_limit=."
        )
        warn(msg, RuntimeWarning)

    def close(self) -> None:
        """Give back every slab: the free ones, and those in copies, once the copies end.

        The copies in flight (at most ``prefetch``) are waited for here. A batch staged
        but not yet copied gives its slab back as it is dropped, or once its copy ends.
        """
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self.wait_for_copies()
        with self._changed:
            while self._free:
                self._drop(self._free.pop())

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

    ``source_read`` is set once the batch no longer reads the source's memory: its copy
    was issued (or it was dropped). None where it never did: every host tensor is in the
    slab already, or it has none. A source may refill its buffers once it is set.
    Dropped before its copy was issued (an epoch left early), it gives its slab back.
    """

    __slots__ = ("batch", "lease", "nbytes", "source_read")

    def __init__(
        self, batch: Any, lease: Lease | None, size: int, *, reads_source: bool = False
    ) -> None:
        self.batch, self.lease, self.nbytes = batch, lease, size
        self.source_read = threading.Event() if reads_source else None

    def copy_issued(self, copy_done: CopyDone) -> None:
        """The batch's copy was issued; ``copy_done`` says when its slab may be reused."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.copying(copy_done)
        if self.source_read is not None:
            self.source_read.set()

    def __del__(self) -> None:
        if self.lease is not None:
            self.lease.release()
        if self.source_read is not None:
            self.source_read.set()


def _stageable(tensor: torch.Tensor) -> bool:
    """A large host tensor worth its own copy into a slab: plain, strided, not pinned.

    One that requires grad is left to its copy: autograd then records the copy to the
    device from the source, as ``to_device`` does (filled into a slab, on several
    threads at once, its graph would end at the slab).
    """
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and not tensor.is_quantized
        and not tensor.requires_grad
        and not tensor.is_pinned()
    )


def _reads_source(leaf: Any) -> bool:
    """Whether ``leaf``'s copy, once issued, reads memory the source may refill.

    A host tensor does, and an object that moves itself (it copies its own tensors then).
    """
    if isinstance(leaf, torch.Tensor):
        return leaf.is_cpu
    return leaf_how(type(leaf)).leaf in _MOVES_ITSELF


_MOVES_ITSELF: Final = frozenset({Leaf.RULE, Leaf.TO_METHOD, Leaf.CACHE})


class _Batch:
    """One batch's staging, as the walk carries it (see :meth:`Stager.stage`)."""

    __slots__ = ("failed", "lease", "moving", "reads_source", "stop")

    def __init__(self, stop: threading.Event | None) -> None:
        self.stop = stop
        self.lease: Lease | None = None
        self.moving = 0  # every distinct host tensor's bytes: what the copy will move
        self.reads_source = False
        # Set once a leaf has raised: the walk then moves each leaf again, alone, to name
        # the one that fails, and that search must take no slab.
        self.failed = False


class Stager:
    """The feed thread's pinning: a pool of slabs, and the threads that fill them.

    Tensors of at most PACK_MAX_BYTES are left alone: they travel packed, through a
    staging buffer pinned already, and staging them too would copy them twice. Objects
    that move themselves (a TensorDict, a graph, a PackedSequence) are pinned by their
    own ``pin_memory()`` on a shallow copy, as PyTorch's pin-memory thread pins them.

    Made in the training thread: the pinning threads start here, each on one core, and
    the process's intra-op thread count is put back once they have (see
    :func:`~devicekit._loader._cpus.start_on_one_core`). After :meth:`close`, a batch
    still being staged is filled on the thread that stages it.
    """

    def __init__(self, pool: StagingPool, threads: int) -> None:
        self.pool = pool
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        if threads > 1:
            executor = self._executor = ThreadPoolExecutor(threads - 1, "devicekit-pin")
            start_on_one_core(
                lambda settle: [executor.submit(settle) for _ in range(threads - 1)],
                threads - 1,
            )

    def stage(self, batch: Any, stop: threading.Event | None) -> Staged:
        """``batch`` with its large host tensors in one slab (aliases stay aliases).

        ``stop``: as :meth:`StagingPool.acquire` takes it (None from the training thread).
        """
        job = _Batch(stop)
        try:
            moved = map_flat(self._staged_leaves, batch, job)
        except BaseException:
            if job.lease is not None:
                job.lease.release()
            raise
        return Staged(moved, job.lease, job.moving, reads_source=job.reads_source)

    def _staged_leaves(self, leaves: list[Any], active: Any, job: _Batch) -> list[Any]:
        """Stage ``leaves`` (a list of flatten's own, changed in place) for ``job``."""
        if job.failed:  # looking for the leaf that failed: pin each object, take no slab
            for index in active:
                leaf = leaves[index]
                if not isinstance(leaf, torch.Tensor) and _pins_itself(leaf):
                    copy.copy(leaf).pin_memory()
            return leaves
        try:
            self._stage_leaves(leaves, active, job)
        except BaseException:
            job.failed = True
            if job.lease is not None:
                job.lease.release()
                job.lease = None
            raise
        return leaves

    def _stage_leaves(self, leaves: list[Any], active: Any, job: _Batch) -> None:
        large: dict[int, torch.Tensor] = {}
        counted: set[int] = set()  # a tensor in two places is copied, and counted, once
        selves: dict[int, Any] = {}
        moving, reads = 0, False
        for index in active:
            leaf = leaves[index]
            if isinstance(leaf, torch.Tensor):
                key = id(leaf)
                if key in counted or not leaf.is_cpu:
                    continue
                counted.add(key)
                size = stored_bytes(leaf)
                moving += size
                if size > PACK_MAX_BYTES and _stageable(leaf):
                    large[key] = leaf
                else:  # its copy reads it where the source put it
                    reads = True
            elif _pins_itself(leaf):
                if id(leaf) not in selves:
                    selves[id(leaf)] = copy.copy(leaf).pin_memory()
                leaves[index] = selves[id(leaf)]
            elif leaf_how(type(leaf)).leaf in _MOVES_ITSELF:
                reads = True
        job.moving, job.reads_source = moving, reads
        if not large:
            return
        offsets, size = _layout(large.values())
        job.lease = self.pool.acquire(size, job.stop)
        if job.lease is None:  # copied from pageable memory: from the source's
            job.reads_source = True
            return
        copies = self._fill(job.lease.slab, large.values(), offsets)
        for index in active:
            leaf = leaves[index]
            if isinstance(leaf, torch.Tensor) and id(leaf) in copies:
                leaves[index] = copies[id(leaf)]

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
        executor = self._executor  # None once closed: this thread copies every piece
        if len(pieces) == 1 or executor is None:
            for target, source in pieces:
                target.copy_(source)
            return copies
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
        """Stop the pinning threads, and give back the pool's slabs (see StagingPool.close)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
        self.pool.close()


def _pins_itself(leaf: Any) -> bool:
    """An object that moves itself and has a ``pin_memory()`` (TensorDict, a graph, ...)."""
    return callable(getattr(leaf, "pin_memory", None)) and (
        leaf_how(type(leaf)).leaf is Leaf.TO_METHOD
    )


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


def measured(batch: Any, stop: threading.Event | None) -> Staged:
    """``batch`` as it is, with the bytes its copy will move: where devicekit does not pin."""
    flat = flatten(batch)
    leaves = {id(leaf): leaf for leaf in (flat.leaves[index] for index in flat.active)}
    size = sum(
        stored_bytes(leaf)
        for leaf in leaves.values()
        if isinstance(leaf, torch.Tensor) and leaf.is_cpu
    )
    reads = any(_reads_source(leaf) for leaf in leaves.values())
    return Staged(batch, None, size, reads_source=reads)
