"""DeviceDataLoader: batches arrive on the device, their copy hidden behind the last step.

On an accelerator a loader iterates as a pipeline:

1. Batches come from the wrapped loader, iterated once per epoch by a background
   *feed* thread, a bounded number ahead, which pins their large tensors where
   devicekit must (the wrapped loader does not, and ``pin_memory`` is not False), so
   the training thread never pays for reading or pinning; small tensors need no
   pinning, since they travel packed through a pinned staging buffer. Reads that draw
   random numbers are the exception: made in the training thread, where an epoch's
   first two reads show them (see ``_ahead``; ``stats`` says which it was).
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

Every stream and event operation sits behind one small seam, :class:`Prefetcher`, so
that the pipeline's control flow (what is in flight, what ends an epoch, what an error
or an early ``break`` leaves behind) runs and is tested on machines without an
accelerator, with a stand-in for the seam.

On the CPU, the ``meta`` device and any device without streams, batches move in line:
there is nothing to overlap.

Every epoch is measured as it runs (:mod:`devicekit._stats`): how long the training
thread waits for each batch, how long its step takes, and on an accelerator how long
each copy takes on the side stream, read from its events once they are done. While a
``torch.profiler`` session runs, the waits, pins and copies are named ranges
(``devicekit.wait``, ``devicekit.pin``, ``devicekit.copy``); otherwise nothing is recorded.

Any number of epochs of one loader may be live at once, as with ``DataLoader``: each
has its own pipeline (its own feed), and nothing waits for an earlier epoch, so peeking
at a batch before the loop, nested loops, or an epoch whose source is stuck never hold
up the next. The one exception is a DataLoader that keeps one iterator for every epoch
(``persistent_workers=True``): its ``iter()`` resets that iterator, so a new epoch ends
the live ones first, waiting at most :data:`HANDOFF_S` for their feeds to leave it.
"""

from __future__ import annotations

import collections
import copy
import queue
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, Generic, Literal, Protocol, TypeAlias, TypeVar

import torch

from devicekit import _compat
from devicekit._current import current_device
from devicekit._devices import DeviceLike, resolve_device, streams_to
from devicekit._kinds import Leaf, leaf_how
from devicekit._packing import PACK_MAX_BYTES
from devicekit._recorder import CopyTimer, EpochRecorder
from devicekit._stats import (
    Counting,
    LoaderStats,
    SampleCount,
    Setup,
    counting,
    dataloader_counting,
    machine_cpus,
)
from devicekit._transfer import NonBlocking, in_line_mover, to_device
from devicekit._tree import map_leaves

__all__ = ["DeviceDataLoader", "Prefetcher", "StreamPrefetcher", "profiling"]

B = TypeVar("B")
PinMemory: TypeAlias = bool | Literal["auto"]

# How often a background thread blocked on a full queue looks up to see whether it
# was told to stop.
_STOP_POLL_S: Final = 0.1
_END: Final = object()
_NOT_READY: Final = object()  # a feed's next batch is still being read
_READS_CHECKED: Final = 2
"""An epoch's reads watched for random draws before it reads ahead (see ``_ahead``): the
first read of a shuffled DataLoader draws the sampler's seed, however plain its data."""
HANDOFF_S = 30.0
"""How long a new epoch of a DataLoader with persistent workers waits for a live epoch's
feed to leave the DataLoader's one iterator (its next batch, being read), before it
refuses to reset that iterator under it."""


class Prefetcher(Protocol):
    """The seam between the loader's pipeline and an accelerator's streams and events.

    The pipeline calls :meth:`start` for a batch ``prefetch`` batches before it is
    needed, :meth:`hand_over` when the consumer asks for it, and :meth:`consumer_done`
    each time the consumer comes back for the next one.
    """

    def pin(self, batch: Any) -> Any:
        """The batch with the tensors worth pinning in page-locked memory (any thread)."""

    def start(self, batch: Any) -> Any:
        """Issue the batch's copy to the device without waiting; return a ticket for it."""

    def hand_over(self, ticket: Any) -> Any:
        """The moved batch of ``ticket``, safe for the consumer's stream to read."""

    def consumer_done(self) -> None:
        """Order later copies after everything the consumer has queued so far."""

    def timer(self, ticket: Any) -> CopyTimer:
        """How long the ticket's copy took on the device; it holds nothing of the batch."""


profiling: Final = _compat.profiler_running
"""Whether a torch.profiler session runs: a range costs 15 us even when none does (this
0.1 us), so the loader names its work only while one does."""


def _named(name: str, work: Callable[[Any], Any], item: Any) -> Any:
    """``work(item)``, as a range called ``name`` in the profiler's trace."""
    with torch.profiler.record_function(name):
        return work(item)


def random_state() -> tuple[Any, ...]:
    """Where the process's global random generators stand: torch's (CPU), Python's, numpy's.

    About 100 us (numpy's copy of its state is most of it): taken twice an epoch at most.
    """
    numpy = sys.modules.get("numpy")
    legacy = None if numpy is None else numpy.random.get_state(legacy=False)
    return torch.default_generator.get_state(), random.getstate(), legacy


def drew_since(before: tuple[Any, ...]) -> bool:
    """Whether anything drew from those generators since ``before`` was taken."""
    after = random_state()
    if not torch.equal(before[0], after[0]) or before[1] != after[1]:
        return True
    numpy_before, numpy_after = before[2], after[2]
    if numpy_before is None or numpy_after is None:
        return numpy_before is not numpy_after
    return bool(
        numpy_before["state"]["pos"] != numpy_after["state"]["pos"]
        or numpy_before["has_gauss"] != numpy_after["has_gauss"]
        or (numpy_before["state"]["key"] != numpy_after["state"]["key"]).any()
    )


def _as_it_is(batch: Any) -> Any:
    return batch


def _page_locked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_pinned() else tensor.pin_memory()


def _pin(batch: Any, pin: Callable[[torch.Tensor], torch.Tensor] = _page_locked) -> Any:
    """The batch with every large host tensor ``pin``-ned; aliases stay aliases.

    Tensors of at most PACK_MAX_BYTES are left alone: they travel packed, through a
    staging buffer that is pinned already, and pinning them first would copy them twice.
    Objects that move themselves (a TensorDict, a graph, a PackedSequence) are pinned
    by their own ``pin_memory()``, as torch's pin-memory thread pins them, on a shallow
    copy (a graph's pins in place): they move with their ``.to()``, never packed.
    ``pin`` is the seam the tests replace, on machines where nothing can be pinned.
    """
    return map_leaves(_pinned, batch, ({}, pin))


def _pinned(leaf: Any, state: tuple[dict[int, Any], Callable[..., Any]]) -> Any:
    if not isinstance(leaf, torch.Tensor):
        pin_memory = getattr(leaf, "pin_memory", None)
        if not callable(pin_memory) or leaf_how(type(leaf))[0] is not Leaf.TO_METHOD:
            return leaf
        pinned = state[0]
        if id(leaf) not in pinned:
            pinned[id(leaf)] = copy.copy(leaf).pin_memory()
        return pinned[id(leaf)]
    if not leaf.is_cpu or leaf.nbytes <= PACK_MAX_BYTES:
        return leaf
    pinned, pin = state
    copied = pinned.get(id(leaf))
    if copied is None:
        copied = pinned[id(leaf)] = pin(leaf)
    return copied


class StreamPrefetcher:
    """The accelerator side of the pipeline: one side stream for the loader's whole life."""

    def __init__(self, device: torch.device, non_blocking: NonBlocking) -> None:
        self._device = device
        self._non_blocking = non_blocking
        self._stream = torch.Stream(device=device)

    def pin(self, batch: Any) -> Any:
        return _pin(batch)

    def start(self, batch: Any) -> tuple[Any, torch.Event, torch.Event]:
        # Timing events, recorded around the copy: its time, read later, costs no wait.
        begin, ready = (torch.Event(device=self._device, enable_timing=True) for _ in "br")
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
            if wait:
                ready.synchronize()
            elif not ready.query():
                return None
            return begin.elapsed_time(ready) / 1e3

        return seconds

    def consumer_done(self) -> None:
        self._stream.wait_stream(torch.accelerator.current_stream(self._device))


PREFETCHERS: dict[str, Callable[[torch.device, NonBlocking], Prefetcher]] = {}
"""Prefetchers by device type, besides the side streams of this build's accelerator
(see ``streams_to``): the tests register a stand-in here."""


class _Failure:
    """An exception raised in the background thread, carried to the consumer unchanged."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE: Final = object()


class _BackgroundFeed:
    """Iterates ``batches`` in a daemon thread, ``prepare``-ing up to ``depth`` items ahead.

    The consumer gets the items in order, then the source's exception (the same object,
    with its traceback) if it raised; after either, the feed stays ended. :meth:`close`
    stops the thread: it ends as soon as the item it is waiting for arrives, and never
    blocks on a full queue. :meth:`join` waits for that.
    """

    def __init__(
        self,
        batches: Iterator[Any],
        prepare: Callable[[Any], Any],
        depth: int,
        device: torch.device | None = None,
    ) -> None:
        self._items: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._ended = False
        self._device = device
        # A daemon: a thread stuck in the source (a worker blocked on I/O) never holds
        # up the interpreter's exit.
        self._thread = threading.Thread(
            target=self._run, args=(batches, prepare), name="devicekit-feed", daemon=True
        )
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._items.put(item, timeout=_STOP_POLL_S)
            except queue.Full:
                continue
            return True
        return False

    def _run(self, batches: Iterator[Any], prepare: Callable[[Any], Any]) -> None:
        # Set up as PyTorch's pin-memory thread is: pinning copies take one core (the
        # setting is the thread's own), and allocations go to the loader's device.
        torch.set_num_threads(1)
        device = self._device
        if device is not None and device.index is not None and streams_to(device):
            torch.accelerator.set_device_index(device.index)
        try:
            for item in batches:
                ready = _named("devicekit.pin", prepare, item) if profiling() else prepare(item)
                if not self._put(ready):
                    return
        except BaseException as error:  # every failure goes to the consumer
            self._put(_Failure(error))
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        return self._received(self._items.get())

    def ready(self) -> Any:
        """The next item where the thread has it already, else ``_NOT_READY``; never waits.

        Raises:
            StopIteration: The source ended.
            Exception: What the source raised, in its place.
        """
        if self._ended:
            raise StopIteration
        try:
            item = self._items.get_nowait()
        except queue.Empty:
            return _NOT_READY
        return self._received(item)

    def _received(self, item: Any) -> Any:
        """A batch as taken from the thread; its end or its source's error, raised here."""
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Tell the thread to stop and drop what it prepared; does not wait for it."""
        self._ended = True
        self._stop.set()
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:  # noqa: PERF203 - draining: the exception is how it ends
                break

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for the thread to end; whether it did."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether the thread is still running (it may be inside the source's next())."""
        return self._thread.is_alive()


def _started(prefetcher: Prefetcher, batch: Any) -> Any:
    """``prefetcher.start(batch)``, in a ``devicekit.copy`` range while a profiler runs."""
    return (
        _named("devicekit.copy", prefetcher.start, batch)
        if profiling()
        else prefetcher.start(batch)
    )


def _prefetched(
    batches: Iterator[Any],
    prefetcher: Prefetcher,
    depth: int,
    finish: Callable[[Any], Any],
    record: EpochRecorder,
    *,
    ready: Callable[[], Any] | None = None,
    first: Any = _NOT_READY,
) -> Iterator[Any]:
    """The pipeline: copies up to ``depth`` batches ahead, hands them over in order.

    A batch whose copy has started is handed over as soon as it is asked for: later
    batches are taken only where ``ready()`` has them already (a feed that reads ahead),
    never waited for while one is in hand, so a source whose next batch is slow, or
    depends on the step's result, holds nothing back. Where nothing is in flight, the
    next batch is waited for. ``first``, where given, was read already.

    An exception from the source or from starting a copy surfaces in its place, after
    every batch before it; one from ``finish`` (the transform) surfaces at once. Each
    copy's timer goes to ``record`` as its batch is handed over.
    """
    in_flight: collections.deque[Any] = collections.deque()
    failure: list[Exception] = []  # the source's: raised once the batches before it are out
    ended = False

    def take(read: Callable[[], Any]) -> bool:
        """Start the copy of what ``read`` gives; whether it gave a batch."""
        nonlocal ended
        try:
            # No local holds the batch or its ticket: the source's exception, kept until
            # raised (and maybe by the caller after), would keep them alive.
            item = read()
            if item is _NOT_READY:
                return False
            in_flight.append(_started(prefetcher, item))
        except StopIteration:
            ended = True
            return False
        except Exception as error:  # re-raised below, unchanged, in its place
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
    if first is not _NOT_READY:
        in_flight.append(_started(prefetcher, first))
        del first
    while True:
        if not in_flight and not ended:
            take(batches.__next__)  # nothing in flight: wait for the source
        top_up()
        if not in_flight:
            break
        ticket = in_flight.popleft()
        record.timers.append(prefetcher.timer(ticket))
        batch = prefetcher.hand_over(ticket)
        del ticket
        record.read_copies()
        top_up()  # the next copies run while the consumer's step does
        yield finish(batch)
        del batch
        prefetcher.consumer_done()
    if failure:
        raise failure[0]


class DeviceDataLoader(Generic[B]):
    """Wrap any loader so its batches arrive on the device, copied ahead of time.

    ``for batch in DeviceDataLoader(loader):`` yields what ``to_device(batch)`` would,
    in the same order, with the same containers. On an accelerator the next batches
    are pinned in a background thread and copied on a side stream while the current
    step runs; on the CPU they move in line.

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
        samples: How :attr:`stats` counts a batch's samples: an int, the count of every
            batch; ``"dim=N"``, dimension N of the batch's tensors (``"dim=1"`` for a
            sequence-first batch); a function of the batch as the loop gets it,
            returning its count. None: the default rule, which
            :attr:`LoaderStats.samples <devicekit.LoaderStats.samples>` states.

    Raises:
        ValueError: ``prefetch`` is negative, ``pin_memory`` or ``non_blocking`` is
            not True, False or "auto", or ``samples`` is an int below 1 or a string
            other than ``"dim=N"``.
        TypeError: ``loader`` is neither iterable nor a function, ``transform`` is
            not a function, or ``samples`` is none of an int, a string or a function;
            while iterating, a ``samples`` function returned something other than an
            int (ValueError: a negative one).
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
    ) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            msg = f"Expected prefetch to be a whole number of 0 or more, got {prefetch!r}."
            raise ValueError(msg)
        if pin_memory not in ("auto", True, False):
            msg = f"Expected pin_memory to be 'auto', True or False, got {pin_memory!r}."
            raise ValueError(msg)
        if non_blocking not in ("auto", True, False) or type(non_blocking) not in (str, bool):
            msg = f"Expected non_blocking to be 'auto', True or False, got {non_blocking!r}."
            raise ValueError(msg)
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
        self._one_shot: Literal["fresh", "started", "used up"] = "fresh"
        # The feeds of live epochs, while their threads run (each thread holds its feed).
        self._feeds: weakref.WeakSet[_BackgroundFeed] = weakref.WeakSet()
        self._record: EpochRecorder | None = None  # the latest epoch's

    @property
    def stats(self) -> LoaderStats:
        """The latest epoch's figures, the running one's so far, else the last one's.

        How long the loop waited for each batch and how long each step took, the share of
        the epoch spent waiting, on an accelerator the copies' time and whether batches
        were read ahead (``read_ahead``; ``reads_draw`` where reading draws random numbers
        and every batch is read in the training thread), and a ``verdict``: input-bound
        or compute-bound, and what to change. Before any epoch, an empty
        :class:`~devicekit.LoaderStats` whose verdict says so.
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
        """The wrapped loader's length; a TypeError where it has none."""
        if not hasattr(self.loader, "__len__"):
            msg = f"The wrapped {type(self.loader).__name__} has no len()."
            raise TypeError(msg)
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def dataset(self) -> Any:
        """The wrapped loader's ``dataset``."""
        return self._wrapped("dataset")

    @property
    def sampler(self) -> Any:
        """The wrapped loader's ``sampler``."""
        return self._wrapped("sampler")

    @property
    def batch_size(self) -> Any:
        """The wrapped loader's ``batch_size``."""
        return self._wrapped("batch_size")

    def __getattr__(self, name: str) -> Any:
        # Everything else the wrapped loader has (num_workers, collate_fn, ...) reads through.
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return self._wrapped(name)

    def _wrapped(self, name: str) -> Any:
        try:
            return getattr(self.loader, name)
        except AttributeError:
            msg = f"The wrapped {type(self.loader).__name__} has no attribute {name!r}."
            raise AttributeError(msg) from None

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler the epoch (a DistributedSampler reshuffles with it).

        Looked for on the wrapped loader, its ``sampler``, then its ``batch_sampler``'s
        sampler.

        Raises:
            TypeError: None of those has ``set_epoch``.
        """
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        owners: list[Any] = [
            self.loader,
            getattr(self.loader, "sampler", None),
            getattr(batch_sampler, "sampler", None),
        ]
        for owner in owners:
            if owner is not None and callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(epoch)
                return
        msg = (
            f"Expected the wrapped {type(self.loader).__name__}, its sampler or its batch "
            "sampler to have set_epoch (a DistributedSampler does), but none has."
        )
        raise TypeError(msg)

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
        return self._measured(self._ahead(self._batches(), prefetcher, device, record), record)

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
        clock = time.perf_counter
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
                    record.finished = True
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

        A DataLoader with persistent workers keeps one iterator and resets it on
        ``iter()``: a feed inside its ``next()`` then would read from a reset iterator.
        The live epochs end (they yield what they copied ahead, then stop).
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

    def _ahead(
        self,
        batches: Iterator[Any],
        prefetcher: Prefetcher,
        device: torch.device,
        record: EpochRecorder,
    ) -> Iterator[B]:
        # Reads that draw from the global random generators (augmentation in a dataset
        # read without workers, a sampler's shuffle, graph sampling) happen in this
        # thread, between the loop's steps, as in a plain loop: a thread reading ahead
        # would interleave its draws with the loop's by timing, and a seeded run would
        # repeat neither the plain loop nor itself. So an epoch's first read is always
        # made here, and its second where the first drew; where the second draws too,
        # every read is made here, batch by batch as the loop asks (``reads_draw``, in the
        # stats and their verdict). Otherwise the rest is read ahead (by the feed).
        #
        # That is the whole rule, and it cannot see further: a read's draws cannot be
        # known before it is made, nor told apart from the loop's once a thread makes it
        # beside them (the generators are the process's), and read k's draws follow step
        # k-1's in a plain loop, so no read that might draw can be made ahead of it. A
        # source that draws only from a later read on (augmentation switched on after a
        # warm-up, every other batch) is read ahead, and the guide says so.
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
            yield from _prefetched(iter((batch,)), prefetcher, 1, self._finish, record)
            del batch
        # The rest is read by a feed thread, pinned there where devicekit pins, so that a
        # batch ready on the device is handed over whatever the next one's read costs.
        pin = prefetcher.pin if self._pins() else _as_it_is
        feed = _BackgroundFeed(batches, pin, self._prefetch, device)
        self._feeds.add(feed)
        record.read_ahead = True
        pipeline = _prefetched(
            feed, prefetcher, self._prefetch, self._finish, record, ready=feed.ready, first=batch
        )
        del batch
        try:
            yield from pipeline
        finally:
            # The end, an error, or a loop left early: the thread stops, the prefetched go.
            feed.close()
