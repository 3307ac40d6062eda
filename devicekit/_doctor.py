"""``devicekit doctor``: the environment mistakes that put ranks on the wrong GPU, named.

:func:`diagnose` is a pure function of a :class:`Machine` snapshot (the environment
variables, the device families the backends list, whether CUDA started, the claim
directory's state), returning one :class:`Finding` per mistake: what it is, why it
breaks a run, and the fix. Where a launcher's rank gets no device of its own, the
manager's own choice decides (:func:`devicekit._selection.choose`, given the snapshot
as the manager would see it), and the variables are read by the manager's readers
(:mod:`devicekit._launch`, :func:`devicekit._nvml.parse_visible_devices`): the doctor
names a problem with the ranks exactly where a ``DeviceManager`` would refuse them, and
adds only rules of its own. :func:`look` takes the snapshot of this process; the
command prints the findings and exits 1 where one would break a run (an ``error``),
else 0 (``warning`` findings only say what may surprise).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import torch

from devicekit import _claims as _claims_module
from devicekit._backends import Backend, builtin_backends, cuda_started
from devicekit._devices import shown
from devicekit._launch import (
    VISIBILITY_VARIABLES,
    devicekit_device,
    given_devices,
    local_rank,
    whole_number,
)
from devicekit._nvml import parse_visible_devices
from devicekit._selection import Family, RankProblem, Refused, Request, Seen, choose

__all__ = ["Finding", "Machine", "diagnose", "look"]

Severity = Literal["error", "warning"]

# In the order ROCm applies them, as the conflict's finding lists them.
_ROCM_VARIABLES: Final = tuple(reversed(VISIBILITY_VARIABLES["cuda"]))


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


def diagnose(machine: Machine) -> list[Finding]:
    """Every mistake the snapshot shows, errors first.

    >>> diagnose(Machine({"LOCAL_RANK": "two"}))[0].line()  # doctest: +ELLIPSIS
    "error: LOCAL_RANK='two' is no rank: ...
    >>> diagnose(Machine({}))
    []
    """
    findings = [
        *_ranks(machine),
        *_visibility(machine),
        *_order(machine),
        *_devicekit_device(machine),
        *_claims(machine),
    ]
    return sorted(findings, key=lambda finding: finding.severity != "error")


def _accelerators(machine: Machine) -> list[Family]:
    return [f for f in machine.families if f.device_type not in ("cpu", "meta") and f.devices]


def _seen(machine: Machine) -> Seen:
    """What a manager would see in the snapshot's environment: the input of its choice."""
    environ = machine.environ
    return Seen(
        machine.families,
        devicekit_device=devicekit_device(environ),
        local_rank=local_rank(environ),
        split=given_devices(environ),
    )


def _ranks(machine: Machine) -> list[Finding]:
    """A local rank that is no number, or more ranks than GPUs: as the manager refuses them.

    ``DeviceManager.from_env()`` (every devicekit call's default device) chooses with the
    default options; where that choice refuses the launcher's rank, so does the doctor.
    """
    outcome = choose(_seen(machine), Request())
    if not isinstance(outcome, Refused) or outcome.rank is None:
        return []
    return [_rank_finding(outcome.rank)]


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
    cuda = next((f for f in machine.families if f.device_type == "cuda"), None)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
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
    if (
        machine.cuda_started
        and visible is not None
        and machine.cuda_count is not None
        and _listed(visible) is not None
        and _listed(visible) != machine.cuda_count
    ):
        found.append(
            Finding(
                "error",
                "visible-devices-after-cuda",
                f"CUDA_VISIBLE_DEVICES={shown(visible)} lists {_listed(visible)} GPU(s), but "
                f"CUDA, started before it was set, sees {machine.cuda_count}",
                "CUDA reads the variable once, when it starts: set later, in the program, it "
                "changes nothing, and every process keeps all the GPUs it saw",
                "set it before the program starts (in the shell or the job script), or before "
                "anything in the program touches CUDA",
            )
        )
    if machine.rocm:
        found += _rocm(machine)
    mask = environ.get("ZE_AFFINITY_MASK")
    xpu = next((f for f in machine.families if f.device_type == "xpu"), None)
    if mask is not None and (
        not _mask_parses(mask) or (xpu is not None and not xpu.devices and mask.strip())
    ):
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


def _listed(value: str) -> int | None:
    """How many GPUs ``CUDA_VISIBLE_DEVICES`` lists, read as CUDA (and the manager) reads it.

    None where it names GPUs by UUID: whether a prefix matches a GPU only NVML can tell.

    >>> _listed("0,1"), _listed("0,0"), _listed("1,-1,0"), _listed("GPU-5f1c")
    (2, 0, 1, None)
    """
    wanted = parse_visible_devices(value)
    if wanted is None or any(isinstance(token, str) for token in wanted):
        return None
    return len(wanted)


def _mask_parses(mask: str) -> bool:
    items = [item.strip() for item in mask.split(",")]
    return all(part.isdecimal() for item in items for part in item.split(".")) or not mask.strip()


def _rocm(machine: Machine) -> list[Finding]:
    environ = machine.environ
    given = {name: environ[name] for name in _ROCM_VARIABLES if environ.get(name) is not None}
    cuda = next((f for f in machine.families if f.device_type == "cuda"), None)
    found = []
    if len(given) >= 2 and len(set(given.values())) > 1:
        listed = ", ".join(f"{name}={shown(value)}" for name, value in given.items())
        severity: Severity = "error" if cuda is not None and not cuda.devices else "warning"
        found.append(
            Finding(
                severity,
                "rocm-visibility-conflict",
                f"{listed} disagree",
                "on ROCm they apply one after the other: ROCR_VISIBLE_DEVICES first, then "
                "HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES) numbers what is left, so the "
                "second list can point past the first and leave fewer GPUs, or none",
                "set one of them only (HIP_VISIBLE_DEVICES, or ROCR_VISIBLE_DEVICES in containers)",
            )
        )
    return found


def _order(machine: Machine) -> list[Finding]:
    """GPUs that nvidia-smi and CUDA number differently."""
    cuda = next((f for f in machine.families if f.device_type == "cuda"), None)
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


def _devicekit_device(machine: Machine) -> list[Finding]:
    """DEVICEKIT_DEVICE naming a device this machine does not have."""
    spec = devicekit_device(machine.environ)
    if not spec:
        return []
    index = whole_number(spec)
    if index is not None:  # an index into the first accelerator family with devices
        accelerators = _accelerators(machine)
        count = len(accelerators[0].devices) if accelerators else 0
        return (
            [] if index < count else [_bad_devicekit_device(spec, f"{count} accelerator(s) here")]
        )
    try:
        device = torch.device(spec)  # not parse_device: its message lists this machine's
    except RuntimeError:
        return [_bad_devicekit_device(spec, "PyTorch knows no such device")]
    if device.type in ("cpu", "meta") or all(
        family.device_type != device.type for family in machine.families
    ):
        return []  # a device no backend here lists (xla...): PyTorch's to judge
    found = [
        info
        for family in machine.families
        for info in family.devices
        if info.device.type == device.type
    ]
    if not found or (device.index is not None and all(i.index != device.index for i in found)):
        devices = ", ".join(str(info.device) for info in found) or "none"
        return [_bad_devicekit_device(spec, f"the {device.type} devices here: {devices}")]
    return []


def _bad_devicekit_device(spec: str, said: str) -> Finding:
    return Finding(
        "error",
        "devicekit-device",
        f"DEVICEKIT_DEVICE={shown(spec)} names no device of this machine",
        f"every devicekit entry point given no device uses it, and stops ({said})",
        "name one of the devices `devicekit info` lists, or unset it",
    )


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
    families = tuple(
        Family(
            backend.name,
            backend.device_type,
            tuple(backend.devices()),
            getattr(backend, "note", None),
        )
        for backend in (builtin_backends() if backends is None else backends)
    )
    started = cuda_started()
    return Machine(
        environ=dict(os.environ),
        families=families,
        cuda_started=started,
        cuda_count=torch.cuda.device_count() if started else None,
        rocm=torch.version.hip is not None,
        claim_problem=_claims_module.directory_problem(),
    )
