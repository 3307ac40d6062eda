"""The stand-in's streams and events: CUDA's ordering rules, with every copy as late as they allow.

A real GPU runs the work queued on a stream some time after the host queued it, in the
stream's order, and only the program's own waits bound that time. Here the host runs it,
so the latest moment is chosen, every time:

- Work on the default stream that reads nothing the host may still change runs when it
  is issued, as it is in effect on a GPU (the host cannot look before a sync).
- A non-blocking copy, and any work issued while another stream is current, is queued.
  Queued work runs, in its stream's order, only when something waits for it: an event's
  or a stream's ``synchronize``, a ``wait_event`` or ``wait_stream`` followed by work on
  the waiting stream, ``torch.accelerator.synchronize``, a ``query`` that says done, a
  blocking read such as ``.cpu()`` or ``.item()``, or later work on the same stream.
- Until it runs, what it writes reads as poison (:func:`poison`), and a host buffer it
  reads is read when it runs: a buffer written meanwhile gives poison too, since a GPU
  would have read some mix of the old and new bytes.

So a forgotten wait gives NaNs on every run, not once in a thousand on a busy machine.
One lock (:data:`LOCK`) orders the queues of every thread, as a device orders the work
of every host thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from devicekit._base import privateuse1_number
from devicekit._memory import fill, filler_of

__all__ = ["LOCK", "Event", "Queue", "Stream", "poison", "queue_of", "streams_of"]

LOCK = threading.RLock()
"""Held while the stand-in runs or queues work: one device's order for every host thread."""

_DEFAULT_ID = 0
_ids = itertools.count(1)


def poison(tensor: torch.Tensor) -> None:
    """Fill a CPU tensor with what unwritten device memory reads as here.

    A float reads as a NaN; an integer as 0x5A in every byte (devicekit's filler); a
    bool as True.

    >>> values = torch.zeros(2); poison(values); values
    tensor([nan, nan])
    >>> steps = torch.zeros(1, dtype=torch.int32); poison(steps); hex(int(steps))
    '0x5a5a5a5a'
    """
    filler = filler_of(tensor.dtype)
    if filler is None:
        tensor.fill_(True)
    else:
        fill(tensor, filler)


@dataclasses.dataclass
class Queue:
    """The work issued to one stream that has not run: thunks, each with its number."""

    device: int
    stream_id: int
    pending: deque[tuple[int, Callable[[], None]]] = dataclasses.field(default_factory=deque)
    issued: int = 0
    """How many pieces of work were ever issued to it; an event records this number."""
    done: int = 0
    """How many have run, in order."""

    def issue(self, work: Callable[[], None]) -> int:
        """Queue ``work``; the number an event recorded now would wait for."""
        self.issued += 1
        self.pending.append((self.issued, work))
        return self.issued

    def run_to(self, number: int) -> None:
        """Run the queued work up to and including ``number``, in order."""
        while self.pending and self.pending[0][0] <= number:
            at, work = self.pending.popleft()
            self.done = at
            work()
        self.done = max(self.done, min(number, self.issued))

    def run_all(self) -> None:
        """Run everything queued."""
        self.run_to(self.issued)


_queues: dict[tuple[int, int], Queue] = {}
_current = threading.local()  # each host thread's current stream of each device, as CUDA's


def queue_of(device: int, stream_id: int = _DEFAULT_ID) -> Queue:
    """The queue of one stream of one device, made on first use."""
    key = (device, stream_id)
    found = _queues.get(key)
    if found is None:
        found = _queues[key] = Queue(device, stream_id)
    return found


def streams_of(device: int) -> list[Queue]:
    """Every stream of ``device`` that was used."""
    return [queue for (index, _), queue in list(_queues.items()) if index == device]


def current_queue(device: int) -> Queue:
    """The queue of this thread's current stream on ``device``."""
    ids: dict[int, int] = getattr(_current, "ids", {})
    return queue_of(device, ids.get(device, _DEFAULT_ID))


def set_current(device: int, stream_id: int) -> int:
    """Make a stream this thread's current one on ``device``; the one it replaces."""
    ids: dict[int, int] = _current.__dict__.setdefault("ids", {})
    before = ids.get(device, _DEFAULT_ID)
    ids[device] = stream_id
    return before


def synchronize_device(device: int) -> None:
    """Run everything queued on every stream of ``device`` (``synchronize()``)."""
    with LOCK:
        while any(queue.pending for queue in streams_of(device)):
            for queue in streams_of(device):
                queue.run_all()


class Stream(torch.Stream):
    """A stream of the stand-in: work issued while it is current runs only when waited for.

    Made as ``torch.<name>.Stream(device)`` (or found through
    ``torch.accelerator.current_stream()``), and used as CUDA's: ``with stream:``,
    ``wait_event``, ``wait_stream``, ``record_event``, ``query``, ``synchronize``.
    """

    _queue: Queue

    def __new__(cls, device: Any = None, priority: int = 0, *, stream_id: int | None = None) -> Any:
        from devicekit.testing._stand_in._device import index_of  # noqa: PLC0415 - a cycle

        index = index_of(device)
        sid = next(_ids) if stream_id is None else stream_id
        self = super().__new__(cls, stream_id=sid, device_index=index, device_type=_device_type())
        self._queue = queue_of(index, sid)
        return self

    def wait_event(self, event: Any) -> None:
        """Make work issued to this stream from now on wait for what ``event`` recorded."""
        if not isinstance(event, Event):
            return
        recorded = event.recorded
        if recorded is None:
            return  # an event never recorded is complete, as CUDA's is
        queue, number = recorded
        with LOCK:
            if queue is not self._queue:
                self._queue.issue(lambda: queue.run_to(number))

    def wait_stream(self, stream: Any) -> None:
        """Make work issued to this stream from now on wait for all issued to ``stream``."""
        event = Event()
        event.record(stream)
        self.wait_event(event)

    def record_event(self, event: Any = None) -> Event:
        """Record ``event`` (a new one when None) on this stream."""
        recorded: Event = Event() if event is None else event
        recorded.record(self)
        return recorded

    def query(self) -> bool:
        """Whether all work issued here has run; asking twice runs it, as time passing would."""
        return self.record_event().query()

    def synchronize(self) -> None:
        """Wait for everything issued to this stream."""
        with LOCK:
            self._queue.run_all()

    def __enter__(self) -> Stream:
        self._before = set_current(self._queue.device, self._queue.stream_id)
        return self

    def __exit__(self, *exc: object) -> None:
        set_current(self._queue.device, self._before)

    def __repr__(self) -> str:
        return f"<stand-in stream {self._queue.stream_id} on device {self._queue.device}>"


def stream_of(device: int, stream_id: int) -> Stream:
    """The :class:`Stream` object of an existing stream (the default one included)."""
    stream: Stream = Stream(device, stream_id=stream_id)
    return stream


class Event(torch.Event):
    """An event of the stand-in: marks a point in one stream's work.

    ``query()`` on work that has not run says False once, then runs it and says True: a
    loop that polls sees the copy still in flight, and still ends.
    """

    recorded: tuple[Queue, int] | None
    _asked: bool

    def __new__(cls, device: Any = None, *, enable_timing: bool = False, **_: Any) -> Any:
        self = super().__new__(cls, enable_timing=enable_timing)
        self.recorded = None
        self._asked = False
        return self

    def record(self, stream: Any = None) -> None:
        """Mark all work issued to ``stream`` (the current one when None) so far."""
        from devicekit.testing._stand_in._device import current_index  # noqa: PLC0415 - a cycle

        queue = stream._queue if isinstance(stream, Stream) else current_queue(current_index())
        with LOCK:
            self.recorded = (queue, queue.issued)
            self._asked = False

    def query(self) -> bool:
        """Whether the marked work has run; the second time it is asked, it has."""
        if self.recorded is None:
            return True
        queue, number = self.recorded
        with LOCK:
            if queue.done >= number:
                return True
            if not self._asked:
                self._asked = True
                return False
            queue.run_to(number)
        return True

    def synchronize(self) -> None:
        """Wait until the marked work has run."""
        if self.recorded is not None:
            queue, number = self.recorded
            with LOCK:
                queue.run_to(number)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (the current one when None) wait for the marked work."""
        from devicekit.testing._stand_in._device import current_index  # noqa: PLC0415 - a cycle

        waiting = stream if isinstance(stream, Stream) else current_stream(current_index())
        waiting.wait_event(self)

    def elapsed_time(self, end_event: Any) -> float:
        """0.0 ms: the stand-in models order, not time."""
        self.synchronize()
        end_event.synchronize()
        return 0.0


def current_stream(device: int) -> Stream:
    """This thread's current :class:`Stream` on ``device``."""
    queue = current_queue(device)
    return stream_of(device, queue.stream_id)


def _device_type() -> int:
    # PrivateUse1's number in torch's DeviceType enum: what a torch.Stream is made with.
    return privateuse1_number()


def pending_count() -> Iterator[Queue]:
    """Every queue with work not run (for the ledger at stop)."""
    return (queue for queue in list(_queues.values()) if queue.pending)
