"""A feed: a daemon thread that reads a source a bounded number of items ahead.

The first stage of the pipeline that :mod:`devicekit._loader._loader` draws: while the training
thread works, the feed's thread iterates the wrapped loader's epoch and ``prepare``-s
(pins) each item. A room of its own because its one concern, a thread's life (what
reaches the consumer, and how the thread ends whatever the consumer does), holds for
any source; it knows nothing of copies, and is tested alone.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch

from devicekit._base import streams_to
from devicekit._loader._cpus import start_on_one_core

__all__ = ["NOT_READY", "STOP_POLL_S", "BackgroundFeed"]

# How often a thread blocked on the feed (its own on a full queue, the loop on an empty
# one, a read waiting for the last batch's copy) looks whether the feed was stopped.
STOP_POLL_S: Final = 0.1
# How long the interpreter's exit waits for the feeds still reading: one item's read,
# as DataLoader gives its workers to end (torch.utils.data's MP_STATUS_CHECK_INTERVAL).
EXIT_WAIT_S: Final = 5.0
NOT_READY: Final = object()
"""What :meth:`BackgroundFeed.ready` gives while the next item is still being read."""
_DONE: Final = object()


class BackgroundFeed:
    """Iterates ``batches`` in a daemon thread, ``prepare``-ing up to ``depth`` items ahead.

    The consumer gets the items in order, then the source's exception (the same object,
    with its traceback) if it raised; after either, the feed stays ended. :meth:`close`
    stops the thread: it ends as soon as the item it is waiting for arrives, and never
    blocks on a full queue; a consumer waiting for an item (in another thread) is woken,
    and ends as at the source's end, :attr:`closed_early` telling the two apart.
    :meth:`join` waits for the thread.
    """

    def __init__(
        self,
        batches: Iterator[Any],
        prepare: Callable[[Any], Any],
        depth: int,
        device: torch.device | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self._items: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        # Given: the event a ``prepare`` that waits (for pinned memory) watches too.
        self._stop = threading.Event() if stop is None else stop
        self._ended = False
        self.closed_early = False  # closed before the source's end reached the consumer
        self._error: BaseException | None = None  # the source's, raised after its items
        self._device = device
        # A daemon: a thread stuck in the source (a worker blocked on I/O) never holds
        # up the interpreter's exit.
        self._thread = threading.Thread(
            target=self._run, args=(batches, prepare), name="devicekit-feed", daemon=True
        )
        _running.add(self)
        self._settle: Callable[[], None] = lambda: None
        start_on_one_core(self._start, 1)

    def _start(self, settle: Callable[[], None]) -> None:
        self._settle = settle
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._items.put(item, timeout=STOP_POLL_S)
            except queue.Full:
                continue
            return True
        return False

    def _run(self, batches: Iterator[Any], prepare: Callable[[Any], Any]) -> None:
        # Set up as PyTorch's pin-memory thread is: pinning copies take one core (the
        # setting is the thread's own), and allocations go to the loader's device.
        self._settle()
        device = self._device
        if device is not None and device.index is not None and streams_to(device):
            torch.accelerator.set_device_index(device.index)
        try:
            for item in batches:
                if not self._put(prepare(item)):
                    return
        except BaseException as error:  # every failure goes to the consumer
            self._error = error
        finally:
            _running.discard(self)
        self._put(_DONE)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while not self._ended:  # close() from another thread ends the wait
            try:
                item = self._items.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            return self._received(item)
        raise StopIteration

    def ready(self) -> Any:
        """The next item where the thread has it already, else ``NOT_READY``; never waits.

        Raises:
            StopIteration: The source ended.
            Exception: What the source raised, in its place.
        """
        if self._ended:
            raise StopIteration
        try:
            item = self._items.get_nowait()
        except queue.Empty:
            return NOT_READY
        return self._received(item)

    def _received(self, item: Any) -> Any:
        """A batch as taken from the thread; its end or its source's error, raised here."""
        if item is not _DONE:
            return item
        self._end()
        error, self._error = self._error, None  # held by the raise alone, as a batch is
        if error is not None:
            raise error
        raise StopIteration

    def close(self) -> None:
        """Tell the thread to stop and drop what it prepared; does not wait for it."""
        if not self._ended:
            self.closed_early = True
        self._end()

    def _end(self) -> None:
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


# The feeds whose threads run, so that the interpreter's exit can stop them.
_running: set[BackgroundFeed] = set()


@atexit.register
def _stop_at_exit() -> None:
    """Stop every feed, and wait (a bounded time) for those inside their source to leave it.

    A daemon thread still inside PyTorch's C++ code when the interpreter finalises is
    ended mid-call, and the process aborts ("terminate called without an active
    exception", status -6 for a loop that called ``sys.exit(3)``). Exit handlers run
    before that, while threads still run: the feed that finishes its read returns, and
    one stuck in its source past :data:`EXIT_WAIT_S` is left to end with the process.
    """
    feeds = list(_running)
    for feed in feeds:
        feed.close()
    deadline = time.monotonic() + EXIT_WAIT_S
    for feed in feeds:
        feed.join(max(0.0, deadline - time.monotonic()))
