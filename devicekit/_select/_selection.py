"""Choosing a device: a pure function of what was seen and what was asked.

:func:`choose` takes a :class:`Seen` snapshot (the devices each family listed, the
claims other jobs hold, what the launcher's variables say) and a :class:`Request` (the
manager's options) and returns one outcome:

- :class:`Chosen`: a device and why, with what was passed over on the way;
- :class:`Wait`: nothing qualifies now, and the manager may wait for something that can;
- :class:`Refused`: the message of the error to raise, and where a launcher's local rank
  was refused, which of its variables (a :class:`RankProblem`, which ``devicekit doctor``
  names: the doctor asks this function rather than repeating its rules).

Nothing here reads the environment, sleeps, logs, warns or raises for the user: the
manager (:mod:`devicekit._select._manager`) looks, chooses, waits and looks again, claims, then
explains. So every rule of the choice is a line of the table of cases in
tests/test_selection.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, TypeAlias, cast

import torch

from devicekit._base import (
    HOST_TYPES,
    DeviceKitError,
    DeviceLike,
    count,
    duration,
    gib,
    no_backend,
    parse_device,
    percent,
    shown,
)
from devicekit._select._backends import DeviceInfo, Family, who_uses
from devicekit._select._claims import Holder
from devicekit._select._launch import (
    LAUNCHERS,
    BadRank,
    Launcher,
    LocalRank,
    devicekit_device,
    given_devices,
    local_rank,
    own_devices_variable,
    whole_number,
)

__all__ = [
    "Chosen",
    "RankProblem",
    "Refused",
    "Request",
    "Seen",
    "Wait",
    "choose",
]

Policy: TypeAlias = Literal["auto", "most-free-memory", "local-rank"]
Fallback: TypeAlias = Literal["cpu", "error"]

# "auto" takes the lowest-numbered device whose free memory is within this share of the
# most free: an idle multi-GPU machine then gives cuda:0, not whichever GPU happens to
# have a few megabytes more free, while a busy cuda:0 is passed over.
_AUTO_FREE_TOLERANCE = 0.05


class Seen(NamedTuple):
    """What the manager saw of the machine and of its environment, for one choice."""

    families: tuple[Family, ...]
    claimed: Mapping[torch.device, Holder | int | None] = MappingProxyType({})
    """Claimed devices, with who claims each: a Holder (this process's own claims among
    them), a pid, or None where unknown."""
    devicekit_device: str = ""  # DEVICEKIT_DEVICE, stripped
    local_rank: LocalRank | BadRank | None = None
    """The innermost launcher's local rank; a BadRank matters only where the rank is used."""
    split: frozenset[str] = frozenset()
    """Device types with a visibility variable set (CUDA_VISIBLE_DEVICES...): one device
    seen is this process's own; several are its own only where Slurm bound them to the
    task (``local_rank.per_task``), since a launcher gives every process the same ones."""
    cuda_index: int = 0  # what "cuda" names: the current CUDA device, 0 before CUDA starts
    loaded: Callable[[str], bool] = lambda device_type: False
    """Whether PyTorch has a backend for a device type no family lists (torch_xla's)."""

    @classmethod
    def of(cls, families: tuple[Family, ...], environ: Mapping[str, str], **more: Any) -> Seen:
        """What a manager sees: ``families``, and what the launcher's ``environ`` says."""
        return cls(
            families,
            devicekit_device=devicekit_device(environ),
            local_rank=local_rank(environ),
            split=given_devices(environ),
            **more,
        )

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        """Every device seen, family by family."""
        return tuple(info for family in self.families for info in family.devices)


def family_notes(families: Iterable[Family]) -> dict[str, str]:
    """Why families found no device, by family name (``{"cuda": "no CUDA support ..."}``)."""
    return {family.name: family.note for family in families if family.note and not family.devices}


class Request(NamedTuple):
    """What the manager was asked for: its options, and where its waiting stands."""

    device: DeviceLike | None = None
    policy: Policy = "auto"
    prefer: tuple[str, ...] = ("cuda", "xpu", "mps", "cpu")
    min_free: int | None = None
    max_busy: float | None = None
    fallback: Fallback = "cpu"
    waiting: bool = False  # a refusal that waiting could lift comes back as a Wait
    waited: float | None = None  # seconds waited already, said in the reason


class Chosen(NamedTuple):
    """The device chosen, and why."""

    device: torch.device
    reason: str
    skipped: tuple[str, ...] = ()  # "cuda:0: 85% busy, ..." for each device passed over
    current: bool = False  # a rank's device: made the process's current device
    fell_back: str | None = None  # why the CPU, as fallback="cpu" allows: warned of once


class Wait(NamedTuple):
    """Nothing qualifies now; a device that can qualify later was seen."""

    why: str
    passed_over: tuple[str, ...] = ()  # a sentence each, for the one message of the wait


class RankProblem(NamedTuple):
    """Why a launcher's local rank selects no device of the process's own, as facts.

    ``devicekit doctor`` words its finding from these; the manager raises the message of
    the :class:`Refused` that carries them.
    """

    code: Literal["local-rank-not-a-number", "more-ranks-than-devices"]
    variable: str  # the launcher's variable at fault: LOCAL_RANK, LOCAL_WORLD_SIZE, ...
    value: str  # its value, as set
    launcher: Launcher
    family: str = ""  # the accelerator family the ranks share
    devices: int = 0  # how many of its devices this process sees
    apart: str = ""
    """The other fix, in advice's words: how each process would get devices of its own
    (``give each process its own CUDA_VISIBLE_DEVICES``; srun's binding for its tasks)."""


class Refused(NamedTuple):
    """Nothing can be chosen: the message of the error to raise.

    A :class:`~devicekit.DeviceUnavailableError`, or a ValueError where the launcher's
    local rank is no number (``rank.code == "local-rank-not-a-number"``), as for any
    setting of the wrong form.
    """

    message: str
    rank: RankProblem | None = None  # where a launcher's local rank was refused


Outcome: TypeAlias = Chosen | Wait | Refused


def choose(seen: Seen, request: Request) -> Outcome:
    """The device ``request`` asks for among what was ``seen``; or a reason to wait; or no.

    >>> gpu = DeviceInfo(torch.device("cuda", 0), "cuda", 0, "H100", 80 * 2**30,
    ...                  2 * 2**30, (9, 0), "GPU-0", 0.99)
    >>> seen = Seen((Family("cuda", "cuda", (gpu,)),))
    >>> choose(seen, Request(max_busy=0.5)).reason
    'no cuda, xpu or mps device is usable, so the CPU is the fallback'
    >>> choose(seen, Request(max_busy=0.5, waiting=True)).why
    'no cuda, xpu or mps device is usable'
    """
    return _Choice(seen, request).outcome()


class _Choice:
    """One choice: the snapshot, the request, and the devices passed over so far."""

    def __init__(self, seen: Seen, request: Request) -> None:
        self.seen, self.request = seen, request
        self.skipped: list[str] = []
        # A device named (device=, DEVICEKIT_DEVICE, a rank's) may be one this process
        # claims: its managers share that claim. One chosen among others may not be.
        self.named = False

    def outcome(self) -> Outcome:
        request, seen = self.request, self.seen
        if request.device is not None:
            return self.explicit(request.device)
        spec = seen.devicekit_device
        if spec:
            index = whole_number(spec)
            found = self.explicit(spec if index is None else index)
            if isinstance(found, Refused):
                return Refused(f"DEVICEKIT_DEVICE={shown(spec)} cannot be used: {found.message}")
            if isinstance(found, Chosen):
                return found._replace(reason="DEVICEKIT_DEVICE asks for it")
            return found
        if request.policy == "local-rank" or (
            request.policy == "auto" and seen.local_rank is not None
        ):
            return self.by_local_rank()
        for position, name in enumerate(request.prefer):
            if name == "cpu":
                if position == 0:  # asked for before any accelerator: no fallback
                    return Chosen(torch.device("cpu"), "prefer puts the CPU first")
                return self.fall_back()
            usable = [info for info in self.family(name) if self.qualifies(info)]
            if usable:
                return self.by_memory(usable, strict=request.policy == "most-free-memory")
        return self.fall_back()

    # Where a device is named.

    def explicit(self, spec: DeviceLike) -> Outcome:
        seen, self.named = self.seen, True
        if isinstance(spec, int) and not isinstance(spec, bool):
            family = self.accelerators()
            if family is None or spec < 0 or spec >= len(family[1]):
                return Refused(
                    f"Expected the index of an accelerator device, got {shown(spec)}; "
                    f"devices here: {self.listed()}."
                )
            return self.chosen(family[1][spec].device, f"asked for index {spec} of {family[0]}")
        try:
            device = parse_device(spec)
        except DeviceKitError as err:
            return Refused(str(err))
        if device.type in HOST_TYPES:
            return self.chosen(torch.device(device.type), f"asked for {device.type}")
        found = [info for info in seen.devices if info.device.type == device.type]
        if not found and not any(f.device_type == device.type for f in seen.families):
            if not seen.loaded(device.type):
                listed = f" Devices here: {self.listed()}."
                return Refused(no_backend(shown(str(spec)), device.type) + listed)
            return self.chosen(device, f"asked for {device}, a device type devicekit cannot check")
        index = cast("int | None", device.index)  # None for "cuda", whatever the stubs say
        if index is None:
            index = seen.cuda_index
        match = next((info for info in found if info.index == index), None)
        if match is None:
            choices = ", ".join(repr(str(info.device)) for info in seen.devices)
            return Refused(
                f"Expected one of {choices} (the devices here), got {shown(str(spec))}: "
                f"{self.why_none(device.type, found)}."
            )
        if match.device in seen.claimed and not _ours(holder := seen.claimed[match.device]):
            return self.unusable(
                f"Cannot claim {match.device}, asked for as {shown(str(spec))}: "
                f"{_by(holder)} claims it"
            )
        return self.chosen(match.device, f"asked for {spec}")

    def why_none(self, device_type: str, found: list[DeviceInfo]) -> str:
        """Why a device of ``device_type`` asked for by index is not here, in a few words."""
        if found:
            indices = ", ".join(str(info.device) for info in found)
            return f"this process sees {count(len(found), device_type + ' device')} ({indices})"
        notes = [f.note for f in self.seen.families if f.device_type == device_type and f.note]
        return f"no {device_type} device is visible" + (f" ({notes[0]})" if notes else "")

    # Which devices qualify, and which of them.

    def qualifies(self, info: DeviceInfo) -> bool:
        """Whether an accelerator may be chosen; where not, why is noted in ``skipped``."""
        request, why = self.request, []
        free, busy = info.free_memory, info.utilization
        if request.min_free is not None and free is not None and free < request.min_free:
            of = f" of {gib(info.total_memory)}" if info.total_memory is not None else ""
            why.append(
                f"{gib(free)} free{of}, less than the {gib(request.min_free)} min_free_memory asks"
            )
        if request.max_busy is not None and busy is not None and busy > request.max_busy:
            why.append(
                f"{percent(busy)} busy, more than the {percent(request.max_busy)} "
                "max_utilization allows"
            )
        if info.device in self.seen.claimed:
            holder = self.seen.claimed[info.device]
            if not (self.named and _ours(holder)):  # a rank's device: its process's claim
                why.append(f"claimed by {_by(holder)}")
        if not why:
            return True
        used = who_uses(info)
        self.skipped.append(f"{info.device}: {'; '.join(why)}" + (f" ({used})" if used else ""))
        return False

    def by_memory(self, usable: list[DeviceInfo], *, strict: bool) -> Outcome:
        if any(info.free_memory is None for info in usable):
            first = usable[0]
            return self.chosen(
                first.device, f"the first {first.backend} device; free memory is unknown"
            )
        most = max(info.free_memory or 0 for info in usable)
        floor = most if strict else most * (1 - _AUTO_FREE_TOLERANCE)
        chosen = next(info for info in usable if (info.free_memory or 0) >= floor)
        free = f"{gib(chosen.free_memory or 0)} of {gib(chosen.total_memory or 0)}"
        if len(usable) == 1:
            return self.chosen(
                chosen.device, f"the only usable {chosen.backend} device ({free} free)"
            )
        if strict or chosen.free_memory == most:
            return self.chosen(chosen.device, f"it has the most free memory ({free})")
        return self.chosen(chosen.device, f"the first with about the most free memory ({free})")

    def by_local_rank(self) -> Outcome:
        """The device of the launcher's local rank, among the devices this process sees.

        The rank numbers processes, not devices, where each process has devices of its
        own: one device seen where a visibility variable is set, or Slurm's word that it
        bound GPUs to each of its tasks. There the process takes its first. Otherwise every
        process sees the same devices, and the rank picks one. Slurm's tasks, four to a
        node, with the GPUs each sees:

        >>> gpus = tuple(DeviceInfo(torch.device("cuda", i), "cuda", i) for i in range(4))
        >>> def device(seen_gpus, **environ):
        ...     seen = Seen.of((Family("cuda", "cuda", gpus[:seen_gpus]),), environ)
        ...     outcome = choose(seen, Request())
        ...     return outcome.device if isinstance(outcome, Chosen) else "refused"
        >>> task = {"SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4"}
        >>> bound = {**task, "SLURM_TRES_BIND": "gres/gpu:per_task:2"}  # --gpus-per-task=2
        >>> mv2 = {"MV2_COMM_WORLD_LOCAL_RANK": "2", "MV2_COMM_WORLD_LOCAL_SIZE": "4"}
        >>> batch_step = {"SLURM_LOCALID": "0", "SLURM_GPUS_PER_TASK": "1"}
        >>> unbound = {**task, "SLURM_TRES_BIND": "gres/gpu:none"}
        >>> def cvd(value): return {"CUDA_VISIBLE_DEVICES": value}
        >>> for case, seen_gpus, environ in [
        ...     ("--gres=gpu:4, the same for all", 4, {**task, **cvd("0,1,2,3")}),
        ...     ("--gres=gpu:2, two for four", 2, {**task, **cvd("0,1")}),
        ...     ("--gpus-per-task=1", 1, {**task, **cvd("2")}),
        ...     ("--gpus-per-task=2", 2, {**bound, **cvd("4,5")}),
        ...     ("--gpus-per-task=1, no variable", 1, {**task, "SLURM_GPUS_PER_TASK": "1"}),
        ...     ("--gpus-per-task=2, no variable", 2, bound),
        ...     ("--gpu-bind=none", 2, {**unbound, **cvd("0,1")}),
        ...     ("MVAPICH2 ranks srun started", 2, {**bound, **mv2, **cvd("4,5")}),
        ...     ("mpirun in the batch script", 4, {**batch_step, **mv2, **cvd("0,1,2,3")}),
        ...     ("nothing given, one seen", 1, task),
        ... ]:
        ...     print(f"{case:<32} {device(seen_gpus, **environ)}")
        --gres=gpu:4, the same for all   cuda:2
        --gres=gpu:2, two for four       refused
        --gpus-per-task=1                cuda:0
        --gpus-per-task=2                cuda:0
        --gpus-per-task=1, no variable   cuda:0
        --gpus-per-task=2, no variable   refused
        --gpu-bind=none                  refused
        MVAPICH2 ranks srun started      cuda:0
        mpirun in the batch script       cuda:2
        nothing given, one seen          refused

        With one GPU, bound to it and seen alone, the task's is that one, variable or not.
        With several and no variable, nothing says which are the task's: srun sets
        ``CUDA_VISIBLE_DEVICES`` to them, and something unset it.
        """
        seen, local, self.named = self.seen, self.seen.local_rank, True
        if local is None:
            variables = ", ".join(launcher.rank for launcher in LAUNCHERS)
            return Refused(
                f"Expected a launcher's local rank ({variables}) for policy='local-rank', "
                "but none is set."
            )
        if isinstance(local, BadRank):
            launcher = local.launcher
            problem = RankProblem("local-rank-not-a-number", launcher.rank, local.value, launcher)
            return Refused(local.message, problem)
        family = self.accelerators()
        if family is None:
            return self.fall_back(f"{local.said}, but no accelerator was found")
        name, found = family
        device_type, devices = found[0].device.type, len(found)
        split = device_type in seen.split
        rank, ranks = local.rank, local.size
        problem = RankProblem(
            "more-ranks-than-devices",
            local.launcher.rank,
            str(rank),
            local.launcher,
            name,
            devices,
            _apart(local, own_devices_variable(device_type)),
        )
        one = f"{local.said}, and this process sees one {name} device"
        if devices == 1 and split:
            # One visible device per process: the launcher already split them.
            return self.of_rank(found[0], local, one)
        if local.per_task and (split or devices == 1):
            # srun --gpus-per-task=2 binds each task to two GPUs of its own, seen as cuda:0
            # and cuda:1, and gives the third task SLURM_LOCALID=2: the rank numbers tasks,
            # not these devices. Only Slurm's word tells this from one CUDA_VISIBLE_DEVICES
            # for every process (plain --gres; torchrun or mpirun inside a task). Bound to
            # one GPU and seeing one, the task sees its own, whatever unset the variable.
            first = "the one it sees" if devices == 1 else f"the first of this process's {devices}"
            return self.of_rank(
                found[0],
                local,
                f"{local.said} ({local.started_by}), and Slurm bound each task to {name} "
                f"devices of its own ({local.per_task}): {first}",
            )
        if ranks is not None and ranks > devices:
            return Refused(
                f"Expected at most {_processes(devices)} on this node, one per {name} "
                f"device, but {local.launcher.size}={ranks}: "
                + _shared(f"Start {devices}", problem),
                problem._replace(variable=local.launcher.size, value=str(ranks)),
            )
        if devices == 1 and rank == 0:
            return self.of_rank(found[0], local, one)
        if rank >= devices:
            # Also where a visibility variable is set: torchrun, mpirun and srun without
            # per-task GPUs give every process the same ones, so ranks would share them.
            return Refused(
                f"Expected {local.launcher.rank} to be below the number of {name} devices "
                f"this process sees ({devices}), got {rank}: "
                + _shared(f"Start at most {_processes(devices)}", problem),
                problem,
            )
        return self.of_rank(found[rank], local, f"{local.said} ({local.started_by}) selects it")

    def of_rank(self, info: DeviceInfo, local: LocalRank, reason: str) -> Outcome:
        """The rank's device, to be made the process's current device (as ``Chosen.current``)."""
        if not self.qualifies(info):
            return self.unusable(f"{local.said} selects {info.device}, but {self.skipped[-1]}")
        return self.chosen(info.device, reason)._replace(current=True)

    # Where nothing qualifies.

    def unusable(self, msg: str) -> Outcome:
        """Nothing for ``msg``: a reason to wait where the manager may, else a refusal."""
        if self.request.waiting:
            return Wait(msg, tuple(self.passed_over()))
        if self.request.waited is not None:
            msg += f" (after waiting {duration(self.request.waited)})"
        return Refused(msg + ".")

    def fall_back(self, why: str | None = None) -> Outcome:
        request = self.request
        wanted = [name for name in request.prefer if name != "cpu"]
        if not wanted:
            return self.chosen(torch.device("cpu"), "prefer asks for the CPU")
        looked = _joined(wanted, "or")
        why = why or f"no {looked} device is usable"
        visible = {info.device: info for name in wanted for info in self.family(name)}
        # Claims of this process's other managers: a wait would wait for itself (a
        # notebook cell run twice on a one-GPU machine would wait out its wait=).
        ours = [str(device) for device in visible if _ours(self.seen.claimed.get(device))]
        if ours and len(ours) == len(visible):
            why += (
                f": {_joined(ours, 'and')} {'is' if len(ours) == 1 else 'are'} claimed by this "
                "process (another of its managers): close() it, leave its with block, or "
                "name the device to share it"
            )
            if request.waiting:
                why += " (wait= does not wait for this process)"
        elif request.waiting:
            # Waiting frees a busy or claimed device; it never makes one appear (a
            # PyTorch without CUDA, a machine without GPUs): there, give up at once.
            if visible:
                return Wait(why, tuple(self.passed_over()))
            why += " (none is visible, so wait= has nothing to wait for)"
        if request.waited is not None:
            why += f" after waiting {duration(request.waited)}"
        if request.fallback == "error":
            reasons = " ".join(self.passed_over())
            msg = f"Expected a usable {looked} device, but {why}. {reasons}".rstrip()
            return Refused(msg + f" Devices here: {self.listed()}.")
        chosen = self.chosen(torch.device("cpu"), f"{why}, so the CPU is the fallback")
        return chosen._replace(fell_back=why)

    def passed_over(self) -> list[str]:
        """Why each accelerator family or device was not chosen, a sentence each."""
        prefer = self.request.prefer
        reasons = [f"Passed over {reason}." for reason in self.skipped]
        for family in self.seen.families:
            if family.device_type == "cpu":
                continue
            wanted = family.name in prefer or family.device_type in prefer
            if not family.devices and wanted:
                note = f" ({family.note})" if family.note else ""
                reasons.append(f"No {family.name} device is visible{note}.")
            elif family.devices and not wanted:
                devices = ", ".join(str(info.device) for info in family.devices)
                reasons.append(
                    f"Passed over {devices}: {family.name} is not among prefer {prefer}."
                )
        return reasons

    # What was seen.

    def chosen(self, device: torch.device, reason: str) -> Chosen:
        return Chosen(device, reason, tuple(self.skipped))

    def family(self, name: str) -> list[DeviceInfo]:
        return [
            info
            for family in self.seen.families
            if name in (family.name, family.device_type) and family.device_type != "cpu"
            for info in family.devices
        ]

    def accelerators(self) -> tuple[str, list[DeviceInfo]] | None:
        """The first preferred accelerator family with devices, and its devices."""
        for name in self.request.prefer:
            if name != "cpu" and (found := self.family(name)):
                return name, found
        return None

    def listed(self) -> str:
        return ", ".join(str(info.device) for info in self.seen.devices) or "none"


def _by(holder: Holder | int | None) -> str:
    """Who claims a device, in words: ``pid 4242``, ``this process (...)``, ``another job``."""
    return str(holder if isinstance(holder, Holder) else Holder(holder))


def _ours(holder: Holder | int | None) -> bool:
    """Whether this process holds the claim: one of its other managers took it."""
    return isinstance(holder, Holder) and holder.ours


def _joined(names: list[str], last: str) -> str:
    """``cuda``, ``cuda or xpu``, ``cuda, xpu or mps`` (``last`` joins the last two)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def _shared(start: str, problem: RankProblem) -> str:
    """The end of the refusals of ranks that would share a device: why, and what to do."""
    option = problem.launcher.per_node.format(problem.devices)
    return (
        "ranks would share a device, which NCCL refuses ('Duplicate GPU detected'). "
        f"{start} per node ({option}), or {problem.apart}."
    )


def _apart(local: LocalRank, own: str) -> str:
    """How each process would get devices of its own, where ranks would share them.

    A Slurm task has its own ``CUDA_VISIBLE_DEVICES`` already, which srun sets, the same
    for every task unless it binds GPUs to each; other launchers' processes get theirs
    from the user (a wrapper script that sets it from the rank).

    >>> from devicekit._select._launch import local_rank
    >>> _apart(local_rank({"LOCAL_RANK": "2"}), "CUDA_VISIBLE_DEVICES")
    'give each process its own CUDA_VISIBLE_DEVICES'
    >>> _apart(local_rank({"SLURM_LOCALID": "2"}), "CUDA_VISIBLE_DEVICES")
    'bind each task to GPUs of its own (srun --gpus-per-task=1, with no other --gpu-bind)'
    >>> bound = local_rank({"SLURM_LOCALID": "2", "SLURM_GPUS_PER_TASK": "2"})
    >>> _apart(bound, "ROCR_VISIBLE_DEVICES")  # doctest: +NORMALIZE_WHITESPACE
    'leave ROCR_VISIBLE_DEVICES as srun sets it for each task bound to its GPUs
     (SLURM_GPUS_PER_TASK=2)'
    """
    if not local.srun_task:
        return f"give each process its own {own}"
    if local.per_task:  # bound, and yet this process sees several devices and no variable
        return f"leave {own} as srun sets it for each task bound to its GPUs ({local.per_task})"
    return "bind each task to GPUs of its own (srun --gpus-per-task=1, with no other --gpu-bind)"


def _processes(number: int) -> str:
    return "1 process" if number == 1 else f"{number} processes"
