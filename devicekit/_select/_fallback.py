"""Why the CPU, where this machine has an accelerator: the CPU fallback's words.

:func:`why_cpu` is a pure function of a :class:`Machine` snapshot (the environment
variables, the device families the backends list, the GPU drivers and device files,
PyTorch's build), returning one :class:`Finding` for each reason an accelerator the
machine has is not usable: a CPU-only PyTorch beside an NVIDIA driver, a container
started without its GPUs, a variable hiding them. The manager's fallback warning says
these findings; ``devicekit doctor`` (above selection) reports them among its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, Literal, NamedTuple

import torch

from devicekit._base import shown
from devicekit._select._backends import Family
from devicekit._select._hardware import Build, Hardware
from devicekit._select._launch import parse_visible_devices, repeated_visible_device

__all__ = ["Finding", "Machine", "why_cpu"]

Severity = Literal["error", "warning"]

_WHEELS: Final = "https://download.pytorch.org/whl/"
# The CUDA versions PyTorch publishes builds for, newest first: the fix names the newest
# one the driver runs. pytorch.org/get-started/locally has the current list.
_CUDA_BUILDS: Final = ((13, 0), (12, 8), (12, 6))
_ROCM_BUILD: Final = "rocm6.4"
_MPS_MACOS: Final = (14, 0)  # the oldest macOS whose MPS PyTorch 2.10 and later start on


# NamedTuples, not dataclasses: this comes with import devicekit, where defining these two
# as frozen dataclasses took 1.2 ms (after torch), as NamedTuples 0.2 ms.
class Finding(NamedTuple):
    """One mistake: what it is, why it breaks (or may surprise) a run, and the fix."""

    severity: Severity
    code: str  # a short name, stable for scripts reading --json
    what: str
    why: str
    fix: str

    def sentence(self) -> str:
        """What, why and the fix, as the CPU fallback's warning says them."""
        # A why or a fix may be whole sentences ending in a full stop of their own (the
        # claim directory's refusal): one full stop ends each.
        return f"{self.what}: {self.why.rstrip('.')}. Fix: {self.fix.rstrip('.')}."

    def line(self) -> str:
        """The finding in one line, as ``devicekit doctor`` prints it."""
        return f"{self.severity}: {self.sentence()}"


class Machine(NamedTuple):
    """What the fallback and the doctor look at: a snapshot, each rule a case of a table."""

    environ: Mapping[str, str]
    families: tuple[Family, ...] = ()
    cuda_started: bool = False
    cuda_count: int | None = None  # what torch.cuda.device_count() says, where CUDA started
    claim_problem: str | None = None  # what is wrong with the claim directory
    loaded: Callable[[str], bool] = lambda device_type: False
    """Whether PyTorch has a backend for a device type no family lists (torch_xla's)."""
    hardware: Hardware = Hardware()  # drivers and device files: none, unless given
    build: Build = Build(torch.__version__)  # built for the CPU only, unless given

    @property
    def rocm(self) -> bool:
        """A ROCm build of PyTorch: ``cuda`` means AMD GPUs."""
        return self.build.hip is not None

    def family(self, device_type: str) -> Family | None:
        """The family of ``device_type`` the backends listed; None where none did."""
        return next((f for f in self.families if f.device_type == device_type), None)


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
    xpu = machine.family("xpu")
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
    mps = machine.family("mps")
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


def _hidden(machine: Machine) -> list[Finding]:
    """Visibility variables that hide every GPU (or Intel GPU) the machine has."""
    environ, found = machine.environ, []
    cuda = machine.family("cuda")
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
    xpu = machine.family("xpu")
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
