"""DeviceManager: find the devices, choose one, say why; and devicekit's default device.

The default device of every devicekit call given ``device=None`` is the innermost
``with manager:`` block's device, else the device a process-wide
``DeviceManager.from_env()`` chose. The blocks live in a :class:`~contextvars.ContextVar`,
so threads and asyncio tasks each see their own.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Literal, NoReturn, TypeAlias, cast

import torch

from devicekit import _claims
from devicekit._backends import Backend, DeviceInfo, builtin_backends, cuda_started
from devicekit._devices import DeviceLike, has_backend, parse_device, shown
from devicekit._errors import DeviceUnavailableError
from devicekit._warnings import warn

__all__ = [
    "DeviceManager",
    "Fallback",
    "Policy",
    "claim_holders",
    "current_device",
    "parse_bytes",
    "parse_seconds",
    "who_uses",
]

Policy: TypeAlias = Literal["auto", "most-free-memory", "local-rank"]
Fallback: TypeAlias = Literal["cpu", "error"]

_POLICIES = ("auto", "most-free-memory", "local-rank")
_FALLBACKS = ("cpu", "error")
_FAMILIES = ("cuda", "rocm", "xpu", "mps", "cpu")
_HOST_TYPES = ("cpu", "meta")
# "auto" takes the lowest-numbered device whose free memory is within this share of the
# most free: an idle multi-GPU machine then gives cuda:0, not whichever GPU happens to
# have a few megabytes more free, while a busy cuda:0 is passed over.
_AUTO_FREE_TOLERANCE = 0.05

# The `with manager:` blocks open in this thread or task, innermost last: each entry is
# (the manager, its device), so a manager leaving removes its own entry, not the last.
_active: ContextVar[tuple[tuple[object, torch.device], ...]] = ContextVar(
    "devicekit_active", default=()
)
_fallback_warned = threading.Event()  # the CPU fallback warns once per process
_logger = logging.getLogger("devicekit")

# Waiting for a device: NVML is read again after 1 s, then twice as long each time up to
# 30 s, so a queue of jobs polls a busy server a few times a minute, not in a loop.
_FIRST_POLL_S = 1.0
_LONGEST_POLL_S = 30.0
_clock = time.monotonic  # the tests' fake clock replaces these two
_sleep = time.sleep

_MOST_BYTES = 1e24  # a yottabyte: no device comes near
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# One run of spaces only, inside: the string is stripped first, since two optional runs
# side by side make a regex backtrack quadratically on a long run of spaces.
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)


def parse_bytes(size: int | str) -> int:
    """Read a memory size: bytes as an int, or a string such as ``"8GiB"`` or ``"500 MB"``.

    >>> parse_bytes("8GiB"), parse_bytes("1.5 GB"), parse_bytes(1024)
    (8589934592, 1500000000, 1024)

    Raises:
        ValueError: The size is negative or not in one of these forms.
    """
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    match = _SIZE.fullmatch(size.strip()) if isinstance(size, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        msg = (
            "Expected min_free_memory as a number of bytes or a size such as '8GiB', "
            f"'500MB' or '1.5 GB', got {shown(size)}."
        )
        raise ValueError(msg)
    nbytes = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not nbytes < _MOST_BYTES:  # inf, where the digits outrun a float, included
        msg = (
            f"Expected min_free_memory as a size a device can have, got {shown(size)}: "
            "more than a yottabyte."
        )
        raise ValueError(msg)
    return int(nbytes)


_DURATION = re.compile(
    r"(\d+(?:\.\d+)?)\s*(s|secs?|seconds?|m|mins?|minutes?|h|hrs?|hours?)?", re.IGNORECASE
)
_SECONDS_PER = {"s": 1, "m": 60, "h": 3600}


def parse_seconds(duration: float | str) -> float:
    """Read a duration: seconds as a number, or a string such as ``"90s"``, ``"10m"``, ``"1.5h"``.

    >>> parse_seconds("10m"), parse_seconds("1.5 hours"), parse_seconds(30)
    (600.0, 5400.0, 30.0)

    Raises:
        ValueError: The duration is negative, not finite, or not in one of these forms.
    """
    if (
        isinstance(duration, int | float)
        and not isinstance(duration, bool)
        and math.isfinite(duration)
        and duration >= 0
    ):
        return float(duration)
    match = _DURATION.fullmatch(duration.strip()) if isinstance(duration, str) else None
    if match is None:
        msg = (
            "Expected wait as a number of seconds of 0 or more, or a duration such as '90s', "
            f"'10m' or '1.5h', got {shown(duration)}."
        )
        raise ValueError(msg)
    unit = (match.group(2) or "s")[0].lower()
    return float(match.group(1)) * _SECONDS_PER[unit]


def _duration(seconds: float) -> str:
    """``45 s``, ``10 min``, ``1.5 h``: a wait as a person says it."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _claim_key(info: DeviceInfo) -> str:
    """What names a device's claim: its UUID, else its family and index as this process has them."""
    return info.uuid or f"{info.backend}-{info.index}"


def claim_holders(devices: Sequence[DeviceInfo]) -> dict[torch.device, int | None]:
    """The accelerators among ``devices`` that a job claims, with its pid (None: unknown)."""
    keys = {_claim_key(info): info.device for info in devices if info.device.type != "cpu"}
    return {keys[key]: pid for key, pid in _claims.holders(list(keys)).items()}


def who_uses(info: DeviceInfo) -> str:
    """Who uses a GPU, as NVML lists them: ``31.0 GiB used by pid 4242, pid 77``."""
    if not info.processes:
        return ""
    ordered = sorted(info.processes, key=lambda process: -(process.used_memory or 0))
    named = [
        f"{_size(process.used_memory)} used by pid {process.pid}"
        if process.used_memory is not None
        else f"used by pid {process.pid}"
        for process in ordered[:3]
    ]
    more = len(ordered) - len(named)
    return ", ".join(named) + (f" and {more} more" if more else "")


def describe(info: DeviceInfo) -> str:
    """One line about a device, as ``explain()`` and ``devicekit info`` show it."""
    parts = [f"{info.device!s:<8}", info.name or "unknown model"]
    if info.free_memory is not None and info.total_memory is not None:
        parts.append(f"{_size(info.free_memory)} free of {_size(info.total_memory)}")
    elif info.total_memory is not None:
        parts.append(f"{_size(info.total_memory)}, free memory unknown")
    if info.capability is not None:
        parts.append(f"compute capability {info.capability[0]}.{info.capability[1]}")
    if info.utilization is not None:
        parts.append(f"{info.utilization:.0%} busy")
    return f"{parts[0]} {', '.join(parts[1:])}"


# The variables that give a process its own devices, by device type.
_VISIBILITY_VARIABLES = {
    "cuda": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    "xpu": ("ZE_AFFINITY_MASK",),
}


def _visibility_set(device_type: str) -> bool:
    """Whether this process was given its own devices (CUDA_VISIBLE_DEVICES and the like)."""
    return any(os.environ.get(name) for name in _VISIBILITY_VARIABLES.get(device_type, ()))


def _count(number: int, noun: str) -> str:
    """``1 cuda device``, ``2 cuda devices``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _processes(count: int) -> str:
    return "1 process" if count == 1 else f"{count} processes"


def _local_world_size() -> int | None:
    """Torchrun's LOCAL_WORLD_SIZE, the processes on this node; None where unset or odd."""
    return _whole_number(os.environ.get("LOCAL_WORLD_SIZE", ""))


def _whole_number(value: str) -> int | None:
    """``value`` as a small whole number (ASCII digits, as launchers write them), or None."""
    value = value.strip()
    return int(value) if value.isascii() and value.isdecimal() and len(value) <= 9 else None


def _local_rank() -> int | None:
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        return None
    rank = _whole_number(value)
    if rank is None:
        msg = (
            "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, "
            f"got {shown(value)}."
        )
        raise ValueError(msg)
    return rank


def _listed(backend: Backend) -> list[DeviceInfo]:
    """What ``backend.devices()`` lists, checked: a custom backend's mistake named here."""
    found = list(backend.devices())
    for position, info in enumerate(found):
        if not isinstance(info, DeviceInfo):  # for untyped backends
            msg = (  # type: ignore[unreachable]
                f"Expected the {backend.name!r} backend's devices() to list devicekit.DeviceInfo "
                f"objects, got {type(info).__name__} {shown(info)} at position {position}."
            )
            raise TypeError(msg)
    return found


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


def _percent(share: float) -> str:
    return f"{share * 100:.3g}%"


class _NotYet(Exception):  # noqa: N818 - a signal inside selection, never raised to users
    """Nothing qualifies now, and the manager may still wait for a device that does."""


class DeviceManager:
    """Detect the devices of this machine, select one, and explain the choice.

    Replaces ``torch.device("cuda" if torch.cuda.is_available() else "cpu")``: it sees
    CUDA, ROCm, XPU and MPS devices without starting CUDA, avoids a GPU that others
    are filling, follows torchrun's ``LOCAL_RANK``, and says so when it falls back to
    the CPU. Inside ``with manager:``, devicekit calls given ``device=None`` use
    :attr:`device`.

    >>> import devicekit as dk
    >>> manager = dk.DeviceManager("cpu")
    >>> manager.device
    device(type='cpu')
    >>> with manager:
    ...     dk.current_device()
    device(type='cpu')

    Args:
        device: A device to use (``"cuda:1"``, ``torch.device``, or an index on the
            preferred accelerator); None lets ``policy`` choose.
        prefer: Families in order of preference; the first with a usable device wins.
            ``"cuda"`` also matches ROCm GPUs, which PyTorch addresses as ``cuda``.
        policy: ``"auto"`` (torchrun's ``LOCAL_RANK`` when set, else the lowest-numbered
            device with about the most free memory), ``"most-free-memory"``, or
            ``"local-rank"``.
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
            Held until :meth:`close`, the end of a ``with manager:`` block, or the
            process ending in any way, ``kill -9`` included; never by a forked child.
            Claims are per process: managers of one process that select the same GPU
            share its claim (a notebook cell run twice keeps one GPU), so name the
            devices where one process claims several.
        fallback: With no usable accelerator, ``"cpu"`` uses the CPU and warns once;
            ``"error"`` raises :class:`~devicekit.DeviceUnavailableError`.
        backends: The device families to look at; None for the built-in ones. Tests
            pass fakes here.

    Raises:
        DeviceUnavailableError: ``device`` does not parse or is not on this machine, or
            nothing usable was found with ``fallback="error"``.
        ValueError: An option has a value outside those listed above.
        OSError: ``claim=True`` where the claim directory cannot be made or used
            (``DEVICEKIT_CLAIM_DIR`` relative, not a directory, a link another user made,
            or a claim file there that is no plain file of its own).
    """

    def __init__(
        self,
        device: DeviceLike | None = None,
        *,
        prefer: Sequence[str] = ("cuda", "xpu", "mps", "cpu"),
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
        self._backends = list(builtin_backends() if backends is None else backends)
        for backend in self._backends:
            if not isinstance(backend, Backend):  # for untyped callers
                msg = (  # type: ignore[unreachable]
                    "Expected backends with a name, a device_type and devices() (the "
                    f"devicekit.Backend protocol), got {type(backend).__name__} "
                    f"{shown(backend)}."
                )
                raise TypeError(msg)
        known = {*_FAMILIES, *(b.name for b in self._backends)}
        if isinstance(prefer, str) or not prefer or not all(name in known for name in prefer):
            msg = (
                f"Expected prefer to list device families among {sorted(known)}, in order "
                f"of preference, got {prefer!r}."
            )
            raise ValueError(msg)
        self._prefer = tuple(prefer)
        self._min_free = None if min_free_memory is None else parse_bytes(min_free_memory)
        self._max_busy = _share(max_utilization)
        self._wait = None if wait is None else parse_seconds(wait)
        if claim is not True and claim is not False:
            msg = f"Expected claim to be True or False, got {shown(claim)}."  # type: ignore[unreachable]
            raise TypeError(msg)
        self._claiming = claim
        self._fallback = fallback
        self._claim: _claims.Claim | None = None
        self._claim_name: str | None = None  # what names the claim, to take it again
        self._device, self._reason = self._settle(device, policy)

    @classmethod
    def from_env(cls, **options: Any) -> DeviceManager:
        """A manager configured by the environment, for scripts and launchers.

        ``DEVICEKIT_DEVICE`` (``"cuda:1"``, ``"cpu"``, an index) when set, as in the
        constructor given no device, and here over a ``device`` given as a default;
        else torchrun's ``LOCAL_RANK`` selects ``cuda:LOCAL_RANK`` among the visible
        devices, and makes it the current device of the process (``set_device``) before
        returning; else ``options`` decide, as in the constructor.

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
            DeviceUnavailableError: ``DEVICEKIT_DEVICE`` names no device of this machine.
            ValueError: ``LOCAL_RANK`` is not a whole number of 0 or more.
        """
        if os.environ.get("DEVICEKIT_DEVICE", "").strip():
            # The variable overrides a program's default, as environment settings do.
            options.pop("device", None)
        elif _local_rank() is not None:
            options.setdefault("policy", "local-rank")
        return cls(**options)

    @property
    def device(self) -> torch.device:
        """The selected device."""
        return self._device

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        """Every device found, by family in the order of ``backends``."""
        return self._devices

    @property
    def reason(self) -> str:
        """Why :attr:`device` was chosen, in a few words (the first line of :meth:`explain`)."""
        return self._reason

    def notes(self) -> dict[str, str]:
        """Why families found nothing, by family name (``{"cuda": "no CUDA support ..."}``)."""
        return {
            backend.name: note
            for backend in self._backends
            if (note := getattr(backend, "note", None)) and not self._found[id(backend)]
        }

    def explain(self) -> str:
        """A few lines: what was chosen and why, then everything that was seen.

        Returns:
            The explanation, one sentence per line.
        """
        chosen = next((info for info in self._devices if info.device == self._device), None)
        name = f" ({chosen.name})" if chosen is not None and chosen.name else ""
        lines = [f"Selected {self._device}{name}: {self._reason}."]
        lines += [f"Skipped {skipped}." for skipped in self._skipped]
        if self._claim is not None:
            lines.append(f"Claimed with {self._claim.path}, until close() or the process ends.")
        lines.append("Devices seen:")
        lines += [f"  {describe(info)}" for info in self._devices]
        lines += [f"  no {name}: {note}" for name, note in self.notes().items()]
        return "\n".join(lines)

    def close(self) -> None:
        """Give back the claim this manager holds (``claim=True``); nothing else changes.

        Where other managers of this process share the claim, the GPU stays claimed until
        the last of them closes. The process ending gives it back too, however it ends.
        Leaving ``with manager:`` closes the manager; a second call does nothing.
        """
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def __repr__(self) -> str:
        return f"DeviceManager(device={self._device!r})"

    def __enter__(self) -> DeviceManager:
        if self._claiming and self._claim is None and self._claim_name is not None:
            self._claim_again()
        _active.set((*_active.get(), (self, self._device)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        active = _active.get()
        for position in range(len(active) - 1, -1, -1):
            if active[position][0] is self:
                active = active[:position] + active[position + 1 :]
                _active.set(active)
                break
        if all(entry[0] is not self for entry in active):  # its outermost block: claim given back
            self.close()

    def _claim_again(self) -> None:
        """Claim the device once more, entering ``with manager:`` after leaving one."""
        claim = _claims.take(self._claim_name or "")
        if claim is None:
            holder = claim_holders(self._devices).get(self._device)
            msg = (
                f"Cannot claim {self._device} again on entering `with manager:`: "
                f"{'another job' if holder is None else f'pid {holder}'} claimed it after "
                "this manager gave it back at the end of its last block. Keep one block "
                "around the whole run to hold the GPU throughout."
            )
            raise DeviceUnavailableError(msg)
        self._claim = claim

    # Selection.

    def _look(self) -> None:
        """List the devices (again), and the claims on them where this manager claims."""
        self._found = {id(backend): _listed(backend) for backend in self._backends}
        self._devices = tuple(info for infos in self._found.values() for info in infos)
        self._claimed = claim_holders(self._devices) if self._claiming else {}
        self._skipped: list[str] = []

    def _settle(self, device: DeviceLike | None, policy: Policy) -> tuple[torch.device, str]:
        """Select as ``_select`` does, waiting and claiming as asked: the device, and why."""
        started, pause = _clock(), _FIRST_POLL_S
        self._waiting = bool(self._wait)  # while True, finding nothing raises _NotYet
        self._waited: float | None = None
        lost: dict[torch.device, int | None] = {}  # claims lost to another job in a race
        while True:
            self._look()
            self._claimed = {**lost, **self._claimed}
            try:
                chosen, reason = self._select(device, policy)
            except _NotYet as not_yet:
                waited = _clock() - started
                left = (self._wait or 0) - waited
                if left <= 0:  # one more look, which falls back (or fails) with the reason
                    self._waiting, self._waited = False, waited
                    continue
                if pause == _FIRST_POLL_S:  # before the first pause only: said once
                    details = " ".join(self._passed_over())
                    _logger.warning(
                        "devicekit waits up to %s for a device: %s. %s",
                        _duration(self._wait or 0),
                        not_yet,
                        details,
                    )
                _sleep(min(pause, left))
                pause = min(pause * 2, _LONGEST_POLL_S)
                continue
            if not self._claiming or chosen.type in _HOST_TYPES:
                return chosen, reason
            info = next((info for info in self._devices if info.device == chosen), None)
            name = str(chosen) if info is None else _claim_key(info)
            claim = _claims.take(name)
            if claim is None:  # taken since the look: look again, knowing it is
                lost[chosen] = None
                continue
            self._claim, self._claim_name = claim, name
            return chosen, f"{reason}; claimed for this process"

    def _unusable(self, msg: str) -> NoReturn:
        """Fail selection: wait and look again where ``wait`` allows, else raise ``msg``."""
        if self._waiting:
            raise _NotYet(msg)
        if self._waited is not None:
            msg += f" (after waiting {_duration(self._waited)})"
        raise DeviceUnavailableError(msg + ".")

    def _family(self, name: str) -> list[DeviceInfo]:
        return [
            info
            for backend in self._backends
            if name in (backend.name, backend.device_type) and backend.device_type != "cpu"
            for info in self._found[id(backend)]
        ]

    def _accelerators(self) -> tuple[str, list[DeviceInfo]] | None:
        """The first preferred accelerator family with devices, and its devices."""
        for name in self._prefer:
            if name != "cpu" and (found := self._family(name)):
                return name, found
        return None

    def _seen(self) -> str:
        return ", ".join(str(info.device) for info in self._devices) or "none"

    def _select(self, device: DeviceLike | None, policy: Policy) -> tuple[torch.device, str]:
        if device is not None:
            return self._explicit(device)
        spec = os.environ.get("DEVICEKIT_DEVICE", "").strip()
        if spec:
            index = _whole_number(spec)
            try:
                chosen, _ = self._explicit(spec if index is None else index)
            except DeviceUnavailableError as err:
                msg = f"DEVICEKIT_DEVICE={shown(spec)} cannot be used: {err}"
                raise DeviceUnavailableError(msg) from None
            return chosen, "DEVICEKIT_DEVICE asks for it"
        if policy == "local-rank" or (policy == "auto" and _local_rank() is not None):
            return self._by_local_rank()
        for position, name in enumerate(self._prefer):
            if name == "cpu":
                if position == 0:  # asked for before any accelerator: no fallback
                    return torch.device("cpu"), "prefer puts the CPU first"
                return self._fall_back()
            found = self._family(name)
            usable = [info for info in found if self._qualifies(info)]
            if usable:
                return self._by_memory(usable, strict=policy == "most-free-memory")
        return self._fall_back()

    def _explicit(self, spec: DeviceLike) -> tuple[torch.device, str]:
        if isinstance(spec, int) and not isinstance(spec, bool):
            family = self._accelerators()
            if family is None or spec < 0 or spec >= len(family[1]):
                msg = (
                    f"Expected the index of an accelerator device, got {spec}; "
                    f"devices here: {self._seen()}."
                )
                raise DeviceUnavailableError(msg)
            return family[1][spec].device, f"asked for index {spec} of {family[0]}"
        device = parse_device(spec)
        if device.type in _HOST_TYPES:
            return torch.device(device.type), f"asked for {device.type}"
        found = [info for info in self._devices if info.device.type == device.type]
        if not found and not any(b.device_type == device.type for b in self._backends):
            if not has_backend(device.type):
                msg = (
                    f"Expected a device of a backend this PyTorch has, got {shown(str(spec))}: "
                    f"no {device.type} backend is loaded (an extension such as torch_xla "
                    f"registers one when imported). Devices here: {self._seen()}."
                )
                raise DeviceUnavailableError(msg)
            return device, f"asked for {device}, a device type devicekit cannot check"
        index = cast("int | None", device.index)  # None for "cuda", whatever the stubs say
        if index is None:
            index = torch.cuda.current_device() if cuda_started() else 0
        match = next((info for info in found if info.index == index), None)
        if match is None:
            choices = ", ".join(repr(str(info.device)) for info in self._devices)
            msg = (
                f"Expected one of {choices} (the devices here), got {shown(str(spec))}: "
                f"{self._why_none(device.type, found)}."
            )
            raise DeviceUnavailableError(msg)
        if match.device in self._claimed:
            holder = self._claimed[match.device]
            self._unusable(
                f"Cannot claim {match.device}, asked for as {shown(str(spec))}: "
                f"{'another job' if holder is None else f'pid {holder}'} claims it"
            )
        return match.device, f"asked for {spec}"

    def _why_none(self, device_type: str, found: list[DeviceInfo]) -> str:
        """Why a device of ``device_type`` asked for by index is not here, in a few words."""
        if found:
            indices = ", ".join(str(info.device) for info in found)
            return f"this process sees {_count(len(found), device_type + ' device')} ({indices})"
        notes = [
            note
            for backend in self._backends
            if backend.device_type == device_type and (note := getattr(backend, "note", None))
        ]
        return f"no {device_type} device is visible" + (f" ({notes[0]})" if notes else "")

    def _qualifies(self, info: DeviceInfo) -> bool:
        """Whether an accelerator may be chosen; where not, why is noted for explain()."""
        why = []
        free, busy = info.free_memory, info.utilization
        if self._min_free is not None and free is not None and free < self._min_free:
            of = f" of {_size(info.total_memory)}" if info.total_memory is not None else ""
            why.append(
                f"{_size(free)} free{of}, less than the {_size(self._min_free)} "
                "min_free_memory asks"
            )
        if self._max_busy is not None and busy is not None and busy > self._max_busy:
            why.append(
                f"{_percent(busy)} busy, more than the {_percent(self._max_busy)} "
                "max_utilization allows"
            )
        if info.device in self._claimed:
            holder = self._claimed[info.device]
            why.append(f"claimed by {'another job' if holder is None else f'pid {holder}'}")
        if not why:
            return True
        used = who_uses(info)
        self._skipped.append(f"{info.device}: {'; '.join(why)}" + (f" ({used})" if used else ""))
        return False

    def _passed_over(self) -> list[str]:
        """Why each accelerator family or device was not chosen, a sentence each."""
        reasons = [f"Passed over {skipped}." for skipped in self._skipped]
        for backend in self._backends:
            if backend.device_type == "cpu":
                continue
            found = self._found[id(backend)]
            wanted = backend.name in self._prefer or backend.device_type in self._prefer
            if not found and wanted:
                note = getattr(backend, "note", None)
                reasons.append(
                    f"No {backend.name} device is visible" + (f" ({note})" if note else "") + "."
                )
            elif found and not wanted:
                devices = ", ".join(str(info.device) for info in found)
                reasons.append(
                    f"Passed over {devices}: {backend.name} is not among prefer {self._prefer}."
                )
        return reasons

    def _by_memory(self, usable: list[DeviceInfo], *, strict: bool) -> tuple[torch.device, str]:
        if any(info.free_memory is None for info in usable):
            first = usable[0]
            return first.device, f"the first {first.backend} device; free memory is unknown"
        most = max(info.free_memory or 0 for info in usable)
        floor = most if strict else most * (1 - _AUTO_FREE_TOLERANCE)
        chosen = next(info for info in usable if (info.free_memory or 0) >= floor)
        free = f"{_size(chosen.free_memory or 0)} of {_size(chosen.total_memory or 0)}"
        if len(usable) == 1:
            return chosen.device, f"the only usable {chosen.backend} device ({free} free)"
        if strict or chosen.free_memory == most:
            return chosen.device, f"it has the most free memory ({free})"
        return chosen.device, f"the first with about the most free memory ({free})"

    def _by_local_rank(self) -> tuple[torch.device, str]:
        rank = _local_rank()
        if rank is None:
            msg = "Expected LOCAL_RANK to be set (torchrun sets it) for policy='local-rank'."
            raise DeviceUnavailableError(msg)
        family = self._accelerators()
        if family is None:
            return self._fall_back(f"LOCAL_RANK={rank}, but no accelerator was found")
        name, found = family
        device_type = found[0].device.type
        split = _visibility_set(device_type)
        ranks = _local_world_size()
        if not split and ranks is not None and ranks > len(found):
            msg = (
                f"Expected at most {_processes(len(found))} on this node, one per {name} "
                f"device, but LOCAL_WORLD_SIZE={ranks}: ranks would share a device, which NCCL "
                f"refuses ('Duplicate GPU detected'). Start {len(found)} per node "
                f"(torchrun --nproc_per_node={len(found)}), or give each process its own "
                f"{_VISIBILITY_VARIABLES.get(device_type, ('CUDA_VISIBLE_DEVICES',))[0]}."
            )
            raise DeviceUnavailableError(msg)
        if len(found) == 1 and (split or rank == 0):
            # One visible device per process: the launcher already split them.
            chosen = self._current(found[0], rank)
            return chosen, f"LOCAL_RANK={rank}, and this process sees one {name} device"
        if rank >= len(found):
            msg = (
                f"Expected LOCAL_RANK to be below the number of {name} devices this process "
                f"sees ({len(found)}), got {rank}: ranks would share a device, which NCCL "
                f"refuses ('Duplicate GPU detected'). Start at most {_processes(len(found))} per "
                f"node (torchrun --nproc_per_node={len(found)}), or give each process its own "
                f"{_VISIBILITY_VARIABLES.get(device_type, ('CUDA_VISIBLE_DEVICES',))[0]}."
            )
            raise DeviceUnavailableError(msg)
        return self._current(found[rank], rank), f"LOCAL_RANK={rank} (torchrun) selects it"

    def _current(self, info: DeviceInfo, rank: int) -> torch.device:
        """The device of ``rank``, made the current device of the process.

        Before NCCL's first call, so that every rank works on its own GPU rather than
        all of them on ``cuda:0`` (PyTorch warns that a barrier would "guess" otherwise).
        """
        if not self._qualifies(info):
            self._unusable(f"LOCAL_RANK={rank} selects {info.device}, but {self._skipped[-1]}")
        backend = next(b for b in self._backends if info in self._found[id(b)])
        make_current = getattr(backend, "make_current", None)
        if make_current is not None:  # a family of one device (MPS) has nothing to set
            make_current(info.device)
        return info.device

    def _fall_back(self, why: str | None = None) -> tuple[torch.device, str]:
        wanted = [name for name in self._prefer if name != "cpu"]
        if not wanted:
            return torch.device("cpu"), "prefer asks for the CPU"
        looked = wanted[0] if len(wanted) == 1 else f"{', '.join(wanted[:-1])} or {wanted[-1]}"
        why = why or f"no {looked} device is usable"
        if self._waiting:
            # Waiting frees a busy or claimed device; it never makes one appear (a
            # PyTorch without CUDA, a machine without GPUs): there, give up at once.
            if any(self._family(name) for name in wanted):
                raise _NotYet(why)
            why += " (none is visible, so wait= has nothing to wait for)"
        if self._waited is not None:
            why += f" after waiting {_duration(self._waited)}"
        reasons = " ".join(self._passed_over())
        if self._fallback == "error":
            msg = f"Expected a usable {looked} device, but {why}. {reasons}".rstrip()
            msg += f" Devices here: {self._seen()}."
            raise DeviceUnavailableError(msg)
        if not _fallback_warned.is_set():
            _fallback_warned.set()
            # One sentence: explain() has the rest, what was seen and passed over.
            warn(f"devicekit uses the CPU: {why}; see DeviceManager().explain().", RuntimeWarning)
        return torch.device("cpu"), f"{why}, so the CPU is the fallback"


@functools.cache
def _process_default() -> DeviceManager:
    return DeviceManager.from_env()


def current_device() -> torch.device:
    """The device devicekit calls use when given ``device=None``.

    That is the device of the innermost ``with manager:`` block in this thread or
    asyncio task, else the one ``DeviceManager.from_env()`` selects for the process
    (built once, on first use).

    >>> import devicekit as dk
    >>> with dk.DeviceManager("meta"):
    ...     dk.current_device()
    device(type='meta')

    Returns:
        The device.
    """
    active = _active.get()
    if active:
        return active[-1][1]
    return _process_default().device
