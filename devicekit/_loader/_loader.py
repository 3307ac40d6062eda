"""DeviceDataLoader: batches arrive on the device, their copy hidden behind the last step.

On an accelerator a loader iterates as a pipeline:

1. Batches come from the wrapped loader, iterated once per epoch by a background
   *feed* thread, a bounded number ahead, which pins their large tensors where
   devicekit must (the wrapped loader does not, and ``pin_memory`` is not False), so
   the training thread never pays for reading or pinning; small tensors need no
   pinning, since they travel packed through a pinned staging buffer. Reads that draw
   random numbers are the exception: made in the training thread, where an epoch's
   first two reads show them (see :func:`~devicekit._loader._pipeline.ahead`; ``stats`` says
   which it was).
2. The training thread issues each batch's copy on the loader's side stream, up to
   ``prefetch`` batches ahead, and records an event after each. It starts the copies of
   the batches the feed has ready, never waits for one while it holds a batch: a batch
   that is ready is handed over at once, whatever the next one costs to read.
3. Handing a batch over, the consumer's stream waits for that batch's event, so the
   batch is complete before any kernel reads it.

Memory is never reused early, without ``record_stream``: whenever the consumer comes
back for a batch, the side stream first waits for all the work the consumer has queued,
and the loader makes its side-stream allocations after that wait only. Memory the
consumer freed can therefore only be reused by copies queued after its last use.

Every stream and event operation sits behind one small seam,
:class:`~devicekit._loader._pipeline.Prefetcher`, so that the pipeline's control flow (what is
in flight, what ends an epoch, what an error or an early ``break`` leaves behind) runs
and is tested on machines without an accelerator: a test or a benchmark plugs its
stand-in in by device type through :data:`PREFETCHERS` (``meta``, in the tests). The
feed is :mod:`devicekit._loader._feed`, the copies ahead :mod:`devicekit._loader._pipeline`; this
room holds the facade: what a loader is asked, and how each epoch starts and ends.

On the CPU, the ``meta`` device and any device without streams, batches move in line:
there is nothing to overlap.

Every epoch is measured as it runs (:mod:`devicekit._loader._recorder` says what and how). While
a ``torch.profiler`` session runs, the waits, pins and copies are named ranges
(``devicekit.wait``, ``devicekit.pin``, ``devicekit.copy``); otherwise nothing is recorded.

Any number of epochs of one loader may be live at once, as with ``DataLoader``: each
has its own pipeline (its own feed), and nothing waits for an earlier epoch, so peeking
at a batch before the loop, nested loops, or an epoch whose source is stuck never hold
up the next. The one exception is a DataLoader that keeps one iterator for every epoch
(``persistent_workers=True``): its ``iter()`` resets that iterator, so a new epoch ends
the live ones first, waiting at most :data:`HANDOFF_S` for their feeds to leave it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, Generic, Literal, TypeAlias, TypeVar

import torch

from devicekit._base import (
    DeviceLike,
    auto_or_flag,
    current_device,
    parse_bytes,
    resolve_device,
    streams_to,
    whole_number,
)
from devicekit._core import NonBlocking, in_line_mover, to_device
from devicekit._loader._cpus import machine_cpus
from devicekit._loader._feed import BackgroundFeed
from devicekit._loader._pipeline import Prefetcher, StreamPrefetcher, ahead, profiling
from devicekit._loader._recorder import EpochRecorder
from devicekit._loader._staging import Stager, StagingPool, pin_threads, pinning_of
from devicekit._loader._stats import (
    Counting,
    LoaderStats,
    SampleCount,
    Setup,
    counting,
    dataloader_counting,
)

__all__ = ["PREFETCHERS", "DeviceDataLoader"]

B = TypeVar("B")
PinMemory: TypeAlias = bool | Literal["auto"]

_END: Final = object()
HANDOFF_S = 30.0
"""How long a new epoch of a DataLoader with persistent workers waits for a live epoch's
feed to leave the DataLoader's one iterator (its next batch, being read), before it
refuses to reset that iterator under it."""

_clock = time.perf_counter
"""What the loop's waits and steps are timed by, read once an epoch (the per-batch path
calls the function it read, as fast as before): tests put a fake clock here, so that
their figures never depend on how busy the machine is."""


PREFETCHERS: dict[str, Callable[[torch.device, NonBlocking], Prefetcher]] = {}
"""The seam: prefetchers by device type, besides the side streams of this build's
accelerator (see ``streams_to``). The tests and the benchmarks register a stand-in here."""


class DeviceDataLoader(Generic[B]):
    """Wrap any loader so its batches arrive on the device, copied ahead of time.

    ``for batch in DeviceDataLoader(loader):`` yields what ``to_device(batch)`` would,
    in the same order, with the same containers. On an accelerator the next batches
    are pinned in a background thread and copied on a side stream while the current
    step runs; on the CPU they move in line. What the wrapper lacks (``dataset``,
    ``sampler``, ``batch_size``, ``num_workers``, ...) is read from the wrapped loader.

    >>> import torch, devicekit as dk
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> data = TensorDataset(torch.randn(10, 3), torch.arange(10))
    >>> loader = dk.DeviceDataLoader(DataLoader(data, batch_size=4), "meta")
    >>> len(loader), [tuple(x.shape) for x, y in loader]
    (3, [(4, 3), (4, 3), (2, 3)])
    >>> next(iter(loader))[0].device
    device(type='meta')

    Each epoch is measured (:attr:`stats`): whether the loop waits for its data, and what
    to change if it does, and how many samples went by. ``samples=`` says how to count
    them where the default rule (:attr:`LoaderStats.samples <devicekit.LoaderStats.samples>`)
    would not, as in a sequence-first batch, whose samples run along dimension 1:

    >>> lm = dk.DeviceDataLoader([(torch.zeros(35, 20), torch.zeros(700))] * 10, "cpu",
    ...                          samples="dim=1")
    >>> for data, targets in lm:
    ...     pass
    >>> lm.stats.samples, lm.stats.samples_rule
    (200, "dimension 1 of the batch's tensors (samples='dim=1')")

    Args:
        loader: What yields the batches: a :class:`~torch.utils.data.DataLoader`, a
            list, any re-iterable, or a function returning a fresh iterable each epoch.
        device: Where batches go; None for :func:`~devicekit.current_device` where the
            loader is made (inside ``with manager:``, the manager's device), kept for
            its whole life, as a model moved there keeps it.
        pin_memory: ``"auto"`` pins batches for an accelerator unless the wrapped
            DataLoader already does; True always pins; False never does.
        prefetch: How many batches are copied ahead on an accelerator; 0 moves each in
            line when it is asked for.
        non_blocking: Passed to :func:`~devicekit.to_device`.
        transform: Applied on the device to each batch before it is handed over (for
            example normalisation); its result is what the loop gets.
        samples: How :attr:`stats` counts a batch's samples: an int (numpy's too), the
            count of every batch; ``"dim=N"``, dimension N of the batch's tensors
            (``"dim=1"`` for a sequence-first batch, ``"dim=-1"`` for the last); a
            function of the batch as the loop gets it,
            returning its count. None: the default rule, which
            :attr:`LoaderStats.samples <devicekit.LoaderStats.samples>` states.
        pin_memory_limit: The most page-locked memory the loader keeps for staging
            batches (bytes, or a size such as ``"2GiB"``); None: what ``prefetch + 1``
            of the largest batches need. A batch larger than it is copied from pageable
            memory, and ``stats.unpinned`` counts it.

    Raises:
        ValueError: ``prefetch`` is negative, ``samples`` is an integer below 1 or a
            string other than ``"dim=N"``, or ``pin_memory_limit`` is negative or a
            string that is no size.
        TypeError: ``loader`` is neither iterable nor a function, ``pin_memory`` or
            ``non_blocking`` is not ``"auto"``, True or False, ``prefetch`` is no whole
            number, ``pin_memory_limit`` is neither a whole number nor a string,
            ``transform`` is not a function, ``samples`` is none of an int, a string or
            a function, or ``device`` is of the wrong type. While iterating: a
            ``samples`` function returned something other than an int (ValueError: a
            negative one), or a wrapped iterator, used up or left early, is asked for
            another epoch.
        DeviceUnavailableError: ``device`` does not parse or is not on this machine.
        TransferError: While iterating, a batch cannot move (see :func:`~devicekit.to_device`).
        RuntimeError: A new epoch of a DataLoader with persistent workers, where a live
            epoch has waited 30 s for its next batch.
    """

    def __init__(
        self,
        loader: Iterable[B] | Callable[[], Iterable[B]],
        device: DeviceLike | None = None,
        *,
        pin_memory: PinMemory = "auto",
        prefetch: int = 1,
        non_blocking: NonBlocking = "auto",
        transform: Callable[[Any], Any] | None = None,
        samples: SampleCount = None,
        pin_memory_limit: int | str | None = None,
    ) -> None:
        prefetch = whole_number(prefetch, 0, "prefetch")
        limit = (
            None if pin_memory_limit is None else parse_bytes(pin_memory_limit, "pin_memory_limit")
        )
        pin_memory = auto_or_flag(pin_memory, "pin_memory")
        non_blocking = auto_or_flag(non_blocking, "non_blocking")
        if transform is not None and not callable(transform):  # for untyped callers
            msg = (  # type: ignore[unreachable]
                "Expected transform to be a function of a batch (or None), got "
                f"{type(transform).__name__} {transform!r}."
            )
            raise TypeError(msg)
        if not isinstance(loader, Iterable) and not callable(loader):  # for untyped callers
            msg = (  # type: ignore[unreachable]
                "Expected a loader to wrap: a DataLoader, a list or another re-iterable, or a "
                f"function returning an iterable, got {type(loader).__name__}."
            )
            raise TypeError(msg)
        self._counting = counting(samples)
        self.loader = loader
        # Bound here, as to_device binds it at its call: a loader made inside `with
        # manager:` keeps feeding that device after the block, as the model moved there.
        self._device = current_device() if device is None else resolve_device(device)
        self._pin_memory = pin_memory
        self._prefetch = prefetch
        self._non_blocking = non_blocking
        self._transform = transform
        # One prefetcher (one side stream) for the loader's whole life, made on first use.
        self._prefetcher: Prefetcher | None = None
        self._pin_memory_limit = limit
        self._stager: Stager | None = None  # the pinned memory and threads, made on first use
        self._one_shot: Literal["fresh", "started", "used up"] = "fresh"
        # The feeds of live epochs, while their threads run (each thread holds its feed).
        self._feeds: weakref.WeakSet[BackgroundFeed] = weakref.WeakSet()
        self._record: EpochRecorder | None = None  # the latest epoch's
        # The epochs' numbers (see _next_epoch): the next one's, whether the user set it,
        # and what the sampler was last told (at first, what it holds).
        self._epoch = 0
        self._epoch_said = False
        self._told = getattr(self._epoch_owner(), "epoch", None)

    @property
    def stats(self) -> LoaderStats:
        """The latest epoch's :class:`~devicekit.LoaderStats`, the running one's so far.

        Before any epoch, an empty one whose verdict says so.
        """
        if self._record is None:
            return LoaderStats(samples_rule=self._how_counted().rule)
        return self._record.snapshot()

    @property
    def device(self) -> torch.device:
        """The device batches go to, the one given or the current one where the loader was made."""
        return self._device

    # What the wrapped loader knows.

    def __len__(self) -> int:
        """The wrapped loader's length.

        Raises:
            TypeError: The wrapped loader has no ``len()``.
        """
        if not hasattr(self.loader, "__len__"):
            msg = f"The wrapped {type(self.loader).__name__} has no len()."
            raise TypeError(msg)
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        """The wrapped loader's attribute (``dataset``, ``sampler``, ``batch_size``, ...)."""
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        try:
            return getattr(self.loader, name)
        except AttributeError:
            msg = f"The wrapped {type(self.loader).__name__} has no attribute {name!r}."
            raise AttributeError(msg) from None

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler the epoch (a DistributedSampler reshuffles with it).

        Looked for on the wrapped loader, its ``sampler``, then its ``batch_sampler``'s
        sampler. The loader tells it each epoch's number itself (0, 1, 2, ...); this
        sets the number of the next epoch, and the count goes on from it.

        Raises:
            TypeError: None of those has ``set_epoch``.
        """
        owner = self._epoch_owner()
        if owner is None:
            msg = (
                f"Expected the wrapped {type(self.loader).__name__}, its sampler or its batch "
                "sampler to have set_epoch (a DistributedSampler does), but none has."
            )
            raise TypeError(msg)
        owner.set_epoch(epoch)
        self._epoch = self._told = epoch
        self._epoch_said = True

    def _epoch_owner(self) -> Any:
        """What takes ``set_epoch``: the wrapped loader, its sampler or its batch sampler's."""
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        sampler = getattr(self.loader, "sampler", None)
        for owner in (self.loader, sampler, getattr(batch_sampler, "sampler", None)):
            if callable(getattr(owner, "set_epoch", None)):  # the owner's, not this method
                return owner
        return None

    def _next_epoch(self) -> None:
        """Tell the sampler the number of the epoch starting, as Lightning and accelerate do.

        Unless the user told it already: through :meth:`set_epoch`, or the sampler's own
        ``set_epoch`` (seen where its ``epoch`` is not what the loader last told it, as
        a DistributedSampler keeps it). A DDP run never repeats one order.
        """
        owner = self._epoch_owner()
        if owner is None:
            return
        if not self._epoch_said:
            seen = getattr(owner, "epoch", None)
            if type(seen) is int and seen != self._told:
                self._epoch = seen  # the user's call to the sampler itself
            else:
                owner.set_epoch(self._epoch)
        self._epoch_said = False
        self._told = self._epoch
        self._epoch += 1

    # Iteration.

    def _batches(self) -> Iterator[Any]:
        """This epoch's iterator over the wrapped loader, made with one ``iter()`` call.

        A DataLoader starts its workers on ``iter()``, so it is called exactly once per
        epoch; an iterator that returns itself is a one-shot source, good for one epoch.
        """
        source = self.loader if isinstance(self.loader, Iterable) else self.loader()
        batches = iter(source)
        if batches is source and isinstance(self.loader, Iterable):
            if self._one_shot != "fresh":
                how = (
                    "is used up"
                    if self._one_shot == "used up"
                    else "an earlier epoch already started and left early (a loader that "
                    "copies ahead cannot go on where that epoch stopped)"
                )
                msg = (
                    f"Expected a re-iterable loader for another epoch, but the wrapped "
                    f"{type(source).__name__} is an iterator that {how}. Wrap a list, a "
                    "DataLoader, or a function that returns a new iterable each epoch."
                )
                raise TypeError(msg)
            self._one_shot = "started"
            return self._noting_the_end(batches)
        return batches

    def _noting_the_end(self, batches: Iterator[Any]) -> Iterator[Any]:
        yield from batches
        self._one_shot = "used up"

    def _pins(self) -> bool:
        if self._pin_memory != "auto":
            return bool(self._pin_memory)
        return not bool(getattr(self.loader, "pin_memory", False))

    def __iter__(self) -> Iterator[B]:
        device = self._device
        self._next_epoch()
        if getattr(self.loader, "persistent_workers", False) and self._feeds:
            self._end_live_epochs()
        make_prefetcher = PREFETCHERS.get(device.type) or (
            StreamPrefetcher if streams_to(device) else None
        )
        if self._prefetch == 0:
            make_prefetcher = None
        record = EpochRecorder(self._setup(ahead=make_prefetcher is not None))
        if make_prefetcher is None:
            return self._measured(self._batches(), record, self._in_line(device))
        prefetcher = self._prefetcher
        if prefetcher is None:
            prefetcher = self._prefetcher = make_prefetcher(device, self._non_blocking)
        stager = self._staging() if self._pins() else None
        if stager is not None:
            record.pool, record.pool_before = stager.pool, stager.pool.figures
        epoch = ahead(
            self._batches(),
            prefetcher,
            device,
            record,
            depth=self._prefetch,
            finish=self._finish,
            stage=None if stager is None else stager.stage,
            feeds=self._feeds,
        )
        return self._measured(epoch, record)

    def _staging(self) -> Stager:
        """The loader's pinned memory and pinning threads, made at its first pinned epoch."""
        if self._stager is None:
            pinning = pinning_of(self._device.type)
            pool = StagingPool(
                self._pin_memory_limit, self._prefetch + 1, pinning.allocate, pinning.kept
            )
            self._stager = Stager(pool, pin_threads(machine_cpus()))
            # Collected without close(): the memory goes back once its copies have ended.
            # Not at the interpreter's exit, when the driver may be gone: the OS takes it.
            weakref.finalize(self, self._stager.close).atexit = False
        return self._stager

    def close(self) -> None:
        """End the live epochs, and give back the pinned memory and pinning threads now.

        Memory still read by a copy goes back as that copy ends. A later epoch makes them
        again, as a DataLoader starts its workers again; a collected loader closes itself.
        """
        for feed in list(self._feeds):
            feed.close()
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()

    def _setup(self, *, ahead: bool) -> Setup:
        loader = self.loader
        dataloader = isinstance(loader, torch.utils.data.DataLoader)
        return Setup(
            source=type(loader).__name__ if isinstance(loader, Iterable) else "function",
            num_workers=loader.num_workers if dataloader else None,  # type: ignore[union-attr]
            persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            pinned=bool(getattr(loader, "pin_memory", False)) or (ahead and self._pins()),
            accelerator=ahead,
            cpus=machine_cpus(),
            counting=self._how_counted(),
            device=self._device,
        )

    def _how_counted(self) -> Counting:
        """How this epoch's samples are counted: as ``samples=`` says, else by default."""
        return self._counting if self._counting is not None else dataloader_counting(self.loader)

    def _measured(
        self,
        batches: Iterator[Any],
        record: EpochRecorder,
        move: Callable[[Any], Any] | None = None,
    ) -> Iterator[B]:
        """What ``batches`` yields (moved in line), with the loop's wait and step.

        ``move`` moves a batch in line (None: they come moved). The wait is from asking
        for a batch to getting it, the step from getting it to asking for the next; an
        epoch left early keeps what it measured. Moving in line here, not in a generator
        of its own, saves the CPU path a frame per batch: a tenth of moving a small batch
        to the CPU (``benchmarks/bench_loader.py``).
        """
        clock = _clock
        waits, steps, count = record.waits, record.steps, record.count
        batch: Any
        asked = clock()
        try:
            while True:
                if profiling():
                    with torch.profiler.record_function("devicekit.wait"):
                        batch = next(batches, _END)
                        if batch is not _END and move is not None:
                            with torch.profiler.record_function("devicekit.copy"):
                                batch = move(batch)
                else:
                    batch = next(batches, _END)
                    if batch is not _END and move is not None:
                        batch = move(batch)
                got = clock()
                if batch is _END:
                    record.finished = not record.closed
                    self._record = record
                    return
                waits.append(got - asked)
                count(batch)
                # The stats are the epoch's that handed over the latest batch: a peek
                # (next(iter(loader))) inside a loop has them for one batch, not for good.
                self._record = record
                yield batch
                del batch  # not held while the next one is fetched
                asked = clock()
                steps.append(asked - got)
        finally:
            record.read_copies(wait=True)
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # now, not when the collector gets to it: it stops a feed

    def _end_live_epochs(self) -> None:
        """End the live epochs' feeds, which may be inside the one iterator iter() resets.

        They yield what they copied ahead, then stop (persistent workers: see the module).
        """
        feeds = list(self._feeds)
        for feed in feeds:
            feed.close()
        deadline = time.monotonic() + HANDOFF_S
        for feed in feeds:
            if not feed.join(max(0.0, deadline - time.monotonic())):
                msg = (
                    f"Cannot start a new epoch: the wrapped {type(self.loader).__name__} keeps "
                    "one iterator for every epoch (persistent_workers=True) and iter() resets "
                    f"it, but a live epoch has been waiting on it for its next batch for "
                    f"{HANDOFF_S:g} s (a worker stuck?). Set the DataLoader's timeout= to "
                    "surface a stuck worker as an error, or wrap a DataLoader without "
                    "persistent workers, whose epochs are independent."
                )
                raise RuntimeError(msg)

    def _finish(self, batch: Any) -> Any:
        return batch if self._transform is None else self._transform(batch)

    def _in_line(self, device: torch.device) -> Callable[[Any], Any]:
        """How a batch moves where nothing is copied ahead: to_device, then the transform."""
        if self._transform is None and self._non_blocking == "auto":
            return in_line_mover(device)
        non_blocking, finish = self._non_blocking, self._finish
        return lambda batch: finish(to_device(batch, device, non_blocking=non_blocking))
