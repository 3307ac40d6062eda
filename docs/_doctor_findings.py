"""The doctor's findings for guide/why-cpu, said by the doctor itself on machines described here.

Each situation is a snapshot of a machine (its GPU drivers, device files, PyTorch's
build, the device families and variables): the doctor's own rules turn it into the
lines the page shows, so the page cannot drift from what ``devicekit doctor`` prints.
The fallback's warning comes from a real DeviceManager, shown the first situation's
machine. conf.py calls :func:`write` before the build reads the pages.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING
from unittest import mock

import torch

import devicekit as dk
from devicekit._doctor import diagnose
from devicekit._select import Machine, _hardware, _manager
from devicekit._select._backends import CpuBackend, DeviceInfo, Family
from devicekit._select._hardware import Build, Hardware

if TYPE_CHECKING:
    from pathlib import Path

RELEASE = torch.__version__.split("+")[0]
CPU = Family("cpu", "cpu", (DeviceInfo(torch.device("cpu"), "cpu", None, "x86_64"),))
NVIDIA = Hardware(nvidia_driver="570.86.15", nvidia_files=1, nvidia_smi=True, driver_cuda=(12, 8))
CUDA_BUILD = Build(f"{RELEASE}+cu128", cuda="12.8")
NO_CUDA = Family("cuda", "cuda", (), "this PyTorch build has no CUDA support")
NO_NVML = Family("cuda", "cuda", (), "NVML could not be read (is the NVIDIA driver installed?)")
H100 = DeviceInfo(torch.device("cuda", 0), "cuda", 0, "NVIDIA H100 80GB HBM3", 80 << 30)

SITUATIONS = {
    "A CPU-only PyTorch on a machine with an NVIDIA GPU": Machine(
        {}, (NO_CUDA, CPU), hardware=NVIDIA, build=Build(f"{RELEASE}+cpu")
    ),
    "A container started without its GPUs": Machine(
        {}, (NO_NVML, CPU), hardware=Hardware(nvidia_driver="570.86.15"), build=CUDA_BUILD
    ),
    "A driver older than the CUDA of the build": Machine(
        {},
        (Family("cuda", "cuda", (H100,)), CPU),
        hardware=NVIDIA._replace(nvidia_driver="470.256.02", driver_cuda=(11, 4)),
        build=CUDA_BUILD,
    ),
    "A variable that hides every GPU": Machine(
        {"CUDA_VISIBLE_DEVICES": ""},
        (Family("cuda", "cuda", (), "CUDA_VISIBLE_DEVICES='' hides all 1 GPU(s)"), CPU),
        hardware=NVIDIA,
        build=CUDA_BUILD,
    ),
    "A Mac whose macOS is older than MPS needs": Machine(
        {},
        (Family("mps", "mps", (), "MPS is built in but not available on this machine"), CPU),
        hardware=Hardware(system="Darwin", arch="arm64", macos=(13, 6)),
        build=Build(RELEASE, mps=True),
    ),
    "Two torchrun ranks on a machine without any GPU": Machine(
        {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (NO_CUDA, CPU)
    ),
}


class _NoCuda:
    """The CUDA family of a CPU-only PyTorch: no device, and why."""

    name = device_type = "cuda"
    note = NO_CUDA.note

    def devices(self) -> list[DeviceInfo]:
        return []


def fallback_warning() -> str:
    """What ``DeviceManager()`` warns on the first situation's machine, as Python shows it."""
    machine = next(iter(SITUATIONS.values()))
    with (
        mock.patch.object(_hardware, "probe", return_value=machine.hardware),
        mock.patch.object(Build, "of_torch", return_value=machine.build),
        mock.patch.object(_manager, "_fallback_warned", _manager._Once()),
        warnings.catch_warnings(record=True) as said,
    ):
        warnings.simplefilter("always")
        dk.DeviceManager(backends=[_NoCuda(), CpuBackend()])
    (warning,) = said
    return f"{warning.category.__name__}: {warning.message}"


def write(folder: Path) -> None:
    """Write ``doctor-findings.rst`` (the doctor's lines), ``fallback-warning.txt``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fallback-warning.txt").write_text(fallback_warning() + "\n", encoding="utf-8")
    parts = []
    for title, machine in SITUATIONS.items():
        said = "\n".join(f"   {finding.line()}" for finding in diagnose(machine))
        parts.append(f"{title}:\n\n.. code-block:: text\n\n{said}\n")
    (folder / "doctor-findings.rst").write_text("\n".join(parts), encoding="utf-8")
