"""How many CPUs this process may really use, and threads that each use one of them.

``os.cpu_count()`` is the host's: a container given 2 CPUs of a 64-core host sees 64,
and advice sized by it (``num_workers=32``) oversubscribes the 2. The kernel enforces
two limits: the affinity (which cores the scheduler may use) and the cgroup's quota
(cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``). The
smaller rules, rounded down and never below 1.

The loader's own threads (the feed, the pinning threads) run PyTorch's ops on one core
each, as PyTorch's pin-memory thread does, so that they never compete with the training
thread's intra-op threads: :func:`start_on_one_core`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Final

import torch

__all__ = ["cgroup_quota", "machine_cpus", "start_on_one_core"]

SETTLE_S: Final = 5.0
"""How long starting threads waits for them to set their count: a thread's first lines."""

CGROUP_ROOT = "/sys/fs/cgroup"
MEMBERSHIP = "/proc/self/cgroup"


def machine_cpus(root: str = CGROUP_ROOT, membership: str = MEMBERSHIP) -> int:
    """The CPUs this process may use: its affinity's count, within its cgroup's quota."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    quota = cgroup_quota(root, _read(membership))
    return cpus if quota is None else max(1, min(cpus, int(quota)))


def cgroup_quota(root: str, membership: str | None) -> float | None:
    """The CPUs the process's cgroup quota allows (2.5 for 250000 us of 100000), or None.

    ``membership`` is ``/proc/self/cgroup``'s text: a ``0::/path`` line for cgroup v2, a
    line naming the ``cpu`` controller for v1. The tightest limit of the process's cgroup
    and of each one above it counts; an unset (``max``, ``-1``) or unreadable one does not.

    >>> cgroup_quota("/nowhere", "0::/job") is None
    True
    """
    limits: list[float] = []
    for line in (membership or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: one hierarchy, cpu.max is "quota period"
            for folder in _folders(root, path):
                limits += _ratio(*(_read(os.path.join(folder, "cpu.max")) or "").split()[:2])
        elif "cpu" in controllers.split(","):  # cgroup v1: mounted as "cpu,cpuacct" or "cpu"
            mount = os.path.join(root, controllers)
            mount = mount if os.path.isdir(mount) else os.path.join(root, "cpu")
            for folder in _folders(mount, path):
                quota = _read(os.path.join(folder, "cpu.cfs_quota_us"))
                limits += _ratio(quota or "", _read(os.path.join(folder, "cpu.cfs_period_us")))
    return min(limits, default=None)


def _folders(mount: str, path: str) -> list[str]:
    """The cgroup's folder and each folder above it up to ``mount``: any may set the limit.

    Inside a container the path names the host's hierarchy, whose folders the container
    does not see: there, the mount (the container's own cgroup) is read.
    """
    parts = [part for part in path.split("/") if part]
    folders = [os.path.join(mount, *parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if os.path.isdir(folder)]


def _ratio(quota: str = "", period: str | None = None) -> list[float]:
    """``[quota / period]`` where both are positive whole numbers; ``[]`` where none is set."""
    try:
        value, per = int(quota), int(period or "")
    except ValueError:  # "max", an empty or unreadable file: no limit here
        return []
    return [value / per] if value > 0 and per > 0 else []


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def start_on_one_core(start: Callable[[Callable[[], None]], object], threads: int) -> None:
    """Start ``threads`` threads on one intra-op core each, leaving the process's count alone.

    ``start(settle)`` starts them, and each calls ``settle()`` before anything else. Its
    ``torch.set_num_threads(1)`` is the only way to one core, and it sets the count that
    every thread takes at its first parallel op (and MKL's): set there alone, it would
    leave later threads of the program on one core. So this thread's own count is
    settled first, and, once every new thread has set its own, set back for the rest.
    """
    count = torch.get_num_threads()  # this thread's, settled before any thread sets 1
    gate = threading.Barrier(threads + 1, timeout=SETTLE_S)

    def settle() -> None:
        # Its own count first, as every thread's first parallel op would take it: the
        # count set next then holds (taken after, it would be the process's, put back).
        torch.get_num_threads()
        torch.set_num_threads(1)
        with contextlib.suppress(threading.BrokenBarrierError):  # the starter gave up
            gate.wait()

    start(settle)
    with contextlib.suppress(threading.BrokenBarrierError):  # a thread that never began
        gate.wait()
    torch.set_num_threads(count)
