"""A GPU server shared with other jobs: busy GPUs, waiting for one, claims, torchrun ranks.

GPUs are fakes (tests/fakes.py), and waiting runs on a fake clock; the claims are real
file locks in a directory of the test's own, taken by real processes where it matters.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import torch

import devicekit as dk
from devicekit._base import _units
from devicekit._core import _transfer
from devicekit._select import _claims, _file_locks, _manager, _nvml
from devicekit._select._backends import CpuBackend
from devicekit.cli import _info_json, _info_table

from .fakes import FakeGpus
from .helpers import CPU, GiB, cuda
from .programs import run_program

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def own_claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A claim directory for this test alone, and managers' claims given back after it."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "DEVICEKIT_DEVICE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    directory = tmp_path / "claims"
    monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", str(directory))
    _manager._fallback_warned.set()  # the fallback's one warning is test_manager.py's
    yield directory
    for claim in list(_claims._taken.values()):
        while claim.key in _claims._taken:
            claim.release()
    _manager._fallback_warned.clear()


class FakeClock:
    """time.monotonic and time.sleep for a manager that waits: sleeping moves time on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep: list[Any] = []  # called after each sleep, with the sleep's number
        monkeypatch.setattr(_manager, "_clock", lambda: self.now)
        monkeypatch.setattr(_manager, "_sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        for action in self.on_sleep:
            action(len(self.sleeps))


def server(
    free: tuple[float, ...] = (70, 70), busy: tuple[float | None, ...] = ()
) -> tuple[FakeGpus, list[object]]:
    gpus = FakeGpus(free, busy=busy)
    return gpus, [gpus, CpuBackend()]


# Busy GPUs.


def test_max_utilization_passes_over_busy_gpus() -> None:
    _, backends = server(busy=(0.97, 0.10))
    manager = dk.DeviceManager(max_utilization=0.5, backends=backends)
    assert manager.device == cuda(1)
    assert "Skipped cuda:0: 97% busy, more than the 50% max_utilization allows." in (
        manager.explain()
    )


def test_utilization_unknown_is_kept_as_free_memory_unknown_is() -> None:
    _, backends = server(busy=(None, 0.9))
    assert dk.DeviceManager(max_utilization=0.5, backends=backends).device == cuda(0)


def test_max_utilization_and_min_free_memory_must_both_hold() -> None:
    # cuda:0 is idle but full, cuda:1 has room but is busy, cuda:2 has both.
    gpus = FakeGpus((2, 70, 40), busy=(0.0, 0.9, 0.2))
    manager = dk.DeviceManager(
        min_free_memory="8GiB", max_utilization=0.5, backends=[gpus, CpuBackend()]
    )
    assert manager.device == cuda(2)
    explained = manager.explain()
    assert "Skipped cuda:0: 2.0 GiB free of 80.0 GiB, less than the 8.0 GiB" in explained
    assert "Skipped cuda:1: 90% busy, more than the 50% max_utilization allows." in explained
    # With neither qualifying, the fallback names both reasons.
    gpus.free = (2, 70, 40)
    gpus.busy = (0.0, 0.9, 0.6)
    fallen = dk.DeviceManager(
        min_free_memory="8GiB", max_utilization=0.5, backends=[gpus, CpuBackend()]
    )
    assert fallen.device == CPU
    assert "Skipped cuda:2: 60% busy, more than the 50% max_utilization allows." in (
        fallen.explain()
    )


def test_explain_names_the_processes_on_a_gpu_it_passed_over() -> None:
    gpus = FakeGpus(
        (1, 70),
        processes={0: (dk.GpuProcess(4242, 31 * GiB), dk.GpuProcess(77, None))},
    )
    manager = dk.DeviceManager(min_free_memory="8GiB", backends=[gpus, CpuBackend()])
    assert manager.device == cuda(1)
    assert (
        "Skipped cuda:0: 1.0 GiB free of 80.0 GiB, less than the 8.0 GiB min_free_memory asks "
        "(31.0 GiB used by pid 4242 and used by pid 77)."
    ) in manager.explain()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_utilization": -0.1}, ValueError, "Expected max_utilization between 0 and 1, got"),
        (
            {"max_utilization": 50},
            ValueError,
            "Expected max_utilization between 0 and 1 (a share: 0.5 is 50%), got 50.",
        ),
        ({"max_utilization": "50%"}, ValueError, "Expected max_utilization between 0 and 1, got"),
        ({"max_utilization": True}, ValueError, "Expected max_utilization between 0 and 1, got"),
        ({"wait": -5}, ValueError, "Expected wait as a number of seconds of 0 or more"),
        ({"wait": "10 parsecs"}, ValueError, "such as '90s', '10m' or '1.5h', got '10 parsecs'."),
        ({"wait": float("inf")}, ValueError, "Expected wait as a number of seconds"),
        ({"wait": float("nan")}, ValueError, "Expected wait as a number of seconds"),
        ({"wait": True}, ValueError, "Expected wait as a number of seconds"),
        ({"claim": "yes"}, TypeError, "Expected claim to be True or False, got 'yes'."),
    ],
)
def test_bad_values_are_clear_errors(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        dk.DeviceManager(backends=server()[1], **options)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (0, 0.0),
        (90, 90.0),
        (2.5, 2.5),
        ("45", 45.0),
        ("90s", 90.0),
        ("10m", 600.0),
        ("10 min", 600.0),
        ("1.5h", 5400.0),
        ("2 hours", 7200.0),
        (" 3 Minutes ", 180.0),
    ],
)
def test_durations_read_as_people_write_them(text: float | str, seconds: float) -> None:
    assert _units.parse_seconds(text) == seconds


# Waiting.


def test_wait_returns_as_soon_as_a_gpu_qualifies(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(monkeypatch)
    gpus, backends = server(busy=(0.95, 0.99))

    def frees_after_the_second_poll(sleeps: int) -> None:
        if sleeps == 2:
            gpus.busy = (0.95, 0.05)

    clock.on_sleep.append(frees_after_the_second_poll)
    with caplog.at_level(logging.WARNING, logger="devicekit"):
        manager = dk.DeviceManager(max_utilization=0.5, wait="10m", backends=backends)
    assert manager.device == cuda(1)
    assert clock.sleeps == [1.0, 2.0]  # the backoff, and not one poll more
    waits = [record.getMessage() for record in caplog.records]
    assert len(waits) == 1, waits  # said once, not once a poll
    assert waits[0].startswith("devicekit waits up to 10 min for a device: no cuda, xpu or mps")
    assert "cuda:0: 95% busy" in waits[0]
    assert "cuda:1: 99% busy" in waits[0]


def test_a_wait_that_times_out_falls_back_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock(monkeypatch)
    _, backends = server(busy=(0.9, 0.9))
    manager = dk.DeviceManager(max_utilization=0.5, wait=100, backends=backends)
    assert manager.device == CPU
    assert sum(clock.sleeps) == 100  # the last pause is cut to the time left
    assert clock.sleeps[:3] == [1.0, 2.0, 4.0]
    assert max(clock.sleeps) == 30.0
    assert manager.reason == (
        "no cuda, xpu or mps device is usable after waiting 100 s, so the CPU is the fallback"
    )
    with pytest.raises(dk.DeviceUnavailableError) as raised:
        dk.DeviceManager(max_utilization=0.5, wait="1m", fallback="error", backends=backends)
    assert "no cuda, xpu or mps device is usable after waiting 60 s." in str(raised.value)
    assert "Passed over cuda:0: 90% busy, more than the 50% max_utilization allows." in str(
        raised.value
    )


@pytest.mark.parametrize(
    "backends",
    [
        [FakeGpus((), note="this PyTorch build has no CUDA support"), CpuBackend()],
        [CpuBackend()],
    ],
    ids=["build-without-cuda", "no-backend"],
)
def test_no_wait_for_a_device_family_that_cannot_appear(
    monkeypatch: pytest.MonkeyPatch, backends: list[object]
) -> None:
    # Waiting frees busy or claimed GPUs; a build or machine without any has nothing to
    # wait for: two hours of it, on a PyTorch without CUDA, would be two hours lost.
    clock = FakeClock(monkeypatch)
    manager = dk.DeviceManager(wait="2h", backends=backends)
    assert manager.device == CPU
    assert clock.sleeps == []
    assert "wait= has nothing to wait for" in manager.reason
    with pytest.raises(dk.DeviceUnavailableError, match="wait= has nothing to wait for"):
        dk.DeviceManager(wait="2h", fallback="error", backends=backends)
    assert clock.sleeps == []


def test_no_wait_when_a_gpu_qualifies_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    manager = dk.DeviceManager(wait="1h", backends=server()[1])
    assert manager.device == cuda(0)
    assert clock.sleeps == []


# Claims.


class AnotherJob:
    """A claim of another job on ``key``: a lock through an open file of its own.

    Locks of two open files conflict as locks of two processes do, so this stands in
    for another job without starting one; ``pid`` is what that job wrote in the file.
    """

    def __init__(self, directory: Path, key: str, pid: int = 4242) -> None:
        directory.mkdir(exist_ok=True)
        self.path = directory / f"{key}.lock"
        self.descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        self.holds = _try_lock(self.descriptor)
        if self.holds:
            os.ftruncate(self.descriptor, 0)
            os.write(self.descriptor, f"{pid}\n".encode())

    def release(self) -> None:
        os.close(self.descriptor)


def _try_lock(descriptor: int) -> bool:
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def claimed(directory: Path, key: str) -> bool:
    """Whether some holder (this process included) claims ``key``: another job cannot."""
    job = AnotherJob(directory, key)
    job.release()
    return not job.holds


def test_claiming_jobs_end_on_different_gpus_and_close_gives_back(own_claims: Path) -> None:
    _, backends = server()
    other = AnotherJob(own_claims, "GPU-0000")
    manager = dk.DeviceManager(claim=True, backends=backends)
    assert manager.device == cuda(1)
    assert manager.reason.endswith("; claimed for this process")
    assert "Skipped cuda:0: claimed by pid 4242." in manager.explain()
    assert sorted(path.name for path in own_claims.iterdir()) == [
        "GPU-0000.lock",
        "GPU-0001.lock",
    ]
    assert (own_claims / "GPU-0001.lock").read_text() == f"{os.getpid()}\n"
    # A manager that does not claim ignores claims: they are advisory.
    assert dk.DeviceManager(backends=backends).device == cuda(0)
    other.release()
    manager.close()
    manager.close()  # a second close does nothing
    assert not claimed(own_claims, "GPU-0001")


def test_a_process_that_claims_twice_gets_two_gpus(own_claims: Path) -> None:
    # A notebook cell run twice, or two parts of a program: each manager wants a GPU.
    _, backends = server()
    first = dk.DeviceManager(claim=True, backends=backends)
    second = dk.DeviceManager(claim=True, backends=backends)
    assert (first.device, second.device) == (cuda(0), cuda(1))
    assert "Skipped cuda:0: claimed by this process (another of its managers)." in (
        second.explain()
    )
    third = dk.DeviceManager(claim=True, backends=backends)
    assert third.device == CPU
    assert "Skipped cuda:1: claimed by this process (another of its managers)." in (third.explain())
    # To keep one GPU: close the manager before making the next one (or leave its block).
    first.close()
    again = dk.DeviceManager(claim=True, backends=backends)
    assert again.device == cuda(0)
    with dk.DeviceManager(claim=True, backends=backends) as scoped:
        assert scoped.device == CPU  # both taken, by `second` and `again`
    second.close()
    with dk.DeviceManager(claim=True, backends=backends) as scoped:
        assert scoped.device == cuda(1)
    with dk.DeviceManager(claim=True, backends=backends) as scoped:
        assert scoped.device == cuda(1)  # the block before gave it back
    again.close()
    assert not claimed(own_claims, "GPU-0000")
    assert not claimed(own_claims, "GPU-0001")


def test_managers_that_name_a_gpu_share_this_process_s_claim(own_claims: Path) -> None:
    _, backends = server()
    chosen = dk.DeviceManager(claim=True, backends=backends)
    named = dk.DeviceManager("cuda:0", claim=True, backends=backends)
    by_index = dk.DeviceManager(0, claim=True, backends=backends)
    assert chosen.device == named.device == by_index.device == cuda(0)
    assert "Skipped" not in named.explain()
    assert [path.name for path in own_claims.iterdir()] == ["GPU-0000.lock"]
    chosen.close()
    by_index.close()
    assert claimed(own_claims, "GPU-0000")  # the named one still holds it
    named.close()
    assert not claimed(own_claims, "GPU-0000")
    # Two GPUs for one process, named.
    both = [dk.DeviceManager(f"cuda:{i}", claim=True, backends=backends) for i in (0, 1)]
    assert claimed(own_claims, "GPU-0000")
    assert claimed(own_claims, "GPU-0001")
    for manager in both:
        manager.close()


def test_a_rank_s_managers_share_its_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher names the rank's GPU: every manager of the rank's process uses it.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    _, backends = server()
    first = dk.DeviceManager.from_env(claim=True, backends=backends)
    second = dk.DeviceManager.from_env(claim=True, backends=backends)
    assert first.device == second.device == cuda(1)
    assert "Skipped" not in second.explain()


def test_entering_again_after_this_process_claimed_the_gpu_elsewhere_is_refused(
    own_claims: Path,
) -> None:
    _, backends = server(free=(70,))
    with dk.DeviceManager(claim=True, backends=backends) as manager:
        assert manager.device == cuda(0)
    other = dk.DeviceManager(claim=True, backends=backends)
    assert other.device == cuda(0)
    with pytest.raises(dk.DeviceUnavailableError) as raised, manager:
        pass
    assert str(raised.value).startswith(
        "Cannot claim cuda:0 again on entering `with manager:`: this process (another of its "
        "managers) claimed it after"
    )
    other.close()


@pytest.mark.usefixtures("watchdog")
def test_two_threads_claiming_at_once_get_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _, backends = server()
    both_chose = threading.Barrier(2, timeout=5)
    take = _claims.take
    past_the_race: set[int] = set()

    def after_both_chose(key: str, **options: Any) -> _claims.Claim | None:
        if threading.get_ident() not in past_the_race:  # each thread's first claim
            past_the_race.add(threading.get_ident())
            both_chose.wait()  # both have looked and chosen: the race, every time
        return take(key, **options)

    monkeypatch.setattr(_claims, "take", after_both_chose)
    managers: list[dk.DeviceManager] = []
    threads = [
        threading.Thread(
            target=lambda: managers.append(dk.DeviceManager(claim=True, backends=backends))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(str(manager.device) for manager in managers) == ["cuda:0", "cuda:1"]


def test_a_claim_outlives_its_manager_object(own_claims: Path) -> None:
    _, backends = server(free=(70,))
    device = dk.DeviceManager(claim=True, backends=backends).device  # the manager is gone
    assert device == cuda(0)
    assert claimed(own_claims, "GPU-0000")


def test_leaving_with_gives_the_claim_back_and_entering_takes_it_again(own_claims: Path) -> None:
    _, backends = server()
    with dk.DeviceManager(claim=True, backends=backends) as manager:
        with manager:  # nested: the outer block still holds it
            assert manager.device == cuda(0)
        assert claimed(own_claims, "GPU-0000")
    assert not claimed(own_claims, "GPU-0000")
    with manager:
        assert claimed(own_claims, "GPU-0000")
    other = AnotherJob(own_claims, "GPU-0000")
    with pytest.raises(dk.DeviceUnavailableError) as raised, manager:
        pass
    assert str(raised.value).startswith(
        "Cannot claim cuda:0 again on entering `with manager:`: pid 4242 claimed it after"
    )
    other.release()


@pytest.mark.usefixtures("watchdog")
def test_a_claim_is_held_until_the_last_thread_leaves_its_block(own_claims: Path) -> None:
    _, backends = server(free=(70,))
    manager = dk.DeviceManager(claim=True, backends=backends)
    entered, leave = threading.Event(), threading.Event()

    def in_a_block() -> None:
        with manager:
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=in_a_block)
    thread.start()
    try:
        assert entered.wait(10)
        with manager:
            pass
        # The other thread is inside its block still: no other job may take the GPU.
        assert claimed(own_claims, "GPU-0000")
    finally:
        leave.set()
        thread.join(10)
    assert not thread.is_alive()
    assert not claimed(own_claims, "GPU-0000")  # the last block gave it back


def test_an_explicit_device_that_another_job_claims_is_refused(own_claims: Path) -> None:
    _, backends = server()
    other = AnotherJob(own_claims, "GPU-0001")
    with pytest.raises(dk.DeviceUnavailableError) as raised:
        dk.DeviceManager("cuda:1", claim=True, backends=backends)
    assert str(raised.value) == "Cannot claim cuda:1, asked for as 'cuda:1': pid 4242 claims it."
    other.release()


def test_a_claim_lost_in_a_race_is_looked_at_again(
    own_claims: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between the look and the claim another job takes cuda:0: the manager takes cuda:1.
    _, backends = server()
    take = _claims.take
    others: list[AnotherJob] = []

    def another_job_first(key: str, **options: Any) -> _claims.Claim | None:
        if not others:
            others.append(AnotherJob(own_claims, key))
        return take(key, **options)

    monkeypatch.setattr(_claims, "take", another_job_first)
    assert dk.DeviceManager(claim=True, backends=backends).device == cuda(1)
    assert others[0].holds
    others[0].release()


class HeldLook:
    """A look at the claims caught halfway, as a look whose process stops there would be.

    ``kind`` says whose: ``devicekit info`` here, in a thread (wherever it locks a claim
    file, it keeps the lock until let go), the same where the kernel answers fewer
    questions about locks (see ``kernel_answers``), or an older devicekit's, which looked
    with a shared lock.
    """

    def __init__(self, kind: str, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go_on = threading.Event()
        self.shared: int | None = None
        if kind == "an older devicekit's look":
            self.go_on.set()  # no thread: its lock is held through a file of its own
            self.shared = os.open(directory / "GPU-0000.lock", os.O_RDONLY)
            fcntl.flock(self.shared, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        kernel_answers(kind.removeprefix("devicekit info, "), directory, monkeypatch)
        real_flock, paused = fcntl.flock, threading.Event()

        def flock(descriptor: int, operation: int) -> None:
            real_flock(descriptor, operation)
            if threading.current_thread() is self.looker and operation & fcntl.LOCK_SH:
                paused.set()
                self.go_on.wait(5)

        def look() -> None:
            try:
                _info_table(dk.DeviceManager(backends=server(free=(70,))[1]))
            finally:
                paused.set()

        monkeypatch.setattr(fcntl, "flock", flock)
        self.looker = threading.Thread(target=look)
        self.looker.start()
        paused.wait(5)  # the look holds what it took, or finished without taking anything

    def end(self) -> None:
        if self.shared is not None:
            os.close(self.shared)  # closing drops the lock
            self.shared = None
        elif not self.go_on.is_set():
            self.go_on.set()
            self.looker.join(5)


def kernel_answers(what: str, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the kernel answer what it does where ``what`` says.

    ``"everything"``: Linux; ``"no lock table"``: Linux without ``/proc/locks``;
    ``"a lock table that hides the claim"``: ``/proc/locks`` read in another container
    (PID namespace) than the claim's; ``"no open-file locks"``: Linux before 3.15 (the
    table only); ``"nothing"``: macOS, where only a lock tells.
    """
    if what in ("no lock table", "nothing"):
        monkeypatch.setattr(_file_locks, "_LOCK_TABLE", str(directory.parent / "no-such-table"))
    if what == "a lock table that hides the claim":
        (directory.parent / "empty-table").touch()
        monkeypatch.setattr(_file_locks, "_LOCK_TABLE", str(directory.parent / "empty-table"))
    if what in ("no open-file locks", "nothing"):
        monkeypatch.setattr(_file_locks, "_OFD", False, raising=False)


@pytest.mark.usefixtures("watchdog")
@pytest.mark.parametrize(
    ("kind", "waits"),
    [
        ("devicekit info, everything", False),
        ("devicekit info, no lock table", False),
        ("devicekit info, no open-file locks", False),
        ("devicekit info, nothing", True),
        ("an older devicekit's look", True),
    ],
)
def test_a_look_never_makes_a_free_gpu_look_claimed(
    own_claims: Path, monkeypatch: pytest.MonkeyPatch, kind: str, waits: bool
) -> None:
    _, backends = server(free=(70,))
    dk.DeviceManager(claim=True, backends=backends).close()  # the file stays, as after any job
    look = HeldLook(kind, own_claims, monkeypatch)
    pauses: list[float] = []

    def pause(seconds: float) -> None:  # the claim tries again: the look ends meanwhile
        pauses.append(seconds)
        look.end()

    monkeypatch.setattr(_file_locks, "_pause", pause, raising=False)
    try:
        manager = dk.DeviceManager(claim=True, fallback="error", backends=backends)
    finally:
        look.end()
    assert manager.device == cuda(0)
    # Where the kernel answers about locks, looking takes none, and a claim never waits.
    assert len(pauses) == (1 if waits else 0)


class ClaimingJob:
    """Another job, forked from this one: it claims ``key`` with this devicekit and forks
    a worker that ends at once (closing its copies of the claim), then holds the claim
    until :meth:`end` (its exit) or :meth:`kill` (``kill -9``). Run under the watchdog."""

    def __init__(self, key: str) -> None:
        told, self._tell = os.pipe()
        self._hold, held = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: forks with threads
            self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the job
            try:
                os.close(told)
                os.close(held)
                claim = _claims.take(key)
                worker = os.fork()
                if worker == 0:
                    os._exit(0)
                os.waitpid(worker, 0)
                os.write(self._tell, b"claimed" if claim is not None else b"refused")
                os.read(self._hold, 1)  # until the test ends it, or ends itself
            finally:
                os._exit(0)
        os.close(self._tell)
        os.close(self._hold)
        self._held = held
        with os.fdopen(told, "rb") as pipe:
            said = pipe.read(7)
        if said != b"claimed":
            self.kill()
            raise AssertionError(f"the job forked to claim {key} said {said!r}")

    def kill(self) -> None:
        """``kill -9``: no close, no atexit; the OS alone lets go."""
        if self._held >= 0:
            os.kill(self.pid, signal.SIGKILL)
            self.end()

    def end(self) -> None:
        if self._held >= 0:
            os.close(self._held)
            self._held = -1
            os.waitpid(self.pid, 0)


def write_locked(path: Path) -> bool:
    """Whether a write lock of fcntl's (which a claim adds to its flock) is on ``path``.

    Told by trying a read lock of this process's own (POSIX locks of a process conflict
    with a write lock of any other open file), without devicekit's code.
    """
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(descriptor)  # drops the read lock just taken
    return False


_OLDER = "an older devicekit's claim"


@pytest.mark.usefixtures("watchdog")
@pytest.mark.parametrize(
    ("claim", "answers", "named", "waits"),
    [
        ("a claim", "everything", True, False),
        ("a claim", "a lock table that hides the claim", True, False),
        ("a claim", "no lock table", True, False),
        ("a claim", "no open-file locks", True, False),
        ("a claim", "nothing", True, True),
        (_OLDER, "everything", True, False),
        (_OLDER, "a lock table that hides the claim", False, True),
        (_OLDER, "no lock table", False, True),
        (_OLDER, "no open-file locks", True, False),
        (_OLDER, "nothing", True, True),
    ],
)
def test_a_claim_is_still_a_claim_to_the_look_and_to_claiming(
    own_claims: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    claim: str,
    answers: str,
    named: bool,
    waits: bool,
) -> None:
    # A claim of this devicekit's is named, and refused at once, wherever the kernel
    # answers whether a claim's write lock is on the file: also where the table of locks
    # hides it (another container's claim). An older devicekit's claim holds a flock
    # alone: the table shows it to a look in the same container, and only a lock tells
    # where there is no table, while a claim meeting it cannot tell it from a look.
    own_claims.mkdir()
    other = AnotherJob(own_claims, "GPU-0000") if claim == _OLDER else ClaimingJob("GPU-0000")
    pid = 4242 if isinstance(other, AnotherJob) else other.pid
    try:
        kernel_answers(answers, own_claims, monkeypatch)
        pauses: list[float] = []
        monkeypatch.setattr(_file_locks, "_pause", pauses.append)
        found = _claims.holders(["GPU-0000", "GPU-0001"])
        assert found == ({"GPU-0000": _claims.Holder(pid)} if named else {})
        assert _claims.take("GPU-0000") is None  # what a claim meets, chosen before it was taken
        # A claim that cannot tell a look from a claim tries for a moment; none else waits.
        assert sum(pauses) >= _file_locks._LOOK_S if waits else pauses == []
        manager = dk.DeviceManager(claim=True, backends=server()[1])
        assert manager.device == cuda(1)
        assert (f"Skipped cuda:0: claimed by pid {pid}." in manager.explain()) == named
        assert (f"pid {pid}" in _info_table(dk.DeviceManager(backends=server()[1]))) == named
    finally:
        if isinstance(other, ClaimingJob):
            other.end()
        else:
            other.release()


_LOOK_FROM_ANOTHER_CONTAINER = """
import json, os, sys
sys.path.insert(0, {root!r})
import devicekit as dk
from devicekit._select import _claims
from devicekit._select import _file_locks
from devicekit._select._backends import CpuBackend
from devicekit.cli import _info_table
from tests.fakes import FakeGpus
claim_file = os.stat({path!r})
pauses = []
_file_locks._pause = pauses.append
found = _claims.holders(["GPU-0000"])
refused = _claims.take("GPU-0000") is None
manager = dk.DeviceManager(claim=True, backends=[FakeGpus((70, 70)), CpuBackend()])
print(json.dumps({{
    "table hides its flock": not [
        line for line in open("/proc/locks").read().splitlines()
        if " FLOCK " in line and line.split()[5].endswith(f":{{claim_file.st_ino}}")
    ],
    "holders": {{key: holder.pid for key, holder in found.items()}},
    "refused": refused,
    "pauses": pauses,
    "device": str(manager.device),
    "explain": manager.explain(),
    "info": _info_table(dk.DeviceManager(backends=[FakeGpus((70, 70)), CpuBackend()])),
}}))
"""


def _pid_namespaces() -> bool:
    """Whether this process may start a program in a PID namespace of its own (root may)."""
    if shutil.which("unshare") is None:
        return False
    command = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(command, capture_output=True, check=False, timeout=60).returncode == 0


@pytest.mark.skipif(not _pid_namespaces(), reason="needs unshare --pid (root, or user namespaces)")
def test_a_claim_of_a_job_in_another_container_is_named_and_refused_at_once(
    own_claims: Path,
    fresh_python: str,
) -> None:
    # The look runs in a PID namespace of its own, with its own /proc, as a job in
    # another container sharing the claim directory would: since Linux 4.9 its
    # /proc/locks leaves out this process's flock. The kernel still answers whether a
    # claim's write lock is on the file. (A program with run_program's time limit.)
    claim = _claims.take("GPU-0000")
    assert claim is not None
    try:
        code = _LOOK_FROM_ANOTHER_CONTAINER.format(root=str(ROOT), path=str(claim.path))
        command = ["unshare", "--pid", "--fork", "--mount-proc", fresh_python, "-c", code]
        result = run_program(command, timeout=120)
    finally:
        claim.release()
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    if not seen["table hides its flock"]:
        pytest.skip("this kernel's /proc/locks shows flocks of other PID namespaces")
    assert seen["holders"] == {"GPU-0000": os.getpid()}
    assert seen["refused"]
    assert seen["pauses"] == []  # refused at once: never taken for a look
    assert seen["device"] == "cuda:1"
    assert f"Skipped cuda:0: claimed by pid {os.getpid()}." in seen["explain"]
    assert f"pid {os.getpid()}" in seen["info"]


@pytest.mark.usefixtures("watchdog")
@pytest.mark.skipif(not hasattr(fcntl, "F_OFD_GETLK"), reason="Linux's open-file locks")
def test_a_claim_s_write_lock_is_read_back_as_the_kernel_wrote_it(own_claims: Path) -> None:
    # The struct flock devicekit packs is the kernel's: asked about a claim from another
    # open file, the kernel fills in a write lock over the whole file, of no one process.
    claim = _claims.take("GPU-0000")
    assert claim is not None
    descriptor = os.open(claim.path, os.O_RDONLY)
    try:
        asked = _file_locks._FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
        answer = fcntl.fcntl(descriptor, fcntl.F_OFD_GETLK, asked)
        assert _file_locks._FLOCK.unpack(answer) == (fcntl.F_WRLCK, os.SEEK_SET, 0, 0, -1)
        assert _file_locks._write_locked(descriptor) is True
        assert write_locked(claim.path)
        claim.release()
        assert _file_locks._write_locked(descriptor) is False
        assert not write_locked(claim.path)
    finally:
        os.close(descriptor)
    if os.uname().machine in ("x86_64", "aarch64"):
        assert _file_locks._FLOCK.size == 32


@pytest.mark.usefixtures("watchdog")
def test_a_forked_worker_s_exit_leaves_the_claim_whole_and_kill_9_frees_it(
    own_claims: Path,
) -> None:
    job = ClaimingJob("GPU-0000")  # its worker has ended, closing its copies of the claim
    path = own_claims / "GPU-0000.lock"
    try:
        assert claimed(own_claims, "GPU-0000")  # the flock
        assert write_locked(path) == hasattr(fcntl, "F_OFD_GETLK")  # and the write lock
        assert _claims.holders(["GPU-0000"]) == {"GPU-0000": _claims.Holder(job.pid)}
        job.kill()
        assert not claimed(own_claims, "GPU-0000")
        assert not write_locked(path)
        assert _claims.holders(["GPU-0000"]) == {}
        assert _claims.take("GPU-0000") is not None
    finally:
        job.kill()


def _owner(uid: int) -> str:
    """How a message names the owner of a claim file this user cannot open."""
    try:
        who = f"user {pwd.getpwuid(uid).pw_name} (uid {uid}, "
    except KeyError:
        who = f"user {uid} ("
    return f"{who}whose claim file this user cannot open)"


def test_another_user_s_claim_file_this_user_cannot_open_is_their_claim(
    own_claims: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 0600 claim file of another user (as root, which opens anything, by a stand-in for
    # the refusal; the test below drops to another user for real).
    own_claims.mkdir(mode=0o1777)
    (own_claims / "GPU-0000.lock").write_text("")
    real_open = os.open

    def theirs(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if str(path) == "GPU-0000.lock" and not flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", theirs)
    owner = _owner(os.getuid())
    manager = _claim(server()[1])
    assert manager.device == cuda(1)
    assert f"Skipped cuda:0: claimed by {owner}." in manager.explain()
    with pytest.raises(
        dk.DeviceUnavailableError,
        match=re.escape(f"Cannot claim cuda:0, asked for as 'cuda:0': {owner} claims it."),
    ):
        dk.DeviceManager("cuda:0", claim=True, backends=server()[1])
    assert owner in _info_table(dk.DeviceManager(backends=server()[1]))


def _as_user(uid: int, work: Callable[[], str]) -> str:
    """What ``work()`` returns in a forked child that runs as user ``uid`` (a child that
    raises fails the test with its error; the watchdog ends one that hangs)."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: forks with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            said = work()
        except BaseException as err:  # said to the parent, whatever it is
            said, status = f"the child raised {err!r}", 1
        with os.fdopen(write, "wb") as pipe:
            pipe.write(said.encode())
        os._exit(status)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            said = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    assert os.waitstatus_to_exitcode(status) == 0, said
    return said


def _another_user_s_job() -> str:
    manager = dk.DeviceManager(claim=True, backends=server()[1])
    try:
        dk.DeviceManager("cuda:0", claim=True, backends=server()[1])
        refused = ""
    except dk.DeviceUnavailableError as err:
        refused = str(err)
    return json.dumps([str(manager.device), manager.explain(), refused])


@pytest.mark.usefixtures("watchdog")
@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")
def test_a_0600_claim_file_of_another_user_leaves_the_other_gpus_to_everyone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One user's job made GPU-0000.lock readable to that user alone; another user's job
    # (nobody's, here) counts that GPU as claimed, by its owner, and takes the next.
    try:
        planter = pwd.getpwnam("daemon").pw_uid
    except KeyError:
        planter = 12345
    shared = Path(tempfile.mkdtemp(prefix="devicekit-test-"))  # in /tmp: nobody may enter
    try:
        shared.chmod(0o755)
        claims = shared / "claims"
        claims.mkdir()
        claims.chmod(0o1777)
        planted = claims / "GPU-0000.lock"
        planted.write_text("777\n")
        planted.chmod(0o600)
        os.chown(planted, planter, planter)
        monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", str(claims))
        device, explained, refused = json.loads(_as_user(65534, _another_user_s_job))
        owner = _owner(planter)
        assert device == "cuda:1"
        assert f"Skipped cuda:0: claimed by {owner}." in explained
        assert refused == f"Cannot claim cuda:0, asked for as 'cuda:0': {owner} claims it."
        assert planted.read_text() == "777\n"
    finally:
        shutil.rmtree(shared)


def _claim(backends: list[object]) -> dk.DeviceManager:
    return dk.DeviceManager(claim=True, backends=backends)


def _under_a_file(directory: Path) -> Path:
    (directory.parent / "a-file").write_text("")
    return directory.parent / "a-file" / "claims"


def _a_file(directory: Path) -> Path:
    directory.write_text("")
    return directory


def _a_dangling_link(directory: Path) -> Path:
    directory.symlink_to(directory.parent / "missing")
    return directory


def _a_link_loop(directory: Path) -> Path:
    directory.symlink_to(directory)
    return directory


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (_under_a_file, "cannot be made: a part of its path is a file"),
        (_a_file, "is not a directory"),
        (_a_dangling_link, "is a link to nothing"),
        (_a_link_loop, "is a loop of links"),
    ],
)
def test_a_claim_directory_that_is_no_directory_is_named_with_the_variable(
    own_claims: Path, monkeypatch: pytest.MonkeyPatch, make: Any, said: str
) -> None:
    monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", str(make(own_claims)))
    with pytest.raises(OSError, match="Set DEVICEKIT_CLAIM_DIR to a directory") as raised:
        _claim(server()[1])
    assert said in str(raised.value)


def test_a_relative_claim_directory_is_refused_and_a_tilde_expanded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", "claims")
    with pytest.raises(
        OSError,
        match=re.escape("Expected DEVICEKIT_CLAIM_DIR to be an absolute path, got 'claims'"),
    ):
        _claim(server()[1])
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", "~/gpu-claims")
    monkeypatch.chdir(tmp_path)
    assert _claims.claim_dir() == tmp_path / "gpu-claims"
    _claim(server()[1])
    assert (tmp_path / "gpu-claims" / "GPU-0000.lock").is_file()
    assert not (tmp_path / "~").exists()


def test_a_directory_anyone_may_rename_files_in_is_refused(own_claims: Path) -> None:
    own_claims.mkdir()
    own_claims.chmod(0o777)  # no sticky bit
    with pytest.raises(OSError, match="without the sticky bit that /tmp has: chmod \\+t"):
        _claim(server()[1])
    own_claims.chmod(0o1777)
    assert _claim(server()[1]).device == cuda(0)


def test_a_directory_made_for_claims_is_open_to_all_with_the_sticky_bit(own_claims: Path) -> None:
    _claim(server()[1])
    assert own_claims.stat().st_mode & 0o7777 == 0o1777
    assert (own_claims / "GPU-0000.lock").stat().st_mode & 0o777 == 0o666


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA... someone@laptop\n")
    victim.chmod(0o600)
    return victim


def _untouched(victim: Path) -> bool:
    return (
        victim.read_text() == "ssh-ed25519 AAAA... someone@laptop\n"
        and victim.stat().st_mode & 0o777 == 0o600
    )


def test_a_link_planted_under_a_gpu_s_name_is_refused_and_its_target_untouched(
    own_claims: Path, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    own_claims.mkdir(mode=0o1777)
    (own_claims / "GPU-0000.lock").symlink_to(victim)
    with pytest.raises(
        OSError, match=re.escape("GPU-0000.lock is a symbolic link, where devicekit keeps")
    ):
        _claim(server()[1])
    assert _untouched(victim)
    assert dk.DeviceManager(backends=server()[1]).device == cuda(0)  # not claiming: unaffected


def test_a_hard_link_planted_under_a_gpu_s_name_is_refused_and_its_target_untouched(
    own_claims: Path, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    own_claims.mkdir(mode=0o1777)
    os.link(victim, own_claims / "GPU-0000.lock")
    with pytest.raises(
        OSError, match=re.escape("GPU-0000.lock has another name too (a hard link)")
    ):
        _claim(server()[1])
    assert _untouched(victim)


@pytest.mark.usefixtures("watchdog")
def test_a_fifo_planted_under_a_gpu_s_name_is_refused_without_waiting(own_claims: Path) -> None:
    own_claims.mkdir(mode=0o1777)
    os.mkfifo(own_claims / "GPU-0000.lock")
    with pytest.raises(OSError, match=re.escape("GPU-0000.lock is no regular file")):
        _claim(server()[1])
    assert _claims.holders(["GPU-0000"]) == {}  # the look waits on nothing either


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_user_s_claim_file_is_locked_and_never_written(own_claims: Path) -> None:
    own_claims.mkdir(mode=0o1777)
    theirs = own_claims / "GPU-0000.lock"
    theirs.write_text("777\n")
    theirs.chmod(0o644)
    os.chown(theirs, 12345, 12345)
    manager = _claim(server()[1])
    assert manager.device == cuda(0)
    assert theirs.read_text() == "777\n"  # the pid goes unsaid rather than into their file
    assert theirs.stat().st_uid == 12345
    assert theirs.stat().st_mode & 0o777 == 0o644
    assert claimed(own_claims, "GPU-0000")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another user needs root")
def test_a_claim_directory_that_another_user_s_link_points_to_is_refused(
    own_claims: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    own_claims.symlink_to(elsewhere)
    os.lchown(own_claims, 12345, 12345)
    with pytest.raises(OSError, match="is a symbolic link that user 12345 made"):
        _claim(server()[1])
    assert list(elsewhere.iterdir()) == []


def test_a_lock_file_this_user_cannot_make_is_named(
    own_claims: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another user's directory without the sticky bit's openness, and no claim file yet
    # (as root, which may write anywhere, by a stand-in for the refusal).
    real_open = os.open

    def refused_in_the_claims(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", refused_in_the_claims)
    with pytest.raises(
        OSError, match=r"GPU-0000.lock cannot be made or opened \(Permission denied\)"
    ):
        _claim(server()[1])


_FORKING_JOB = """
import os, sys, time
sys.path.insert(0, {root!r})
import devicekit as dk
from devicekit._select._backends import CpuBackend
from tests.fakes import FakeGpus
manager = dk.DeviceManager(claim=True, fallback="error", backends=[FakeGpus((70,)), CpuBackend()])
if os.fork() == 0:  # a DataLoader worker, say: it lives on, holding nothing
    time.sleep(120)
    os._exit(0)
if {close!r}:
    manager.close()
with open({out!r}, "w") as out:
    out.write(str(manager.device))
time.sleep(120)
"""


@pytest.mark.parametrize("end", ["close", "kill -9"])
def test_a_forked_child_does_not_keep_its_parent_s_claim(
    own_claims: Path, tmp_path: Path, end: str, fresh_python: str
) -> None:
    out = tmp_path / "job.device"
    code = _FORKING_JOB.format(root=str(ROOT), close=end == "close", out=str(out))
    job = subprocess.Popen([fresh_python, "-c", code], start_new_session=True)
    try:
        _until(out.exists, "the job to claim its GPU and fork")
        if end == "kill -9":
            assert claimed(own_claims, "GPU-0000")
            job.send_signal(signal.SIGKILL)
            job.wait(timeout=10)
        _until(lambda: not claimed(own_claims, "GPU-0000"), f"the claim to end at {end}", 20)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the child too
        job.wait(timeout=10)


_CLAIMING_JOB = """
import sys, time
sys.path.insert(0, {root!r})
import devicekit as dk
from devicekit._select._backends import CpuBackend
from tests.fakes import FakeGpus
manager = dk.DeviceManager(
    claim=True, wait={wait!r}, fallback="error", backends=[FakeGpus((70, 70)), CpuBackend()]
)
with open({out!r}, "w") as out:
    out.write(str(manager.device))
time.sleep(120)  # holds the claim until killed
"""


def _start_job(
    python: str, tmp_path: Path, name: str, wait: str | None
) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / f"{name}.device"
    code = _CLAIMING_JOB.format(root=str(ROOT), wait=wait, out=str(out))
    with (tmp_path / f"{name}.log").open("w") as log:  # the job writes to its own copy
        job = subprocess.Popen([python, "-c", code], stderr=log, text=True)
    return job, out


def _until(condition: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.05)


def test_jobs_claim_different_gpus_and_a_killed_job_s_gpu_goes_to_the_next(
    tmp_path: Path,
    fresh_python: str,
) -> None:
    jobs: list[subprocess.Popen[str]] = []
    try:
        first, first_out = _start_job(fresh_python, tmp_path, "first", None)
        second, second_out = _start_job(fresh_python, tmp_path, "second", None)
        jobs += [first, second]
        _until(lambda: first_out.exists() and second_out.exists(), "the first two jobs' GPUs")
        devices = {first_out.read_text(), second_out.read_text()}
        assert devices == {"cuda:0", "cuda:1"}
        third, third_out = _start_job(fresh_python, tmp_path, "third", "60s")
        jobs.append(third)
        log = tmp_path / "third.log"
        _until(lambda: "devicekit waits up to 60 s" in log.read_text(), "the third to wait")
        assert not third_out.exists()
        first.send_signal(signal.SIGKILL)  # no close(), no atexit: only the OS lets go
        first.wait(timeout=10)
        _until(third_out.exists, "the third job to get the killed job's GPU")
        time.sleep(0.05)  # the write after the file appears
        assert third_out.read_text() == first_out.read_text()
    finally:
        for job in jobs:
            job.kill()
            job.wait(timeout=10)


# torchrun.


def test_the_torchrun_path_makes_its_gpu_the_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    gpus, backends = server()
    manager = dk.DeviceManager.from_env(backends=backends)
    assert manager.device == cuda(1)
    assert gpus.made_current == [cuda(1)]
    # Chosen any other way, the current device is left alone.
    monkeypatch.delenv("LOCAL_RANK")
    dk.DeviceManager(backends=backends)
    dk.DeviceManager("cuda:0", backends=backends)
    assert gpus.made_current == [cuda(1)]


def test_one_gpu_per_rank_is_made_current_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    gpus, backends = server(free=(70,))
    assert dk.DeviceManager.from_env(backends=backends).device == cuda(0)
    assert gpus.made_current == [cuda(0)]


def test_more_ranks_than_gpus_stays_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    gpus, backends = server()
    with pytest.raises(dk.DeviceUnavailableError, match="Expected LOCAL_RANK to be below"):
        dk.DeviceManager.from_env(backends=backends)
    assert gpus.made_current == []


@pytest.mark.cuda
def test_on_a_gpu_the_last_rank_s_gpu_becomes_current(fresh_python: str) -> None:
    count = torch.cuda.device_count()
    program = (
        "import torch, devicekit as dk; manager = dk.DeviceManager.from_env(); "
        "print(manager.device, torch.cuda.current_device())"
    )
    environ = {**os.environ, "LOCAL_RANK": str(count - 1), "LOCAL_WORLD_SIZE": str(count)}
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    result = run_program([fresh_python, "-c", program], timeout=120, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [f"cuda:{count - 1}", str(count - 1)]


# What NVML reports, read through a stand-in for pynvml.


class _NvmlError(Exception):
    pass


def _fake_nvml(*, utilization: bool = True, processes: bool = True) -> SimpleNamespace:
    def unsupported(*_: object) -> Any:
        raise _NvmlError

    def running(pid_memory: list[tuple[int, int | None]]) -> Any:
        def read(handle: object) -> list[SimpleNamespace]:
            return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in pid_memory]

        return read if processes else unsupported

    return SimpleNamespace(
        NVMLError=_NvmlError,
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(total=80 * GiB, free=40 * GiB),
        nvmlDeviceGetCudaComputeCapability=lambda handle: (9, 0),
        nvmlDeviceGetPciInfo=lambda handle: SimpleNamespace(busId=b"00000000:01:00.0"),
        nvmlDeviceGetUUID=lambda handle: b"GPU-abc",
        nvmlDeviceGetName=lambda handle: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetUtilizationRates=(
            (lambda handle: SimpleNamespace(gpu=93, memory=40)) if utilization else unsupported
        ),
        nvmlDeviceGetComputeRunningProcesses=running([(4242, 31 * GiB), (77, None)]),
        nvmlDeviceGetGraphicsRunningProcesses=running([(4242, 31 * GiB), (9, 1 * GiB)]),
    )


def test_nvml_gives_utilization_and_each_process_once() -> None:
    gpu = _nvml._read_gpu(_fake_nvml(), handle=object())
    assert gpu.utilization == 0.93
    assert gpu.processes == ((4242, 31 * GiB), (77, None), (9, 1 * GiB))


def test_what_nvml_cannot_tell_is_none() -> None:
    gpu = _nvml._read_gpu(_fake_nvml(utilization=False, processes=False), handle=object())
    assert gpu.utilization is None
    assert gpu.processes is None


# The command line.


def test_devicekit_info_shows_utilization_processes_and_claims(own_claims: Path) -> None:
    gpus = FakeGpus((70, 70), busy=(0.93, None), processes={0: (dk.GpuProcess(4242, 31 * GiB),)})
    other = AnotherJob(own_claims, "GPU-0000")
    manager = dk.DeviceManager(backends=[gpus, CpuBackend()])
    table = _info_table(manager)
    header, first, second = table.splitlines()[:3]
    assert header.split() == [
        "device", "backend", "name", "total", "free", "busy", "capability", "claimed", "by"
    ]  # fmt: skip
    assert "93%" in first
    assert "pid 4242" in first
    assert second.split()[-3:] == ["-", "9.0", "-"]  # busy unknown, no claim
    assert "cuda:0: 31.0 GiB used by pid 4242" in table
    report = _info_json(manager)
    assert '"utilization": 0.93' in report
    assert '"pid": 4242' in report
    assert '"cuda:0": 4242' in report
    other.release()


# MPS.


@pytest.mark.parametrize("non_blocking", ["auto", True, False])
def test_copies_to_and_from_mps_are_blocking(non_blocking: bool | str) -> None:
    mps = torch.device("mps")
    plan = _transfer.Plan(mps, _transfer.Options(non_blocking=non_blocking))  # type: ignore[arg-type]
    assert plan.told is False  # what objects moving themselves are told
    call = _transfer.Call(plan, [])
    assert call.non_blocking(torch.zeros(2), mps) is False


def test_copies_from_mps_block_under_auto() -> None:
    from_mps = SimpleNamespace(device=torch.device("mps"), is_cpu=False, is_meta=False)
    to_host = _transfer.Call(_transfer.Plan(CPU, _transfer.Options()), [])
    assert to_host.non_blocking(from_mps, CPU) is False  # type: ignore[arg-type]
    assert to_host.waits is None  # nothing to wait for at the end
