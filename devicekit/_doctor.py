"""``devicekit doctor``: the environment mistakes that put ranks on the wrong GPU, named.

:func:`diagnose` is a pure function of a :class:`Machine` snapshot (the environment
variables, the device families the backends list, whether CUDA started, the claim
directory's state), returning one :class:`Finding` per mistake: what it is, why it
breaks a run, and the fix. Where the manager's own choice refuses (a launcher's rank
without a device of its own, a ``DEVICEKIT_DEVICE`` naming none), the doctor reports
that refusal: it asks :func:`devicekit._selection.choose`, given the snapshot as the
manager would see it, and reads the variables with the manager's readers
(:mod:`devicekit._launch`). Its own rules are only those the choice has not: variables
that hide every GPU, came too late or disagree, GPU numbering, the claim directory.
:func:`look` takes the snapshot of this process; the command prints the findings and
exits 1 where one would break a run (an ``error``), else 0 (``warning`` findings only
say what may surprise).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from devicekit import _claims as _claims_module
from devicekit._backends import Backend, Family, builtin_backends, cuda_started
from devicekit._devices import has_backend, shown
from devicekit._launch import VISIBILITY_VARIABLES, parse_visible_devices
from devicekit._selection import RankProblem, Refused, Request, Seen, choose

__all__ = ["Finding", "Machine", "diagnose", "look"]

Severity = Literal["error", "warning"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One mistake: what it is, why it breaks (or may surprise) a run, and the fix."""

    severity: Severity
    code: str  # a short name, stable for scripts reading --json
    what: str
    why: str
    fix: str

    def line(self) -> str:
        """The finding in one line, as ``devicekit doctor`` prints it."""
        return f"{self.severity}: {self.what}: {self.why}. Fix: {self.fix}."


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the doctor looks at: a snapshot, so that every rule is a case of a table."""

    environ: Mapping[str, str]
    families: tuple[Family, ...] = ()
    cuda_started: bool = False
    cuda_count: int | None = None  # what torch.cuda.device_count() says, where CUDA started
    rocm: bool = False  # a ROCm build of PyTorch: cuda means AMD GPUs
    claim_problem: str | None = None  # what is wrong with the claim directory
    loaded: Callable[[str], bool] = lambda device_type: False
    """Whether PyTorch has a backend for a device type no family lists (torch_xla's)."""


def diagnose(machine: Machine) -> list[Finding]:
    """Every mistake the snapshot shows, errors first.

    >>> diagnose(Machine({"LOCAL_RANK": "two"}))[0].line()  # doctest: +ELLIPSIS
    "error: LOCAL_RANK='two' is no rank: ...
    >>> diagnose(Machine({}))
    []
    """
    findings = [*_refused(machine), *_visibility(machine), *_order(machine), *_claims(machine)]
    return sorted(findings, key=lambda finding: finding.severity != "error")


def _family(machine: Machine, device_type: str) -> Family | None:
    return next((f for f in machine.families if f.device_type == device_type), None)


def _refused(machine: Machine) -> list[Finding]:
    """Where ``DeviceManager.from_env()`` (every call's default device) refuses, in its words.

    Its default options refuse only the launcher's rank or ``DEVICEKIT_DEVICE``.
    """
    seen = Seen.of(machine.families, machine.environ, loaded=machine.loaded)
    outcome = choose(seen, Request())
    if not isinstance(outcome, Refused):
        return []
    if outcome.rank is not None:
        return [_rank_finding(outcome.rank)]
    return [
        Finding(
            "error",
            "devicekit-device",
            outcome.message.removesuffix("."),
            "every devicekit entry point given no device uses it, and stops there",
            "name one of the devices `devicekit info` lists, or unset it",
        )
    ]


def _rank_finding(problem: RankProblem) -> Finding:
    launcher = problem.launcher
    if problem.code == "local-rank-not-a-number":
        return Finding(
            "error",
            problem.code,
            f"{problem.variable}={shown(problem.value)} is no rank",
            f"devicekit, like {launcher.name}'s own tools, reads it as this process's "
            "place on its node, and stops at a value that is not a whole number",
            f"let {launcher.name} set it, or unset it where no launcher runs the job",
        )
    count = problem.devices
    return Finding(
        "error",
        problem.code,
        f"{problem.variable}={problem.value}, and this process sees {count} {problem.family} "
        "device" + ("" if count == 1 else "s"),
        "ranks would share a GPU, which NCCL refuses ('Duplicate GPU detected') and "
        "which halves each rank's memory",
        f"start at most {count} per node ({launcher.per_node.format(count)}), or give each "
        f"process its own {problem.own}",
    )


def _visibility(machine: Machine) -> list[Finding]:
    """Variables that hide every GPU, conflict, or came after CUDA started."""
    environ, found = machine.environ, []
    cuda = _family(machine, "cuda")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    listed = _counted(parse_visible_devices(visible))
    # The backend's note says so where it saw GPUs that the variable then hid.
    hid = cuda is not None and (cuda.note or "").startswith("CUDA_VISIBLE_DEVICES")
    if visible is not None and cuda is not None and hid and not machine.rocm:
        found.append(
            Finding(
                "error",
                "visible-devices-hide-all",
                f"CUDA_VISIBLE_DEVICES={shown(visible)} hides every GPU",
                "PyTorch sees no GPU, and the job trains on the CPU (or fails where it "
                "asks for cuda)",
                "unset it, or list the GPUs this process should use (CUDA_VISIBLE_DEVICES=0,1)",
            )
        )
    count = machine.cuda_count if machine.cuda_started else None
    if count is not None and listed not in (None, count):
        found.append(
            Finding(
                "error",
                "visible-devices-after-cuda",
                f"CUDA_VISIBLE_DEVICES={shown(visible)} lists {listed} GPU(s), but "
                f"CUDA, started before it was set, sees {count}",
                "CUDA reads the variable once, when it starts: set later, in the program, it "
                "changes nothing, and every process keeps all the GPUs it saw",
                "set it before the program starts (in the shell or the job script), or before "
                "anything in the program touches CUDA",
            )
        )
    if machine.rocm:
        found += _rocm(machine)
    mask = environ.get("ZE_AFFINITY_MASK")
    masked = parse_visible_devices(mask, "ZE_AFFINITY_MASK")
    xpu = _family(machine, "xpu")
    if masked is not None and (not masked or (xpu is not None and not xpu.devices)):
        found.append(
            Finding(
                "error",
                "affinity-mask-hides-all",
                f"ZE_AFFINITY_MASK={shown(mask)} leaves no Intel GPU",
                "Level Zero shows only the devices (or tiles, as 0.1) the mask lists: a "
                "mask that is malformed or lists none leaves PyTorch without an XPU",
                "list devices by index, as ZE_AFFINITY_MASK=0,1 (a tile as 0.0), or unset it",
            )
        )
    return found


def _counted(listed: list[int] | list[str] | None) -> int | None:
    """How many GPUs a visibility variable lists; None where unset or by UUID (NVML's to tell).

    >>> _counted([0, 1]), _counted([]), _counted(["GPU-5f1c"]), _counted(None)
    (2, 0, None, None)
    """
    if listed is None or any(isinstance(token, str) for token in listed):
        return None
    return len(listed)


def _rocm(machine: Machine) -> list[Finding]:
    environ = machine.environ
    applied = reversed(VISIBILITY_VARIABLES["cuda"])  # in ROCm's order, as the finding lists
    given = {name: environ[name] for name in applied if environ.get(name) is not None}
    if len(set(given.values())) < 2:
        return []
    cuda = _family(machine, "cuda")
    listed = ", ".join(f"{name}={shown(value)}" for name, value in given.items())
    severity: Severity = "error" if cuda is not None and not cuda.devices else "warning"
    return [
        Finding(
            severity,
            "rocm-visibility-conflict",
            f"{listed} disagree",
            "on ROCm they apply one after the other: ROCR_VISIBLE_DEVICES first, then "
            "HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES) numbers what is left, so the "
            "second list can point past the first and leave fewer GPUs, or none",
            "set one of them only (HIP_VISIBLE_DEVICES, or ROCR_VISIBLE_DEVICES in containers)",
        )
    ]


def _order(machine: Machine) -> list[Finding]:
    """GPUs that nvidia-smi and CUDA number differently."""
    cuda = _family(machine, "cuda")
    if cuda is None or machine.rocm or machine.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return []
    models = {info.name for info in cuda.devices}
    if len(cuda.devices) < 2 or len(models) < 2:
        return []
    return [
        Finding(
            "warning",
            "device-order",
            f"this machine has different GPU models ({', '.join(sorted(map(str, models)))}) and "
            "CUDA_DEVICE_ORDER is not PCI_BUS_ID",
            "CUDA numbers them fastest first, nvidia-smi by PCI bus: cuda:0 may be another GPU "
            "than nvidia-smi's 0, and CUDA_VISIBLE_DEVICES picks by CUDA's numbers",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID, so that both number GPUs alike",
        )
    ]


def _claims(machine: Machine) -> list[Finding]:
    problem = machine.claim_problem
    if problem is None:
        return []
    configured = bool(machine.environ.get("DEVICEKIT_CLAIM_DIR", "").strip())
    return [
        Finding(
            "error" if configured else "warning",
            "claim-directory",
            "the claim directory cannot be used",
            f"DeviceManager(claim=True) stops there: {problem}",
            "set DEVICEKIT_CLAIM_DIR to an absolute path of a directory on this machine's own "
            "disk that every job can write, with the sticky bit if all users share it",
        )
    ]


def look(backends: Sequence[Backend] | None = None) -> Machine:
    """This process's snapshot: its environment, its devices, its CUDA, its claim directory."""
    listing = builtin_backends() if backends is None else backends
    families = tuple(Family.listed(backend) for backend in listing)
    started = cuda_started()
    return Machine(
        environ=dict(os.environ),
        families=families,
        cuda_started=started,
        cuda_count=torch.cuda.device_count() if started else None,
        rocm=torch.version.hip is not None,
        claim_problem=_claims_module.directory_problem(),
        loaded=has_backend,
    )
