"""A thread lock that no fork can leave held.

The one mechanism NVML's reading, the claims table and the manager's count of blocks
share. A lock some thread holds when the process forks stays held in the child for good: that
thread does not exist there to let go. So the forking thread takes the lock around each
fork (no other thread is then inside it), and the child gets a new one.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A thread lock, reentrant where asked, held across every fork.

    Its fork handlers are registered as it is made: of two such locks, the one made later
    is taken first before a fork (as ``os.register_at_fork`` orders them), so a thread
    that takes them in that order too never waits on the forking thread for ever.

    >>> lock = ForkSafeLock()
    >>> with lock:
    ...     lock.locked()
    True
    >>> lock.locked()
    False
    """

    __slots__ = ("_lock", "_reentrant")

    def __init__(self, *, reentrant: bool = False) -> None:
        self._reentrant = reentrant
        self._lock = self._new()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(
                before=self.acquire, after_in_parent=self.release, after_in_child=self._renew
            )

    def _new(self) -> threading.Lock | threading.RLock:
        return threading.RLock() if self._reentrant else threading.Lock()

    def _renew(self) -> None:
        self._lock = self._new()  # the child's own, free

    def acquire(self) -> None:
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        """Whether a thread holds it (a reentrant one's owner may take it again, though)."""
        if not self._lock.acquire(blocking=False):
            return True
        self._lock.release()
        return False

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._lock.release()
