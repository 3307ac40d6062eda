"""``devicekit doctor``: why no accelerator is used, and what puts ranks on the wrong GPU.

:func:`diagnose` is a pure function of a :class:`~devicekit._select.Machine` snapshot (the
environment variables, the device families the backends list, whether CUDA started, the
claim directory's state, the GPU drivers and device files, PyTorch's build), returning one
:class:`~devicekit._select.Finding` per mistake: what it is, why it breaks a run, and the
fix. Among them are selection's own: why the CPU (:func:`~devicekit._select.why_cpu`, what
the manager's fallback warns of), and, where the manager's choice refuses (a launcher's rank
without a device of its own, a ``DEVICEKIT_DEVICE`` naming none), that refusal: the doctor
asks :func:`~devicekit._select.choose`, given the snapshot as the manager would see it.
:func:`look` takes the snapshot of this process; the command prints the findings and
exits 1 where one would break a run (an ``error``), else 0 (``warning`` findings only
say what may surprise).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from devicekit._base import has_backend, shown
from devicekit._select import (
    VISIBILITY_VARIABLES,
    Backend,
    BadRank,
    Build,
    Chosen,
    Family,
    Finding,
    LocalRank,
    Machine,
    Outcome,
    RankProblem,
    Refused,
    Request,
    Seen,
    builtin_backends,
    choose,
    cuda_started,
    directory_problem,
    parse_visible_devices,
    probe,
    repeated_visible_device,
    why_cpu,
)

__all__ = ["diagnose", "look", "refusal"]


def diagnose(machine: Machine) -> list[Finding]:
    """Every mistake the snapshot shows, errors first.

    >>> diagnose(Machine({"LOCAL_RANK": "two"}))[0].line()  # doctest: +ELLIPSIS
    "error: LOCAL_RANK='two' is no rank: ...
    >>> diagnose(Machine({}))
    []
    """
    seen, outcome = _choice(machine)
    findings = [
        *_refused(outcome),
        *why_cpu(machine),
        *_visibility(machine),
        *_order(machine),
        *_claims(machine),
        *_ranks_on_cpu(seen.local_rank, outcome),
    ]
    return sorted(findings, key=lambda finding: finding.severity != "error")


def refusal(machine: Machine) -> list[Finding]:
    """Where ``DeviceManager.from_env()`` refuses on the snapshot, the finding that says why.

    What ``devicekit info --json`` adds to the manager's error, in the doctor's words.

    >>> [finding.what for finding in refusal(Machine({"SLURM_LOCALID": "1.5"}))]
    ["SLURM_LOCALID='1.5' is no rank"]
    >>> refusal(Machine({}))
    []
    """
    return _refused(_choice(machine)[1])


def _choice(machine: Machine) -> tuple[Seen, Outcome]:
    """What the manager would see of the snapshot, and what it would choose given no options."""
    seen = Seen.of(machine.families, machine.environ, loaded=machine.loaded)
    return seen, choose(seen, Request())


def _refused(outcome: Outcome) -> list[Finding]:
    """Where ``DeviceManager.from_env()`` (every call's default device) refuses, in its words.

    Its default options refuse only the launcher's rank or ``DEVICEKIT_DEVICE``.
    """
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
        f"start at most {count} per node ({launcher.per_node.format(count)}), or {problem.apart}",
    )


def _ranks_on_cpu(rank: LocalRank | BadRank | None, outcome: Outcome) -> list[Finding]:
    """A launcher's ranks that all fall back to the CPU: meant for GPUs, run without one."""
    if not isinstance(rank, LocalRank) or not isinstance(outcome, Chosen):
        return []
    if outcome.fell_back is None:
        return []
    ranks = f"the {rank.size} ranks" if rank.size else "every rank"
    return [
        Finding(
            "warning",
            "ranks-on-cpu",
            f"{rank.said} ({rank.started_by}), and no accelerator is usable",
            f"{ranks} of this node fall back to the CPU, where a job meant for GPUs runs "
            "many times slower",
            "make an accelerator usable (the other findings and the devices seen say why none "
            "is), or, where the ranks are meant to run on the CPU, say so with "
            "DEVICEKIT_DEVICE=cpu",
        )
    ]


def _visibility(machine: Machine) -> list[Finding]:
    """Visibility variables that came after CUDA started, or that disagree (ROCm)."""
    visible = machine.environ.get("CUDA_VISIBLE_DEVICES")
    listed = _counted(parse_visible_devices(visible))
    count = machine.cuda_count if machine.cuda_started else None
    found = []
    # A repeated GPU lists none, whenever it was set: that finding (_hidden) says so, and
    # this one's fix (set it earlier) would leave the job with no GPU at all.
    repeated = repeated_visible_device(visible) is not None and not machine.rocm
    if count is not None and listed not in (None, count) and not repeated:
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
    cuda = machine.family("cuda")
    listed = ", ".join(f"{name}={shown(value)}" for name, value in given.items())
    return [
        Finding(
            "error" if cuda is not None and not cuda.devices else "warning",
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
    cuda = machine.family("cuda")
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
    """This process's snapshot: its environment, devices, CUDA, claim directory, drivers, build."""
    listing = builtin_backends() if backends is None else backends
    families = tuple(Family.listed(backend) for backend in listing)
    started = cuda_started()
    return Machine(
        environ=dict(os.environ),
        families=families,
        cuda_started=started,
        cuda_count=torch.cuda.device_count() if started else None,
        claim_problem=directory_problem(),
        loaded=has_backend,
        hardware=probe(),
        build=Build.of_torch(),
    )
