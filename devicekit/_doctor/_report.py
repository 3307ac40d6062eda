"""What ``devicekit doctor`` saw, printed after its findings: a few lines, or ``--json``'s object.

As ``torch.utils.collect_env`` and ``accelerate env`` do, in a few lines: Python and
PyTorch with its build, the GPU drivers and device files, the devices of each family
(or why a family has none), and the variables set among those devicekit reads. A bug
report pasted with these lines says what the machine was.
"""

from __future__ import annotations

import platform
from typing import Any, Final

from devicekit._select import LAUNCHERS, VISIBILITY_VARIABLES, Finding, Hardware, Machine, describe

__all__ = ["environment", "report_lines", "report_object"]

VARIABLES: Final = (
    *(name for names in VISIBILITY_VARIABLES.values() for name in names),
    "CUDA_DEVICE_ORDER",
    *(name for launcher in LAUNCHERS for name in (launcher.rank, launcher.size)),
    "SLURM_GPUS_PER_TASK",
    "SLURM_TRES_BIND",
    "SLURM_GPU_BIND",
    "DEVICEKIT_DEVICE",
    "DEVICEKIT_CLAIM_DIR",
)
"""The variables shown where set: those that decide which device a process gets."""

_SYSTEM: Final = ("system", "arch", "macos")  # Hardware's fields shown outside "drivers"


def environment(machine: Machine) -> dict[str, Any]:
    """What was seen, as ``--json``'s ``environment``: plain values, None where unknown."""
    hardware, build = machine.hardware, machine.build
    return {
        "python": platform.python_version(),
        "system": hardware.system,
        "arch": hardware.arch,
        "torch": {**build._asdict(), "built_for": build.described},
        "drivers": {
            **{key: value for key, value in hardware._asdict().items() if key not in _SYSTEM},
            "driver_cuda": None if hardware.driver_cuda is None else _version(hardware.driver_cuda),
        },
        "macos": None if hardware.macos is None else _version(hardware.macos),
        "devices": {
            family.name: [str(info.device) for info in family.devices]
            for family in machine.families
        },
        "notes": {family.name: family.note for family in machine.families if family.note},
        "variables": _set(machine),
    }


def report_lines(machine: Machine) -> list[str]:
    """What was seen, in a few lines.

    >>> from devicekit._select import Build, Family
    >>> machine = Machine({"LOCAL_RANK": "1"}, (Family("cuda", "cuda", (), "no driver"),),
    ...                   build=Build("2.13.0+cu128", cuda="12.8"))
    >>> for line in report_lines(machine)[1:]:
    ...     print(line)
    Drivers: NVIDIA none; AMD none; Intel GPUs none
    cuda: none (no driver)
    Variables: LOCAL_RANK=1
    """
    hardware, build = machine.hardware, machine.build
    system = "" if not hardware.system else f" on {hardware.system} {hardware.arch}".rstrip()
    if hardware.macos is not None:
        system = f" on macOS {_version(hardware.macos)} {hardware.arch}"
    python = f"Python {platform.python_version()}{system}"
    seen = [
        f"{python}; PyTorch {build.version}, built for {build.described}",
        f"Drivers: {_drivers(hardware)}",
    ]
    for family in machine.families:
        if family.devices:
            seen += [describe(info) for info in family.devices]
        else:
            seen.append(f"{family.name}: none" + (f" ({family.note})" if family.note else ""))
    set_here = _set(machine)
    shown = ", ".join(f"{name}={value}" for name, value in set_here.items())
    seen.append(f"Variables: {shown or 'none of those that choose a device is set'}")
    return seen


def report_object(findings: list[Finding], machine: Machine) -> dict[str, Any]:
    """``devicekit doctor --json``'s object: ``{"findings": [...], "environment": {...}}``.

    The command writes it out, as it writes every ``--json`` (its values may hold text that
    is not valid Unicode: an undecodable byte of a variable or a path).
    """
    return {
        "findings": [finding._asdict() for finding in findings],
        "environment": environment(machine),
    }


def _drivers(hardware: Hardware) -> str:
    """``NVIDIA 570.86.15 (CUDA 12.8, 8 device files); AMD none; Intel GPUs none``."""
    nvidia = "none (nvidia-smi without a driver)" if hardware.nvidia_smi else "none"
    if hardware.nvidia:
        details = [f"{hardware.nvidia_files} device file(s)"]
        if hardware.driver_cuda is not None:
            details.insert(0, f"CUDA {_version(hardware.driver_cuda)}")
        nvidia = f"{hardware.nvidia_driver or 'version unread'} ({', '.join(details)})"
    amd = "none"
    if hardware.amd:
        amd = "amdgpu" if hardware.amd_driver else "no amdgpu module"
        amd += ", /dev/kfd" if hardware.kfd else ", no /dev/kfd"
    return f"NVIDIA {nvidia}; AMD {amd}; Intel GPUs {hardware.intel_gpus or 'none'}"


def _version(parts: tuple[int, ...]) -> str:
    return ".".join(map(str, parts))


def _set(machine: Machine) -> dict[str, str]:
    return {name: machine.environ[name] for name in VARIABLES if name in machine.environ}
