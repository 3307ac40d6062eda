"""``devicekit doctor``: why no accelerator is used, and what puts ranks on the wrong GPU.

:func:`diagnose` is a pure function of a :class:`Machine` snapshot (the environment
variables, the device families the backends list, whether CUDA started, the claim
directory's state, the GPU drivers and device files, PyTorch's build), returning one
:class:`Finding` per mistake: what it is, why it breaks a run, and the fix.
:func:`why_cpu` is the part of it that explains a CPU fallback on a machine that has an
accelerator (a CPU-only PyTorch beside an NVIDIA driver, a container started without
its GPUs, a variable hiding them): the manager's fallback warning says those findings,
in the same words. Where the manager's own choice refuses (a launcher's rank without a
device of its own, a ``DEVICEKIT_DEVICE`` naming none), the doctor reports that refusal:
it asks :func:`devicekit._select._selection.choose`, given the snapshot as the manager would see
it, and reads the variables with the manager's readers (:mod:`devicekit._select._launch`).
:func:`look` takes the snapshot of this process; the command prints the findings and
exits 1 where one would break a run (an ``error``), else 0 (``warning`` findings only
say what may surprise).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Literal

import torch

from devicekit._base import has_backend, shown
from devicekit._select import (
    VISIBILITY_VARIABLES,
    Backend,
    BadRank,
    Build,
    Chosen,
    Family,
    Hardware,
    LocalRank,
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
)

__all__ = ["Finding", "Machine", "diagnose", "look", "why_cpu"]

Severity = Literal["error", "warning"]

_WHEELS: Final = "https://download.pytorch.org/whl/"
# The CUDA versions PyTorch publishes builds for, newest first: the fix names the newest
# one the driver runs. pytorch.org/get-started/locally has the current list.
_CUDA_BUILDS: Final = ((13, 0), (12, 8), (12, 6))
_ROCM_BUILD: Final = "rocm6.4"
_MPS_MACOS: Final = (14, 0)  # the oldest macOS whose MPS PyTorch 2.10 and later start on
_NO_HARDWARE: Final = Hardware()
_CPU_BUILD: Final = Build(torch.__version__)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One mistake: what it is, why it breaks (or may surprise) a run, and the fix."""

    severity: Severity
    code: str  # a short name, stable for scripts reading --json
    what: str
    why: str
    fix: str

    def sentence(self) -> str:
        """What, why and the fix, as the CPU fallback's warning says them."""
        return f"{self.what}: {self.why}. Fix: {self.fix}."

    def line(self) -> str:
        """The finding in one line, as ``devicekit doctor`` prints it."""
        return f"{self.severity}: {self.sentence()}"


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the doctor looks at: a snapshot, so that every rule is a case of a table."""

    environ: Mapping[str, str]
    families: tuple[Family, ...] = ()
    cuda_started: bool = False
    cuda_count: int | None = None  # what torch.cuda.device_count() says, where CUDA started
    claim_problem: str | None = None  # what is wrong with the claim directory
    loaded: Callable[[str], bool] = lambda device_type: False
    """Whether PyTorch has a backend for a device type no family lists (torch_xla's)."""
    hardware: Hardware = _NO_HARDWARE  # drivers and device files: none, unless given
    build: Build = _CPU_BUILD  # what PyTorch was built for: the CPU only, unless given

    @property
    def rocm(self) -> bool:
        """A ROCm build of PyTorch: ``cuda`` means AMD GPUs."""
        return self.build.hip is not None


def diagnose(machine: Machine) -> list[Finding]:
    """Every mistake the snapshot shows, errors first.

    >>> diagnose(Machine({"LOCAL_RANK": "two"}))[0].line()  # doctest: +ELLIPSIS
    "error: LOCAL_RANK='two' is no rank: ...
    >>> diagnose(Machine({}))
    []
    """
    seen = Seen.of(machine.families, machine.environ, loaded=machine.loaded)
    outcome = choose(seen, Request())
    findings = [
        *_refused(outcome),
        *why_cpu(machine),
        *_visibility(machine),
        *_order(machine),
        *_claims(machine),
        *_ranks_on_cpu(seen.local_rank, outcome),
    ]
    return sorted(findings, key=lambda finding: finding.severity != "error")


def why_cpu(machine: Machine) -> list[Finding]:
    """Why an accelerator this machine has is not usable: what a CPU fallback warns of.

    A machine with none gives none: its CPU is the only choice, and nothing is wrong.

    >>> nvidia = Hardware(nvidia_driver="570.86.15", nvidia_files=1)
    >>> [f.code for f in why_cpu(Machine({}, hardware=nvidia))]
    ['build-without-cuda']
    >>> why_cpu(Machine({}))
    []
    """
    return [
        *_builds(machine),
        *_device_files(machine),
        *_driver(machine),
        *_apple(machine),
        *_hidden(machine),
    ]


def _family(machine: Machine, device_type: str) -> Family | None:
    return next((f for f in machine.families if f.device_type == device_type), None)


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


# Why an accelerator the machine has is not usable.


def _builds(machine: Machine) -> list[Finding]:
    """A GPU this PyTorch was not built for: NVIDIA's without CUDA, AMD's without ROCm, Intel's."""
    hardware, build = machine.hardware, machine.build
    found = []
    if hardware.nvidia and build.cuda is None:
        driver = f" (driver {hardware.nvidia_driver})" if hardware.nvidia_driver else ""
        # A driver older than every build needs an update first, then the oldest build.
        wheel = _cuda_wheel(hardware.driver_cuda) or "cu{}{}".format(*_CUDA_BUILDS[-1])
        found.append(_without("error", "CUDA", f"an NVIDIA GPU{driver}", build, wheel))
    if hardware.amd and build.hip is None and not hardware.nvidia:
        found.append(_without("warning", "ROCm", "an AMD GPU (amdgpu)", build, _ROCM_BUILD))
    if hardware.intel_gpus and not build.xpu and not (hardware.nvidia or hardware.amd):
        found.append(_without("warning", "XPU", "an Intel GPU", build, "xpu"))
    return found


def _without(severity: Severity, support: str, gpu: str, build: Build, wheel: str) -> Finding:
    """This build lacks ``support`` (``CUDA``, ``ROCm``, ``XPU``) for the machine's ``gpu``."""
    # An AMD or Intel GPU may be one PyTorch cannot use (integrated graphics): a warning.
    may = "" if severity == "error" else ", where it is one PyTorch supports"
    return Finding(
        severity,
        f"build-without-{support.lower()}",
        f"this PyTorch ({build.version}) is built for {build.described}, and this machine has "
        + gpu,
        f"PyTorch cannot use that GPU{may}, so every run trains on the CPU",
        f"install PyTorch's {support} build: {_install(build, wheel)}",
    )


def _install(build: Build, wheel: str) -> str:
    """The pip line for this PyTorch's release in another build (pytorch.org lists them)."""
    return f"`pip install torch=={build.release} --index-url {_WHEELS}{wheel}`"


def _cuda_wheel(driver_cuda: tuple[int, int] | None) -> str | None:
    """The newest CUDA build the driver runs (``cu128``); None where it runs none.

    Where the driver's CUDA is unknown, the newest build.

    >>> _cuda_wheel((12, 9)), _cuda_wheel((13, 1)), _cuda_wheel(None), _cuda_wheel((11, 4))
    ('cu128', 'cu130', 'cu130', None)
    """
    runs = [cuda for cuda in _CUDA_BUILDS if driver_cuda is None or cuda <= driver_cuda]
    return None if not runs else "cu{}{}".format(*runs[0])


def _device_files(machine: Machine) -> list[Finding]:
    """A driver loaded, and no device file for this process: a container started without GPUs."""
    hardware, found = machine.hardware, []
    # Windows reaches its GPUs without /dev: there, no device file is no sign of a container.
    files_expected = hardware.system != "Windows"
    if hardware.nvidia_driver is not None and not hardware.nvidia_files and files_expected:
        version = f" ({hardware.nvidia_driver})" if hardware.nvidia_driver else ""
        found.append(
            Finding(
                "error",
                "container-without-gpus",
                f"the NVIDIA driver{version} is loaded, but this process sees no /dev/nvidia "
                "device file",
                "a container started without GPUs sees the host's driver and no GPU, so CUDA "
                "finds none and every run trains on the CPU",
                "start the container with its GPUs: `docker run --gpus all` (with the NVIDIA "
                "Container Toolkit), or ask for nvidia.com/gpu in a Kubernetes pod; outside a "
                "container, run `nvidia-smi` once as root to make the device files",
            )
        )
    if hardware.amd_driver and not hardware.kfd:
        found.append(
            Finding(
                "warning",
                "container-without-gpus",
                "the AMD GPU driver (amdgpu) is loaded, but this process sees no /dev/kfd",
                "ROCm reaches AMD GPUs through /dev/kfd: without it PyTorch sees none, as in a "
                "container started without them",
                "start the container with `--device=/dev/kfd --device=/dev/dri --group-add video`",
            )
        )
    return found


def _driver(machine: Machine) -> list[Finding]:
    """A driver too old for the build's CUDA; an XPU build that Level Zero gives no GPU."""
    hardware, build, found = machine.hardware, machine.build, []
    driver_cuda = hardware.driver_cuda
    needed = _cuda_version(build.cuda) if build.hip is None else None
    if needed is not None and driver_cuda is not None and hardware.nvidia and needed > driver_cuda:
        refused, wheel = needed[0] > driver_cuda[0], _cuda_wheel(driver_cuda)
        found.append(
            Finding(
                "error" if refused else "warning",
                "driver-too-old",
                f"this PyTorch is built for CUDA {build.cuda}, and the NVIDIA driver "
                f"({hardware.nvidia_driver or 'version unread'}) runs CUDA "
                f"{driver_cuda[0]}.{driver_cuda[1]} at most",
                "CUDA does not start ('The NVIDIA driver on your system is too old'), so "
                "PyTorch sees no GPU"
                if refused
                else "it runs through CUDA's minor version compatibility, where code compiled "
                "at run time (torch.compile's Triton kernels) can fail",
                f"update the NVIDIA driver to one that runs CUDA {build.cuda}"
                + (
                    ""
                    if wheel is None
                    else f", or install a build it runs: {_install(build, wheel)}"
                ),
            )
        )
    xpu = _family(machine, "xpu")
    if build.xpu and hardware.intel_gpus and xpu is not None and not xpu.devices:
        found.append(
            Finding(
                "warning",
                "xpu-unavailable",
                "this PyTorch is built for Intel GPUs and this machine has one, but PyTorch "
                "sees no XPU device",
                "PyTorch reaches Intel GPUs through the GPU driver's compute runtime (Level "
                "Zero), and only GPUs it supports (Arc, Data Center GPU Max, Core Ultra "
                "graphics)",
                "install Intel's GPU driver with its compute runtime, then check with "
                "`python -c 'import torch; print(torch.xpu.is_available())'`",
            )
        )
    return found


def _cuda_version(text: str | None) -> tuple[int, int] | None:
    """``"12.8"`` as ``(12, 8)``; None where not a CUDA version.

    >>> _cuda_version("12.8"), _cuda_version("13.0.1"), _cuda_version(None)
    ((12, 8), (13, 0), None)
    """
    parts = (text or "").split(".")
    if len(parts) < 2 or not all(part.isdecimal() for part in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def _apple(machine: Machine) -> list[Finding]:
    """On a Mac: a PyTorch without MPS, a macOS too old for it, a Metal without a GPU."""
    hardware, build = machine.hardware, machine.build
    mps = _family(machine, "mps")
    if hardware.system != "Darwin" or (mps is not None and mps.devices):
        return []
    if not build.mps:
        intel_python = hardware.arch == "x86_64"
        return [
            Finding(
                "warning",
                "build-without-mps",
                f"this PyTorch ({build.version}) has no MPS support",
                "Apple GPUs are used through MPS: without it, every run trains on the CPU",
                "this Python runs as x86_64 (under Rosetta, or on an Intel Mac, whose GPUs "
                "PyTorch no longer supports): install an arm64 Python, then PyTorch"
                if intel_python
                else f"`pip install torch=={build.release}` (PyPI's macOS builds have MPS)",
            )
        ]
    release = ".".join(map(str, hardware.macos or ()))
    if hardware.macos is not None and hardware.macos < _MPS_MACOS:
        return [
            Finding(
                "error",
                "macos-too-old",
                f"macOS {release} is older than the {_MPS_MACOS[0]}.{_MPS_MACOS[1]} this "
                "PyTorch's MPS needs",
                "MPS is built in but does not start, so every run trains on the CPU",
                f"update macOS to {_MPS_MACOS[0]} or newer, or install a PyTorch release "
                "that supports this macOS",
            )
        ]
    return [
        Finding(
            "warning",
            "mps-unavailable",
            "MPS is built in, but Metal gives this process no GPU",
            "a virtual machine (as most hosted CI runs) or a session without GPU access has "
            "none to give, so every run trains on the CPU",
            "run on the Mac itself, where `python -c 'import torch; "
            "print(torch.backends.mps.is_available())'` says True",
        )
    ]


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


def _hidden(machine: Machine) -> list[Finding]:
    """Visibility variables that hide every GPU (or Intel GPU) the machine has."""
    environ, found = machine.environ, []
    cuda = _family(machine, "cuda")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    # The backend's note says so where it saw GPUs that the variable then hid.
    hid = cuda is not None and (cuda.note or "").startswith("CUDA_VISIBLE_DEVICES")
    repeated = None if machine.rocm else repeated_visible_device(visible)
    if repeated is not None and cuda is not None:
        # Told apart from a list of GPUs that are not there, whose fix differs; and
        # whatever NVML saw, since PyTorch's count without NVML reads it the same.
        gpu = repeated.entry
        label = f"GPU {gpu}" if gpu.isdecimal() else shown(gpu)
        gpus = hid or machine.hardware.nvidia or machine.build.cuda is not None
        found.append(
            Finding(
                "error" if gpus else "warning",
                "visible-devices-repeated",
                f"CUDA_VISIBLE_DEVICES={shown(visible)} lists {label} twice",
                "CUDA shows no GPU at all where one is listed twice (PyTorch counts none "
                "too), so the job trains on the CPU, or fails where it asks for cuda",
                f"list each GPU once: CUDA_VISIBLE_DEVICES={shown(repeated.once)}",
            )
        )
    elif visible is not None and cuda is not None and hid and not machine.rocm:
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
