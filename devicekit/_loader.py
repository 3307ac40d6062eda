"""DeviceDataLoader: batches arrive on the device, their copy hidden behind the last step.

On an accelerator a loader iterates in three stages:

1. A background thread takes batches from the wrapped loader and pins them (page-locked
   host memory is what lets a host->device copy run asynchronously), a bounded number
   ahead, so the training thread never pays for pinning.
2. The training thread issues each batch's copy on the loader's side stream, ``prefetch``
   batches ahead, and records an event after each.
3. Handing a batch over, the consumer's stream waits for that batch's event, so the
   batch is complete before any kernel reads it.

Memory is never reused early, without ``record_stream``: at every hand-over the side
stream first waits for an event recorded on the consumer's stream, and the loader makes
all its side-stream allocations after that wait. Memory the consumer freed before asking
for the next batch can therefore only be reused by copies queued after the consumer's
last use of it.

On the CPU, the ``meta`` device and any device without streams, batches move in line:
there is nothing to overlap.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, Generic, Literal, TypeAlias, TypeVar

import torch

from devicekit._devices import DeviceLike, resolve_device
from devicekit._manager import current_device
from devicekit._transfer import NonBlocking, _walker, to_device

__all__ = ["DeviceDataLoader"]

B = TypeVar("B")
PinMemory: TypeAlias = bool | Literal["auto"]

_STREAM_DEVICE_TYPES: Final = frozenset({"cuda", "xpu"})
# How often a blocked background thread looks up to see whether it was told to stop.
_STOP_POLL_S: Final = 0.1


def _pin(batch: Any) -> Any:
    """The batch with every host tensor in page-locked memory; aliases stay aliases."""
    pinned: dict[int, torch.Tensor] = {}

    def pin(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu" or leaf.is_pinned():
            return leaf
        copy = pinned.get(id(leaf))
        if copy is None:
            copy = pinned[id(leaf)] = leaf.pin_memory()
        return copy

    return _walker.map(pin, batch)


class _Failure:
    """An exception raised in the background thread, carried to the consumer unchanged."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE: Final = object()


class _BackgroundFeed:
    """Iterates ``source`` in a daemon thread, ``prepare``-ing up to ``depth`` items ahead.

    The consumer gets the items in order, then the source's exception (the same object,
    with its traceback) if it raised. :meth:`close` stops the thread: it ends as soon as
    the item it is waiting for arrives, and never blocks on a full queue.
    """

    def __init__(self, source: Iterable[Any], prepare: Callable[[Any], Any], depth: int) -> None:
        self._items: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(source, prepare), name="devicekit-feed", daemon=True
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

    def _run(self, source: Iterable[Any], prepare: Callable[[Any], Any]) -> None:
        try:
            for item in source:
                if not self._put(prepare(item)):
                    return
        except BaseException as error:  # every failure goes to the consumer
            self._put(_Failure(error))
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = self._items.get()
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread and drop what it prepared; waits for it only briefly."""
        self._stop.set()
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:  # noqa: PERF203 - draining: the exception is how it ends
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_STOP_POLL_S * 2)

    @property
    def alive(self) -> bool:
        """Whether the thread is still running (it may be inside the source's next())."""
        return self._thread.is_alive()


class _StreamCopier:
    """Copies batches on one side stream ``prefetch`` ahead; hands them over safely."""

    def __init__(
        self, stream: torch.Stream, device: torch.device, non_blocking: NonBlocking
    ) -> None:
        self._stream = stream
        self._device = device
        self._non_blocking = non_blocking
        self._in_flight: collections.deque[tuple[Any, torch.Event]] = collections.deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    def consumer_moved_on(self) -> None:
        """Order the side stream after all the consumer queued so far (see the module doc)."""
        used = torch.Event(device=self._device)
        used.record(torch.accelerator.current_stream(self._device))
        self._stream.wait_event(used)

    def start_copy(self, batch: Any) -> None:
        with self._stream:
            moved = to_device(batch, self._device, non_blocking=self._non_blocking)
        ready = torch.Event(device=self._device)
        ready.record(self._stream)
        self._in_flight.append((moved, ready))

    def hand_over(self) -> Any:
        moved, ready = self._in_flight.popleft()
        torch.accelerator.current_stream(self._device).wait_event(ready)
        return moved

    def drop(self) -> None:
        self._in_flight.clear()


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

    Args:
        loader: What yields the batches: a :class:`~torch.utils.data.DataLoader`, a
            list, any re-iterable, or a function returning a fresh iterable each epoch.
        device: Where batches go; None for :func:`~devicekit.current_device`, read when
            each epoch starts.
        pin_memory: ``"auto"`` pins batches for an accelerator unless the wrapped
            DataLoader already does; True always pins; False never does.
        prefetch: How many batches are copied ahead on an accelerator; 0 moves each in
            line when it is asked for.
        non_blocking: Passed to :func:`~devicekit.to_device`.
        transform: Applied on the device to each batch before it is handed over (for
            example normalisation); its result is what the loop gets.

    Raises:
        ValueError: ``prefetch`` is negative or ``pin_memory`` is not True, False or "auto".
        TypeError: ``loader`` is neither iterable nor a function.
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
    ) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            msg = f"Expected prefetch to be a whole number of 0 or more, got {prefetch!r}."
            raise ValueError(msg)
        if pin_memory not in ("auto", True, False):
            msg = f"Expected pin_memory to be 'auto', True or False, got {pin_memory!r}."
            raise ValueError(msg)
        if not isinstance(loader, Iterable) and not callable(loader):  # for untyped callers
            msg = (  # type: ignore[unreachable]
                "Expected a loader to wrap: a DataLoader, a list or another re-iterable, or a "
                f"function returning an iterable, got {type(loader).__name__}."
            )
            raise TypeError(msg)
        self.loader = loader
        self._device = None if device is None else resolve_device(device)
        self._pin_memory = pin_memory
        self._prefetch = prefetch
        self._non_blocking = non_blocking
        self._transform = transform
        # One side stream per device this loader feeds, for its whole life, made on first use.
        self._streams: dict[torch.device, torch.Stream] = {}
        self._one_shot_used = False

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

    def _source(self) -> Iterable[Any]:
        if isinstance(self.loader, Iterable):
            source: Iterable[Any] = self.loader
        else:
            source = self.loader()
        if iter(source) is source:  # a one-shot iterator: a second epoch would be empty
            if self._one_shot_used:
                msg = (
                    f"Expected a re-iterable loader for a second epoch, but the wrapped "
                    f"{type(source).__name__} is an iterator that is used up. Wrap a list, a "
                    "DataLoader, or a function that returns a new iterable each epoch."
                )
                raise TypeError(msg)
            self._one_shot_used = isinstance(self.loader, Iterable)
        return source

    def _pins(self) -> bool:
        if self._pin_memory != "auto":
            return bool(self._pin_memory)
        return not bool(getattr(self.loader, "pin_memory", False))

    def __iter__(self) -> Iterator[B]:
        device = current_device() if self._device is None else self._device
        source = self._source()
        if self._prefetch == 0 or device.type not in _STREAM_DEVICE_TYPES:
            return self._in_line(source, device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.Stream(device=device)
        return self._ahead(source, device, stream)

    def _finish(self, batch: Any) -> Any:
        return batch if self._transform is None else self._transform(batch)

    def _in_line(self, source: Iterable[Any], device: torch.device) -> Iterator[B]:
        # The usual case gets a loop with nothing in it but the move: a call or a keyword
        # argument per batch is a measurable share of moving a small batch.
        if self._transform is None and self._non_blocking == "auto":
            for batch in source:
                yield to_device(batch, device)
            return
        non_blocking = self._non_blocking
        for batch in source:
            yield self._finish(to_device(batch, device, non_blocking=non_blocking))

    def _ahead(
        self, source: Iterable[Any], device: torch.device, stream: torch.Stream
    ) -> Iterator[B]:
        prepare = _pin if self._pins() else _unchanged
        feed = _BackgroundFeed(source, prepare, depth=self._prefetch)
        copier = _StreamCopier(stream, device, self._non_blocking)

        failure: list[Exception] = []  # raised by the source: surfaces in its place

        def top_up() -> None:
            while not failure and len(copier) < self._prefetch:
                try:
                    batch = next(feed, _DONE)
                except Exception as error:  # re-raised below, unchanged, in its place
                    failure.append(error)
                    return
                if batch is _DONE:
                    return
                copier.start_copy(batch)

        try:
            top_up()
            while len(copier):
                batch = copier.hand_over()
                top_up()  # the next copies run while the consumer's step does
                yield self._finish(batch)
                del batch
                copier.consumer_moved_on()
            if failure:
                raise failure[0]
        finally:
            # The end, an error, or a loop left early: the thread stops, the prefetched go.
            feed.close()
            copier.drop()


def _unchanged(batch: Any) -> Any:
    return batch
