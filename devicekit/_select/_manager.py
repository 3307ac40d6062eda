"""DeviceManager: look at the devices, choose one, wait or claim as asked, explain.

A manager reads as its constructor runs: it *looks* (each backend lists its devices,
the claim files say which other jobs hold, the launcher's variables say which rank this
is), asks :func:`devicekit._select._selection.choose` to *choose* among them (a pure function),
then *waits* and looks again where it was told to wait, or *claims* the device chosen,
and keeps what it saw to *explain* the choice. From its constructor's end until
:meth:`~DeviceManager.close` it is *open*: the default of devicekit calls given no device
(:func:`~devicekit.current_device`). The process-wide manager that ``current_device()`` falls
back on, where none is open, is registered here too.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, NoReturn, get_args

import torch

from devicekit._base import (
    HOST_TYPES,
    DeviceLike,
    DeviceUnavailableError,
    Scope,
    accelerator_families,
    duration,
    enter_block,
    flag,
    has_backend,
    leave_block,
    mark_closed,
    mark_open,
    open_managers,
    parse_bytes,
    parse_seconds,
    register_process_default,
    shown,
    warn,
)
from devicekit._select import _claims, _hardware, _launch
from devicekit._select._backends import (
    Backend,
    DeviceInfo,
    Family,
    builtin_backends,
    cuda_started,
    describe,
)
from devicekit._select._fallback import Finding, Machine, why_cpu
from devicekit._select._fork_locks import ForkSafeLock
from devicekit._select._selection import (
    Chosen,
    Fallback,
    Policy,
    Refused,
    Request,
    Seen,
    Wait,
    choose,
    family_notes,
)

__all__ = ["DeviceManager", "Fallback", "Policy", "claim_holders", "forget_process_default"]

_POLICIES = get_args(Policy)
_FALLBACKS = get_args(Fallback)
_FAMILIES = ("cuda", "rocm", "xpu", "mps", "cpu")


def _default_prefer(backends: Sequence[Backend]) -> tuple[str, ...]:
    """The accelerator families devicekit looks for, then the CPU.

    The build's own accelerator (a Python backend's, an extension's) only where one of
    ``backends`` finds it: a user's list may have none for it.
    """
    ours = {*_FAMILIES, *(backend.name for backend in backends)}
    return (*(family for family in accelerator_families() if family in ours), "cpu")


class _Once:
    """A flag for what happens once a process, set and tested without a lock.

    ``threading.Event.set`` takes a lock, which a fork can leave held in the child.
    """

    def __init__(self) -> None:
        self._left = [True]

    def first(self) -> bool:
        """Set the flag; whether this call set it (``list.pop`` is one step for threads)."""
        try:
            self._left.pop()
        except IndexError:
            return False
        return True

    def set(self) -> None:
        self._left.clear()

    def clear(self) -> None:
        self._left[:] = [True]


_fallback_warned = _Once()  # the CPU fallback warns once per process
_logger = logging.getLogger("devicekit")

# Waiting for a device: NVML is read again after 1 s, then twice as long each time up to
# 30 s, so a queue of jobs polls a busy server a few times a minute, not in a loop.
_FIRST_POLL_S = 1.0
_LONGEST_POLL_S = 30.0
_clock = time.monotonic  # the tests' fake clock replaces these two
_sleep = time.sleep

# Held while a manager counts its `with` blocks and closes or claims again as a count
# says, so that a thread entering never finds the manager half closed by one leaving.
# Reentrant: leaving a block closes the manager, and close() takes it too. Made after
# _claims' lock, so taken before it around a fork, in the order __exit__ takes the two.
_blocks_lock = ForkSafeLock(reentrant=True)


def _claim_key(info: DeviceInfo) -> str:
    """What names a device's claim: its UUID, else its family and index as this process has them."""
    return info.uuid or f"{info.backend}-{info.index}"


def claim_holders(devices: Sequence[DeviceInfo]) -> dict[torch.device, _claims.Holder]:
    """The accelerators among ``devices`` that a job claims (this process too), and by whom."""
    keys = {_claim_key(info): info.device for info in devices if info.device.type not in HOST_TYPES}
    return {keys[key]: holder for key, holder in _claims.holders(list(keys)).items()}


def _share(value: object) -> float | None:
    """``max_utilization``, checked: None, or a share between 0 and 1."""
    if value is None:
        return None
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not 0 <= number <= 1:
        hint = " (a share: 0.5 is 50%)" if number is not None and 1 < number <= 100 else ""
        msg = f"Expected max_utilization between 0 and 1{hint}, got {shown(value)}."
        raise ValueError(msg)
    return float(number)


class DeviceManager:
    """Detect the devices of this machine, select one, and explain the choice.

    Replaces ``torch.device("cuda" if torch.cuda.is_available() else "cpu")``: it sees
    CUDA, ROCm, XPU and MPS devices without starting CUDA, avoids a GPU that others
    are filling, follows torchrun's ``LOCAL_RANK``, and says so when it falls back to
    the CPU. An open DeviceManager (made, kept and not closed) is the device of every
    devicekit call given no device, in every thread; ``with manager:`` makes its
    manager the default inside the block (see :func:`~devicekit.current_device`).

    >>> import devicekit as dk
    >>> manager = dk.DeviceManager("meta")
    >>> manager.device
    device(type='meta')
    >>> dk.current_device()
    device(type='meta')
    >>> with dk.DeviceManager("cpu"):
    ...     dk.current_device()
    device(type='cpu')
    >>> manager.close()

    Args:
        device: A device to use (``"cuda:1"``, ``torch.device``, or an index on the
            preferred accelerator); None lets ``policy`` choose.
        prefer: Families in order of preference; the first with a usable device wins.
            ``"cuda"`` also matches ROCm GPUs, which PyTorch addresses as ``cuda``. None:
            ``("cuda", "xpu", "mps", "cpu")``, with the build's own accelerator (one
            registered by an extension or from Python, such as the stand-in of
            :mod:`devicekit.testing`) before ``"cpu"``.
        policy: ``"auto"`` (a launcher's local rank when set, else the lowest-numbered
            device whose free memory is within 5% of the most free),
            ``"most-free-memory"`` (the most free, exactly), or ``"local-rank"``.
        min_free_memory: Skip accelerators with less free memory than this: bytes, or a
            size such as ``"8GiB"``. Devices whose free memory is unknown are kept.
        max_utilization: Skip accelerators busier than this share of the time (0-1, as
            NVML measures it); with ``min_free_memory``, both must hold. Devices whose
            utilization is unknown are kept.
        wait: Where no accelerator qualifies yet, wait up to this long for one: seconds,
            or a duration such as ``"10m"``. The devices are read again with a growing
            pause (1 s, doubling to 30 s), the wait is logged once, and on timeout
            ``fallback`` applies, with the reason.
        claim: Claim the chosen accelerator for this process: an OS file lock keyed by
            its UUID in ``DEVICEKIT_CLAIM_DIR`` (default: ``devicekit-claims`` in the
            temporary directory), which other managers with ``claim=True`` pass over.
            Held until :meth:`close`, the end of the last ``with manager:`` block open
            in any thread, or the process ending in any way, ``kill -9`` included;
            never by a forked child.
            A manager that chooses passes over the GPUs this process claims already,
            so two managers (a notebook cell run twice, two threads) claim two GPUs;
            to keep one, :meth:`close` the first, use ``with manager:``, or name the
            device: managers that name the same GPU share this process's claim on it.
        fallback: With no usable accelerator, ``"cpu"`` uses the CPU; ``"error"`` raises
            :class:`~devicekit.DeviceUnavailableError`. Falling back warns once per
            process (a RuntimeWarning) where the machine has an accelerator: one seen
            and passed over, or one PyTorch cannot use, with the cause and the fix
            ``devicekit doctor`` gives. A machine with none has only its CPU: no warning.
        backends: The device families to look at; None for the built-in ones. Tests
            pass fakes here.

    Raises:
        DeviceUnavailableError: ``device`` (or ``DEVICEKIT_DEVICE``) does not parse or is
            not on this machine, or nothing usable was found with ``fallback="error"``;
            or, entering ``with manager:`` again, another holder claimed the GPU it gave back.
        TypeError: ``device`` is no string, torch.device or index; ``claim`` is not True
            or False; ``min_free_memory`` is neither a whole number nor a string; or a
            backend lacks the :class:`~devicekit.Backend` protocol.
        ValueError: An option has a value outside those listed above, or the launcher's
            local rank, where it is used, is no whole number.
        OSError: ``claim=True`` where the claim directory cannot be made or used
            (``DEVICEKIT_CLAIM_DIR`` relative, not a directory, a link another user made,
            or a claim file there that is no plain file of its own).
    """

    def __init__(
        self,
        device: DeviceLike | None = None,
        *,
        prefer: Sequence[str] | None = None,
        policy: Policy = "auto",
        min_free_memory: int | str | None = None,
        max_utilization: float | None = None,
        wait: float | str | None = None,
        claim: bool = False,
        fallback: Fallback = "cpu",
        backends: Sequence[Backend] | None = None,
    ) -> None:
        if policy not in _POLICIES:
            msg = f"Expected policy to be one of {_POLICIES}, got {policy!r}."
            raise ValueError(msg)
        if fallback not in _FALLBACKS:
            msg = f"Expected fallback to be one of {_FALLBACKS}, got {fallback!r}."
            raise ValueError(msg)
        self._backends = builtin_backends() if backends is None else list(backends)
        # A user's backends are checked; the built-in ones are (a protocol check costs 20 us).
        for backend in () if backends is None else self._backends:
            if not isinstance(backend, Backend):  # for untyped callers
                msg = (  # type: ignore[unreachable]
                    "Expected backends with a name, a device_type and devices() (the "
                    f"devicekit.Backend protocol), got {type(backend).__name__} "
                    f"{shown(backend)}."
                )
                raise TypeError(msg)
        if prefer is None:
            prefer = _default_prefer(self._backends)
        known = {*_FAMILIES, *(b.name for b in self._backends)}
        if isinstance(prefer, str) or not prefer or not all(name in known for name in prefer):
            msg = (
                f"Expected prefer to list device families among {sorted(known)}, in order "
                f"of preference, got {prefer!r}."
            )
            raise ValueError(msg)
        min_free = (
            None if min_free_memory is None else parse_bytes(min_free_memory, "min_free_memory")
        )
        max_busy = _share(max_utilization)
        self._wait = None if wait is None else parse_seconds(wait)
        self._claiming = flag(claim, "claim")
        self._claim: _claims.Claim | None = None
        self._claim_name: str | None = None  # what names the claim, to take it again
        self._claim_shared = False  # its device named: this process's claim is shared
        self._request = Request(device, policy, tuple(prefer), min_free, max_busy, fallback)
        self._causes: tuple[Finding, ...] = ()  # why an accelerator here is not usable
        self._device, self._reason = self._settle()
        self._scope: Scope | None = None  # its `with` blocks, in all threads, since entered
        # Open from here until close(): the default of devicekit calls given no device.
        self._open = mark_open(self, self._device) if self._counts_open else None

    _counts_open = True  # the process default (below) is what holds when none is open

    @classmethod
    def from_env(cls, **options: Any) -> DeviceManager:
        """A manager configured by the environment, for scripts and launchers.

        ``DEVICEKIT_DEVICE`` (``"cuda:1"``, ``"cpu"``, an index) when set, as in the
        constructor given no device, and here over a ``device`` given as a default;
        else the local rank of the innermost launcher (``LOCAL_RANK`` of torchrun, then
        ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MV2_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``,
        ``PALS_LOCAL_RANKID``, then
        ``SLURM_LOCALID``) selects that device among the visible ones, and makes it the
        current device of the process (``set_device``) before returning; else
        ``options`` decide, as in the constructor. A device the user names, here or in
        ``DEVICEKIT_DEVICE``, wins over the launcher's variables, even malformed ones.

        >>> import devicekit as dk, os
        >>> os.environ["DEVICEKIT_DEVICE"] = "cpu"
        >>> manager = dk.DeviceManager.from_env()
        >>> manager.device, manager.reason
        (device(type='cpu'), 'DEVICEKIT_DEVICE asks for it')
        >>> del os.environ["DEVICEKIT_DEVICE"]

        Args:
            **options: Keyword arguments of the constructor; a ``device`` given here is
                a default, used where ``DEVICEKIT_DEVICE`` is not set.

        Returns:
            The manager.

        Raises:
            DeviceUnavailableError: ``DEVICEKIT_DEVICE`` names no device of this machine;
                or as the constructor, for ``options``.
            ValueError: The launcher's local rank, where it is used, is not a whole number
                of 0 or more; or an option's value, as the constructor.
            TypeError: As the constructor, for ``options``.
            OSError: As the constructor, with ``claim=True``.
        """
        if _launch.devicekit_device():
            # The variable overrides a program's default, as environment settings do.
            options.pop("device", None)
        return cls(**options)

    @property
    def device(self) -> torch.device:
        """The selected device."""
        return self._device

    @property
    def device_id(self) -> torch.device | None:
        """The device to pass as ``init_process_group(device_id=...)``; None for the CPU.

        PyTorch binds a process group to an accelerator given there (NCCL connects at
        once), and refuses the CPU, so a script that may fall back passes this instead
        of :attr:`device`.

        >>> import devicekit as dk
        >>> print(dk.DeviceManager("cpu").device_id)
        None
        """
        return None if self._device.type in HOST_TYPES else self._device

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        """Every device found, by family in the order of ``backends``."""
        return self._seen.devices

    @property
    def reason(self) -> str:
        """Why :attr:`device` was chosen, in a few words (the first line of :meth:`explain`)."""
        return self._reason

    def notes(self) -> dict[str, str]:
        """Why families found nothing, by family name (``{"cuda": "no CUDA support ..."}``)."""
        return family_notes(self._seen.families)

    def explain(self) -> str:
        """A few lines: what was chosen and why, the default-device rule, what was seen.

        Returns:
            The explanation, one sentence per line.
        """
        chosen = next((info for info in self.devices if info.device == self._device), None)
        name = f" ({chosen.name})" if chosen is not None and chosen.name else ""
        lines = [f"Selected {self._device}{name}: {self._reason}."]
        lines += [f"Skipped {skipped}." for skipped in self._skipped]
        if self._claim is not None:
            lines.append(f"Claimed with {self._claim.path}, until close() or the process ends.")
        lines += [f"Cause: {cause.sentence()}" for cause in self._causes]
        lines.append(
            f"Default: devicekit calls given no device use {self._device} until close(), "
            "outside other managers' `with` blocks."
            if self._open is not None
            else "Default: closed, so devicekit calls given no device no longer use it."
        )
        lines.append("Devices seen:")
        lines += [f"  {describe(info)}" for info in self.devices]
        lines += [f"  no {name}: {note}" for name, note in self.notes().items()]
        return "\n".join(lines)

    def close(self) -> None:
        """Close the manager: no longer the default device, its claim (``claim=True``) given back.

        Where other managers of this process share the claim, the GPU stays claimed until
        the last of them closes. The process ending gives it back too, however it ends.
        Leaving the last ``with manager:`` block open, in any thread, closes the manager;
        a block still open (in a thread, a task, a suspended generator) then no longer
        makes it the default there. A second call does nothing.
        """
        with _blocks_lock:
            if self._scope is not None:
                self._scope.closed = True
            if self._open is not None:
                mark_closed(self._open)
                self._open = None
            if self._claim is not None:
                self._claim.release()
                self._claim = None

    @classmethod
    def close_all(cls) -> None:
        """Close every open manager of this process, also those no name of yours holds.

        The way out where managers that disagree make devicekit calls given no device
        refuse, and the one to close is kept by something you cannot reach: a reference
        cycle, a saved traceback, a notebook's ``Out[]`` history.

        >>> import devicekit as dk
        >>> managers = [dk.DeviceManager("meta"), dk.DeviceManager("cpu")]
        >>> dk.DeviceManager.close_all()
        >>> dk.current_device()
        device(type='cpu')
        """
        for manager in open_managers():
            if isinstance(manager, cls):
                manager.close()

    def __repr__(self) -> str:
        return f"DeviceManager(device={self._device!r})"

    def __reduce__(self) -> NoReturn:
        # What multiprocessing's spawn does to what it sends; a manager is this process's
        # choice, claim and default device, which another process cannot share.
        msg = (
            f"Expected something another process can use, got {self!r} to pickle (as "
            "multiprocessing does with what it sends to a process): a manager is this "
            "process's own, with its claim and its place as the default device. Send its "
            "device instead (manager.device, a torch.device), and pass it to devicekit "
            "calls there, or to DeviceManager(device) for a manager of that process."
        )
        raise TypeError(msg)

    def __enter__(self) -> DeviceManager:
        with _blocks_lock:
            scope = self._scope
            if scope is None or scope.closed:  # the first block since made, or since closed
                if self._claiming and self._claim is None and self._claim_name is not None:
                    self._claim_again()
                scope = self._scope = Scope(self, self._device)
            scope.blocks += 1
        enter_block(scope)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with _blocks_lock:
            # Not found here: the block was entered in another context (a generator
            # finished in another thread), and counts against the manager's blocks now.
            scope = leave_block(self) or self._scope
            if scope is None or scope.closed:
                return
            scope.blocks -= 1
            if not scope.blocks:  # the last block, of every thread: the claim is given back
                self.close()

    def _claim_again(self) -> None:
        """Claim the device once more, entering ``with manager:`` after leaving one."""
        claim = _claims.take(self._claim_name or "", share=self._claim_shared)
        if claim is None:
            holder = claim_holders(self.devices).get(self._device) or _claims.Holder()
            msg = (
                f"Cannot claim {self._device} again on entering `with manager:`: "
                f"{holder} claimed it after "
                "this manager gave it back at the end of its last block. Keep one block "
                "around the whole run to hold the GPU throughout."
            )
            raise DeviceUnavailableError(msg)
        self._claim = claim

    # Look, choose, wait or claim.

    def _look(self, lost: dict[torch.device, _claims.Holder | None]) -> Seen:
        """What this machine and its environment show now: devices, claims, launcher."""
        families = tuple(Family.listed(backend) for backend in self._backends)
        devices = tuple(info for family in families for info in family.devices)
        claimed = {**lost, **claim_holders(devices)} if self._claiming else {}
        return Seen.of(
            families,
            os.environ,
            claimed=claimed,
            cuda_index=torch.cuda.current_device() if cuda_started() else 0,
            loaded=has_backend,
        )

    def _settle(self) -> tuple[torch.device, str]:
        """Look and choose, waiting and claiming as asked: the device, and why."""
        started, pause = _clock(), _FIRST_POLL_S
        request = self._request._replace(waiting=bool(self._wait))
        lost: dict[torch.device, _claims.Holder | None] = {}  # claims lost in a race
        while True:
            self._seen = self._look(lost)
            outcome = choose(self._seen, request)
            if isinstance(outcome, Refused):
                if outcome.rank is not None and outcome.rank.code == "local-rank-not-a-number":
                    raise ValueError(outcome.message)  # a setting of the wrong form
                raise DeviceUnavailableError(outcome.message)
            if isinstance(outcome, Wait):
                waited = _clock() - started
                left = (self._wait or 0) - waited
                if left <= 0:  # one more look, which falls back (or fails) with the reason
                    request = request._replace(waiting=False, waited=waited)
                    continue
                if pause == _FIRST_POLL_S:  # before the first pause only: said once
                    _logger.warning(
                        "devicekit waits up to %s for a device: %s. %s",
                        duration(self._wait or 0),
                        outcome.why,
                        " ".join(outcome.passed_over),
                    )
                _sleep(min(pause, left))
                pause = min(pause * 2, _LONGEST_POLL_S)
                continue
            if not self._claim_chosen(outcome):
                lost[outcome.device] = None  # taken since the look: look again, knowing it is
                continue
            return self._adopt(outcome)

    def _claim_chosen(self, chosen: Chosen) -> bool:
        """Claim the accelerator chosen, where the manager claims; False where it was lost."""
        if not self._claiming or chosen.device.type in HOST_TYPES:
            return True
        info = next((info for info in self._seen.devices if info.device == chosen.device), None)
        name = str(chosen.device) if info is None else _claim_key(info)
        # A device named is shared with this process's other claims, as _Choice.named says.
        seen = self._seen
        named = self._request.device is not None or bool(seen.devicekit_device) or chosen.current
        claim = _claims.take(name, share=named)
        if claim is None:
            return False
        self._claim, self._claim_name, self._claim_shared = claim, name, named
        return True

    def _adopt(self, chosen: Chosen) -> tuple[torch.device, str]:
        """Act on the choice: the rank's device made current, the fallback warned of once."""
        self._skipped = chosen.skipped
        # Before NCCL's first call, so that every rank works on its own GPU rather than all
        # of them on cuda:0 (PyTorch warns that a barrier would "guess" otherwise).
        if chosen.current:
            backend, _ = next(
                (backend, family)
                for backend, family in zip(self._backends, self._seen.families, strict=True)
                if any(info.device == chosen.device for info in family.devices)
            )
            make_current = getattr(backend, "make_current", None)
            if make_current is not None:  # a family of one device (MPS) has nothing to set
                make_current(chosen.device)
        if chosen.fell_back is not None:
            self._warn_of_fallback(chosen.fell_back)
        reason = chosen.reason + ("; claimed for this process" if self._claim is not None else "")
        return chosen.device, reason

    def _warn_of_fallback(self, why: str) -> None:
        """Say, once a process, why the CPU: where the machine has an accelerator, it is news.

        Its causes are :func:`why_cpu`'s findings, which the doctor says too: a CPU-only
        PyTorch beside an NVIDIA driver, a container without its GPUs. A machine without any
        accelerator has nothing to say: its CPU was the only choice. Nothing is imported
        here: a fork amid an import would leave its lock held in the child, whose first
        fallback would then wait for it forever.
        """
        machine = Machine(
            os.environ,
            self._seen.families,
            loaded=has_backend,
            hardware=_hardware.probe(),
            build=_hardware.Build.of_torch(),
        )
        self._causes = tuple(why_cpu(machine))
        passed_over = any(info.device.type not in HOST_TYPES for info in self._seen.devices)
        if not (self._causes or passed_over) or not _fallback_warned.first():
            return
        causes = "".join(f" Cause: {cause.sentence()}" for cause in self._causes)
        # One sentence, and the causes: explain() has the rest, what was seen and passed over.
        warn(
            f"devicekit uses the CPU: {why}; see DeviceManager().explain().{causes}", RuntimeWarning
        )


class _ProcessDefault(DeviceManager):
    """The manager of the process default: what holds while no manager of the program is open."""

    _counts_open = False


@functools.cache
def _process_default() -> DeviceManager:
    return _ProcessDefault.from_env()


def forget_process_default() -> None:
    """Choose the process default again: the accelerator changed (the stand-in started)."""
    _process_default.cache_clear()


# current_device()'s fallback: the process-wide manager, made on first use.
register_process_default(lambda: _process_default().device)
