"""``devicekit doctor``: each environment mistake a row of a table, then the command itself.

:func:`devicekit._doctor.diagnose` is pure (a :class:`Machine` snapshot in, findings
out), so every rule is tested on fake machines here: GPUs of any model and number,
launcher variables, a CUDA started or not, a ROCm build, a claim directory's problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import _devicekit_cli
import devicekit as dk
from devicekit._base._devices import has_backend
from devicekit._doctor import diagnose, look
from devicekit._doctor._report import VARIABLES
from devicekit._select import Finding, Machine, _hardware, why_cpu
from devicekit._select._backends import CpuBackend, CudaBackend, DeviceInfo, Family
from devicekit._select._hardware import Build, Hardware, probe
from devicekit._select._launch import LAUNCHERS, VISIBILITY_VARIABLES
from devicekit._select._nvml import NvmlGpu

from .fakes import FakeGpus
from .helpers import GiB

CPU_FAMILY = Family("cpu", "cpu", (DeviceInfo(torch.device("cpu"), "cpu", None, "CPU", 64 * GiB),))


def gpus(*models: str, note: str | None = None, device_type: str = "cuda") -> Family:
    """A family of GPUs, one per model name given, in CUDA's order."""
    devices = tuple(
        DeviceInfo(torch.device(device_type, index), device_type, index, model, 80 * GiB)
        for index, model in enumerate(models)
    )
    return Family(device_type, device_type, devices, note)


def on(*families: Family, **machine: Any) -> Machine:
    """A machine with these families and its CPU; ``environ=`` and the rest as given."""
    environ = machine.pop("environ", {})
    return Machine(environ, (*families, CPU_FAMILY), **machine)


ROCM_BUILD = Build("2.13.0+rocm6.4", hip="6.4.43482")
CUDA_BUILD = Build("2.13.0+cu128", cuda="12.8")
XPU_BUILD = Build("2.13.0+xpu", xpu=True)
MAC_BUILD = Build("2.13.0", mps=True)
NVIDIA = Hardware(nvidia_driver="570.86.15", nvidia_files=2, nvidia_smi=True, driver_cuda=(12, 8))
OLD_DRIVER = NVIDIA._replace(nvidia_driver="470.256.02", driver_cuda=(11, 4))  # CUDA 11 at most
BEHIND_DRIVER = NVIDIA._replace(nvidia_driver="535.104.05", driver_cuda=(12, 2))
WITHOUT_FILES = Hardware(nvidia_driver="570.86.15")  # the host's driver, seen from a container
SMI_ALONE = Hardware(nvidia_smi=True)
WINDOWS = Hardware(nvidia_driver="572.16", nvidia_smi=True, driver_cuda=(12, 8), system="Windows")
AMD = Hardware(amd_driver=True, kfd=True)
INTEL = Hardware(intel_gpus=1)
MAC = Hardware(system="Darwin", arch="arm64", macos=(15, 1))
NO_MPS = gpus(device_type="mps", note="MPS is built in but not available on this machine")
H100 = "NVIDIA H100 80GB HBM3"
TWO = gpus(H100, H100)
FOUR = gpus(H100, H100, H100, H100)
NONE = gpus(note="this PyTorch build has no CUDA support")
HIDDEN = gpus(note="CUDA_VISIBLE_DEVICES='' hides all 4 GPU(s)")
MIXED = gpus("NVIDIA A100-SXM4-80GB", H100)
XPUS = gpus("Intel Data Center GPU Max 1550", "Intel Data Center GPU Max 1550", device_type="xpu")
NO_XPU = gpus(device_type="xpu", note="no XPU device is available to this PyTorch build")

# srun --ntasks-per-node=4: the third task; with --gpus-per-task=2, as Slurm says it.
THIRD_TASK = {"SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4"}
PER_TASK = {"SLURM_GPUS_PER_TASK": "2"}  # up to Slurm 23.02
TRES_BIND = {"SLURM_TRES_BIND": "gres/gpu:per_task:2"}  # from Slurm 23.11
MV2_THIRD = {"MV2_COMM_WORLD_LOCAL_RANK": "2", "MV2_COMM_WORLD_LOCAL_SIZE": "4"}

# (name, machine, the findings as (severity, code), in the order they are listed)
CASES: list[tuple[str, Machine, list[tuple[str, str]]]] = [
    ("a clean machine with two GPUs", on(TWO, environ={}), []),
    ("a clean machine without GPUs", on(NONE, environ={}), []),
    # The launcher's local rank.
    (
        "LOCAL_RANK not a number",
        on(TWO, environ={"LOCAL_RANK": "two"}),
        [("error", "local-rank-not-a-number")],
    ),
    (
        "SLURM_LOCALID empty",
        on(TWO, environ={"SLURM_LOCALID": ""}),
        [("error", "local-rank-not-a-number")],
    ),
    (
        "Open MPI's local rank negative",
        on(TWO, environ={"OMPI_COMM_WORLD_LOCAL_RANK": "-1"}),
        [("error", "local-rank-not-a-number")],
    ),
    ("a rank with its GPU", on(TWO, environ={"LOCAL_RANK": "1"}), []),
    (
        "an MVAPICH2 rank past the GPUs",
        on(TWO, environ={"MV2_COMM_WORLD_LOCAL_RANK": "2"}),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "a rank past the GPUs",
        on(TWO, environ={"LOCAL_RANK": "2"}),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "four torchrun ranks on two GPUs",
        on(TWO, environ={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "two torchrun ranks on two GPUs",
        on(TWO, environ={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}),
        [],
    ),
    (
        "four Slurm tasks on four GPUs",
        on(FOUR, environ={"SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"}),
        [],
    ),
    (
        "eight Slurm tasks on four GPUs",
        on(FOUR, environ={"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "8"}),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "a second MPICH rank on one GPU",
        on(gpus(H100), environ={"MPI_LOCALRANKID": "1"}),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "each PALS rank given its own GPU",
        on(
            gpus(H100),
            environ={"PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "2", "CUDA_VISIBLE_DEVICES": "1"},
        ),
        [],
    ),
    (
        "torchrun inside a Slurm job: torchrun's rank is read",
        on(TWO, environ={"LOCAL_RANK": "1", "SLURM_LOCALID": "5"}),
        [],
    ),
    (
        "mpirun inside a Slurm job: Open MPI's rank is read",
        on(TWO, environ={"OMPI_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"}),
        [],
    ),
    (
        "mpiexec inside a Slurm job, a rank past the GPUs",
        on(TWO, environ={"MPI_LOCALRANKID": "2", "SLURM_LOCALID": "0"}),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "srun --gpus-per-task=2: each task its own two GPUs",
        on(TWO, environ={**THIRD_TASK, "CUDA_VISIBLE_DEVICES": "4,5", **PER_TASK}),
        [],
    ),
    (
        "srun --gpus-per-task=2 on Slurm 23.11 and later",
        on(TWO, environ={**THIRD_TASK, "CUDA_VISIBLE_DEVICES": "4,5", **TRES_BIND}),
        [],
    ),
    (
        "srun with plain --gres: every task the same two GPUs",
        on(TWO, environ={**THIRD_TASK, "CUDA_VISIBLE_DEVICES": "0,1"}),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "torchrun --nproc_per_node=4 with CUDA_VISIBLE_DEVICES=0,1",
        on(
            TWO,
            environ={"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"},
        ),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "torchrun inside srun --gpus-per-task=2: its ranks share the task's GPUs",
        on(
            TWO,
            environ={
                **THIRD_TASK,
                **PER_TASK,
                "CUDA_VISIBLE_DEVICES": "4,5",
                "LOCAL_RANK": "2",
                "LOCAL_WORLD_SIZE": "4",
            },
        ),
        [("error", "more-ranks-than-devices")],
    ),
    (
        "each rank its own AMD GPU through HIP_VISIBLE_DEVICES",
        on(
            gpus("AMD Instinct MI300X"),
            environ={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "HIP_VISIBLE_DEVICES": "1"},
            build=ROCM_BUILD,
        ),
        [],
    ),
    (
        "a malformed rank that DEVICEKIT_DEVICE makes unused",
        on(TWO, environ={"LOCAL_RANK": "x", "DEVICEKIT_DEVICE": "cpu"}),
        [],
    ),
    (
        "two ranks on a machine without GPUs train on its CPU",
        on(NONE, environ={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
        [("warning", "ranks-on-cpu")],
    ),
    (
        "ranks meant for the CPU say so",
        on(NONE, environ={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "DEVICEKIT_DEVICE": "cpu"}),
        [],
    ),
    (
        "ranks on the CPU beside NVIDIA GPUs that a CPU-only PyTorch cannot use",
        on(NONE, environ={"LOCAL_RANK": "0"}, hardware=NVIDIA),
        [("error", "build-without-cuda"), ("warning", "ranks-on-cpu")],
    ),
    (
        "each rank its own Intel GPU",
        on(gpus("Max", device_type="xpu"), environ={"LOCAL_RANK": "1", "ZE_AFFINITY_MASK": "1"}),
        [],
    ),
    (
        "three ranks on two Intel GPUs",
        on(XPUS, environ={"LOCAL_RANK": "2"}),
        [("error", "more-ranks-than-devices")],
    ),
    # Variables that give each process its GPUs.
    (
        "CUDA_VISIBLE_DEVICES hides every GPU",
        on(HIDDEN, environ={"CUDA_VISIBLE_DEVICES": ""}),
        [("error", "visible-devices-hide-all")],
    ),
    ("CUDA_VISIBLE_DEVICES lists two", on(TWO, environ={"CUDA_VISIBLE_DEVICES": "0,1"}), []),
    (
        "CUDA_VISIBLE_DEVICES empty where there is no GPU to hide",
        on(NONE, environ={"CUDA_VISIBLE_DEVICES": ""}),
        [],
    ),
    (
        "CUDA_VISIBLE_DEVICES set after CUDA started",
        on(FOUR, environ={"CUDA_VISIBLE_DEVICES": "0"}, cuda_started=True, cuda_count=4),
        [("error", "visible-devices-after-cuda")],
    ),
    (
        "CUDA_VISIBLE_DEVICES set before CUDA started",
        on(TWO, environ={"CUDA_VISIBLE_DEVICES": "2,3"}, cuda_started=True, cuda_count=2),
        [],
    ),
    (
        "CUDA_VISIBLE_DEVICES with CUDA not started",
        on(gpus(H100), environ={"CUDA_VISIBLE_DEVICES": "0"}),
        [],
    ),
    (
        "CUDA_VISIBLE_DEVICES repeating a GPU, read as CUDA reads it: none",
        on(
            gpus(note="CUDA_VISIBLE_DEVICES='0,0' hides all 2 GPU(s)"),
            environ={"CUDA_VISIBLE_DEVICES": "0,0"},
            cuda_started=True,
            cuda_count=0,
        ),
        [("error", "visible-devices-repeated")],
    ),
    (
        "CUDA_VISIBLE_DEVICES repeating a GPU, CUDA started before it: the repeat, not the timing",
        on(
            TWO,
            environ={"CUDA_VISIBLE_DEVICES": "0,0"},
            cuda_started=True,
            cuda_count=2,
            hardware=NVIDIA,
            build=CUDA_BUILD,
        ),
        [("error", "visible-devices-repeated")],
    ),
    (
        "CUDA_VISIBLE_DEVICES repeating a GPU, listed without NVML (no note)",
        on(gpus(), environ={"CUDA_VISIBLE_DEVICES": "1,0,1"}, hardware=NVIDIA, build=CUDA_BUILD),
        [("error", "visible-devices-repeated")],
    ),
    (
        "CUDA_VISIBLE_DEVICES repeating a GPU on a machine without any",
        on(NONE, environ={"CUDA_VISIBLE_DEVICES": "0,0"}),
        [("warning", "visible-devices-repeated")],
    ),
    (
        "CUDA_VISIBLE_DEVICES stopping at -1 before a repeat: no repeat",
        on(gpus(H100), environ={"CUDA_VISIBLE_DEVICES": "0,-1,0"}, cuda_started=True, cuda_count=1),
        [],
    ),
    (
        "CUDA_VISIBLE_DEVICES by UUID: not counted",
        on(TWO, environ={"CUDA_VISIBLE_DEVICES": "GPU-5f1c"}, cuda_started=True, cuda_count=4),
        [],
    ),
    (
        "ROCm: ROCR and HIP disagree and leave no GPU",
        on(
            gpus(),
            environ={"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "2"},
            build=ROCM_BUILD,
        ),
        [("error", "rocm-visibility-conflict")],
    ),
    (
        "ROCm: ROCR and HIP disagree, one GPU left",
        on(
            gpus("AMD Instinct MI300X"),
            environ={"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "1"},
            build=ROCM_BUILD,
        ),
        [("warning", "rocm-visibility-conflict")],
    ),
    (
        "ROCm: HIP and CUDA variables agree",
        on(
            gpus("AMD Instinct MI300X"),
            environ={"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"},
            build=ROCM_BUILD,
        ),
        [],
    ),
    (
        "ZE_AFFINITY_MASK malformed",
        on(XPUS, environ={"ZE_AFFINITY_MASK": "first"}),
        [("error", "affinity-mask-hides-all")],
    ),
    ("ZE_AFFINITY_MASK with a tile", on(XPUS, environ={"ZE_AFFINITY_MASK": "0.1,1"}), []),
    (
        "ZE_AFFINITY_MASK listing no device",
        on(NO_XPU, environ={"ZE_AFFINITY_MASK": "5"}),
        [("error", "affinity-mask-hides-all")],
    ),
    # Why no accelerator is usable.
    (
        "a CPU-only PyTorch beside an NVIDIA driver",
        on(NONE, hardware=NVIDIA),
        [("error", "build-without-cuda")],
    ),
    # nvidia-smi stays installed where its driver is gone or failed to load: no GPU by itself.
    ("a CPU-only PyTorch beside nvidia-smi and no driver", on(NONE, hardware=SMI_ALONE), []),
    (
        "a CPU-only PyTorch on Windows, whose driver NVML reads (Windows has no /dev)",
        on(NONE, hardware=WINDOWS),
        [("error", "build-without-cuda")],
    ),
    ("a CUDA PyTorch with its NVIDIA GPUs", on(TWO, hardware=NVIDIA, build=CUDA_BUILD), []),
    (
        "a ROCm PyTorch on NVIDIA GPUs",
        on(gpus(), hardware=NVIDIA, build=ROCM_BUILD),
        [("error", "build-without-cuda")],
    ),
    (
        "a CUDA PyTorch on AMD GPUs",
        on(gpus(note="NVML could not be read"), hardware=AMD, build=CUDA_BUILD),
        [("warning", "build-without-rocm")],
    ),
    (
        "a ROCm PyTorch with its AMD GPUs",
        on(gpus("AMD Instinct MI300X"), hardware=AMD, build=ROCM_BUILD),
        [],
    ),
    (
        "a CPU-only PyTorch beside an Intel GPU",
        on(NONE, NO_XPU, hardware=INTEL),
        [("warning", "build-without-xpu")],
    ),
    (
        "an Intel display GPU beside NVIDIA GPUs",
        on(TWO, hardware=NVIDIA._replace(intel_gpus=1), build=CUDA_BUILD),
        [],
    ),
    (
        "a container started without its NVIDIA GPUs",
        on(gpus(note="NVML could not be read"), hardware=WITHOUT_FILES, build=CUDA_BUILD),
        [("error", "container-without-gpus")],
    ),
    (
        "a container without GPUs and a CPU-only PyTorch",
        on(NONE, hardware=WITHOUT_FILES),
        [("error", "build-without-cuda"), ("error", "container-without-gpus")],
    ),
    (
        "a container started without /dev/kfd",
        on(gpus(), hardware=Hardware(amd_driver=True), build=ROCM_BUILD),
        [("warning", "container-without-gpus")],
    ),
    (
        "a driver too old for the build's CUDA",
        on(TWO, hardware=OLD_DRIVER, build=CUDA_BUILD),
        [("error", "driver-too-old")],
    ),
    (
        "a driver one CUDA minor release behind the build",
        on(TWO, hardware=BEHIND_DRIVER, build=CUDA_BUILD),
        [("warning", "driver-too-old")],
    ),
    (
        "a driver whose CUDA NVML cannot tell",
        on(TWO, hardware=NVIDIA._replace(driver_cuda=None), build=CUDA_BUILD),
        [],
    ),
    (
        "an XPU PyTorch whose Intel GPU has no compute runtime",
        on(NO_XPU, hardware=INTEL, build=XPU_BUILD),
        [("warning", "xpu-unavailable")],
    ),
    ("an XPU PyTorch with its Intel GPUs", on(XPUS, hardware=INTEL, build=XPU_BUILD), []),
    (
        "a PyTorch without MPS in an x86_64 Python on a Mac",
        on(gpus(device_type="mps"), hardware=MAC._replace(arch="x86_64"), build=Build("2.2.2")),
        [("warning", "build-without-mps")],
    ),
    (
        "a macOS too old for MPS",
        on(NO_MPS, hardware=MAC._replace(macos=(13, 6)), build=MAC_BUILD),
        [("error", "macos-too-old")],
    ),
    (
        "MPS in a macOS virtual machine",
        on(NO_MPS, hardware=MAC, build=MAC_BUILD),
        [("warning", "mps-unavailable")],
    ),
    (
        "a Mac with MPS",
        on(gpus("Apple GPU (MPS)", device_type="mps"), hardware=MAC, build=MAC_BUILD),
        [],
    ),
    # Numbering.
    ("two GPU models numbered by speed", on(MIXED, environ={}), [("warning", "device-order")]),
    (
        "two GPU models numbered by PCI bus",
        on(MIXED, environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
        [],
    ),
    ("four GPUs of one model", on(FOUR, environ={}), []),
    # DEVICEKIT_DEVICE.
    (
        "DEVICEKIT_DEVICE past the GPUs",
        on(TWO, environ={"DEVICEKIT_DEVICE": "cuda:3"}),
        [("error", "devicekit-device")],
    ),
    ("DEVICEKIT_DEVICE a GPU here", on(TWO, environ={"DEVICEKIT_DEVICE": "cuda:1"}), []),
    (
        "DEVICEKIT_DEVICE no device at all",
        on(TWO, environ={"DEVICEKIT_DEVICE": "gpu"}),
        [("error", "devicekit-device")],
    ),
    (
        "DEVICEKIT_DEVICE an index past the GPUs",
        on(TWO, environ={"DEVICEKIT_DEVICE": "2"}),
        [("error", "devicekit-device")],
    ),
    ("DEVICEKIT_DEVICE an index here", on(TWO, environ={"DEVICEKIT_DEVICE": " 1 "}), []),
    ("DEVICEKIT_DEVICE the CPU", on(NONE, environ={"DEVICEKIT_DEVICE": "cpu"}), []),
    (
        "DEVICEKIT_DEVICE a family with no device here",
        on(
            TWO,
            gpus(device_type="mps", note="MPS is built in but not available"),
            environ={"DEVICEKIT_DEVICE": "mps"},
        ),
        [("error", "devicekit-device")],
    ),
    (
        "DEVICEKIT_DEVICE a device of an extension's backend no family lists",
        on(TWO, environ={"DEVICEKIT_DEVICE": "xla"}, loaded=lambda device_type: True),
        [],
    ),
    (
        "DEVICEKIT_DEVICE a device type this PyTorch has no backend for",
        on(TWO, environ={"DEVICEKIT_DEVICE": "xla"}),
        [("error", "devicekit-device")],
    ),
    # The claim directory.
    (
        "a claim directory set but unusable",
        on(TWO, environ={"DEVICEKIT_CLAIM_DIR": "/srv/claims"}, claim_problem="it is a file"),
        [("error", "claim-directory")],
    ),
    (
        "the default claim directory unusable",
        on(TWO, environ={}, claim_problem="it is a file"),
        [("warning", "claim-directory")],
    ),
    # Several at once: errors first.
    (
        "a warning and an error",
        on(MIXED, environ={"LOCAL_RANK": "x"}),
        [("error", "local-rank-not-a-number"), ("warning", "device-order")],
    ),
]


@pytest.mark.parametrize(("machine", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_mistake_is_found_and_nothing_else(
    machine: Machine, expected: list[tuple[str, str]]
) -> None:
    findings = diagnose(machine)
    assert [(f.severity, f.code) for f in findings] == expected
    for finding in findings:  # each line says what, why, and the fix
        assert finding.what
        assert finding.why
        assert finding.fix
        assert (
            finding.line()
            == f"{finding.severity}: {finding.what}: {finding.why}. Fix: {finding.fix}."
        )


def test_there_are_at_least_forty_cases_and_each_finding_has_one() -> None:
    assert len(CASES) >= 40
    assert {code for _, _, found in CASES for _, code in found} == {
        "build-without-cuda",
        "build-without-rocm",
        "build-without-xpu",
        "build-without-mps",
        "container-without-gpus",
        "driver-too-old",
        "xpu-unavailable",
        "macos-too-old",
        "mps-unavailable",
        "ranks-on-cpu",
        "local-rank-not-a-number",
        "more-ranks-than-devices",
        "visible-devices-hide-all",
        "visible-devices-repeated",
        "visible-devices-after-cuda",
        "rocm-visibility-conflict",
        "affinity-mask-hides-all",
        "device-order",
        "devicekit-device",
        "claim-directory",
    }


def test_a_finding_names_the_variable_its_value_and_the_launcher_s_option() -> None:
    (finding,) = diagnose(on(FOUR, environ={"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "8"}))
    assert finding.what == "SLURM_NTASKS_PER_NODE=8, and this process sees 4 cuda devices"
    # srun gives each task a CUDA_VISIBLE_DEVICES already: the fix is to bind GPUs to each.
    assert finding.fix == (
        "start at most 4 per node (srun --ntasks-per-node=4), or bind each task to GPUs of its "
        "own (srun --gpus-per-task=1, with no other --gpu-bind)"
    )
    (finding,) = diagnose(on(FOUR, environ={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}))
    assert finding.fix == (
        "start at most 4 per node (torchrun --nproc_per_node=4), or give each process its own "
        "CUDA_VISIBLE_DEVICES"
    )
    (finding,) = diagnose(on(XPUS, environ={"LOCAL_RANK": "2"}))
    assert finding.fix.endswith("its own ZE_AFFINITY_MASK")
    (finding,) = diagnose(
        on(FOUR, environ={"CUDA_VISIBLE_DEVICES": "0"}, cuda_started=True, cuda_count=4)
    )
    assert finding.what == (
        "CUDA_VISIBLE_DEVICES='0' lists 1 GPU(s), but CUDA, started before it was set, sees 4"
    )


def test_the_snapshot_is_all_the_doctor_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "seven")
    assert diagnose(on(TWO, environ={})) == []


def test_look_takes_the_process_s_environment_and_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", "relative/claims")
    machine = look([FakeGpus([70.0, 70.0])])
    assert machine.environ["LOCAL_RANK"] == "3"
    (family,) = machine.families
    assert [info.device for info in family.devices] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    assert machine.cuda_started is False  # looking starts no CUDA
    assert machine.claim_problem is not None
    assert "relative" in machine.claim_problem
    assert [(f.severity, f.code) for f in diagnose(machine)] == [
        ("error", "more-ranks-than-devices"),
        ("error", "claim-directory"),
    ]


def _doctor_command(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
    **environ: str,
) -> subprocess.CompletedProcess[str]:
    """``devicekit doctor`` run in this process, where only ``environ`` of VARIABLES is set.

    Its status and output in the record a finished process gives.
    """
    for name in (*VARIABLES, "DEVICEKIT_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    status = _devicekit_cli.main(["doctor", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["devicekit", "doctor", *args], status, out, err)


def test_the_command_exits_1_naming_what_breaks_a_run_and_0_otherwise(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = _doctor_command(
        monkeypatch, capsys, LOCAL_RANK="two", DEVICEKIT_CLAIM_DIR=str(tmp_path)
    )
    assert broken.returncode == 1, broken.stderr
    assert broken.stdout.startswith("error: LOCAL_RANK='two' is no rank: ")
    assert "Fix: let torchrun set it" in broken.stdout
    clean = _doctor_command(monkeypatch, capsys, DEVICEKIT_CLAIM_DIR=str(tmp_path))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    machine = look()
    expected = [finding.line() for finding in diagnose(machine)] or ["No problem found."]
    findings, seen = clean.stdout.split("\n\nSeen:\n")
    assert findings.splitlines() == expected
    # What it saw: Python, this PyTorch and its build, the drivers, each family.
    build = Build.of_torch()
    lines = [line.strip() for line in seen.splitlines()]
    assert lines[0].startswith(f"Python {platform.python_version()} on ")
    assert lines[0].endswith(f"; PyTorch {torch.__version__}, built for {build.described}")
    assert lines[1].startswith("Drivers: NVIDIA ")
    for family in machine.families:
        assert any(line.startswith(family.name) for line in lines[2:]), (family, lines)
    assert lines[-1] == "Variables: DEVICEKIT_CLAIM_DIR=" + str(tmp_path)


def test_the_command_s_json_is_its_findings_and_what_it_saw(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _doctor_command(
        monkeypatch, capsys, "--json", DEVICEKIT_DEVICE="cuda:7", DEVICEKIT_CLAIM_DIR=str(tmp_path)
    )
    report = json.loads(result.stdout)
    assert result.returncode == 1
    assert set(report) == {"findings", "environment"}
    assert [Finding(**each) for each in report["findings"]] == diagnose(
        Machine(
            {"DEVICEKIT_DEVICE": "cuda:7"},
            look().families,
            hardware=probe(),
            build=Build.of_torch(),
        )
    )
    environment = report["environment"]
    assert environment["python"] == platform.python_version()
    assert environment["torch"]["version"] == torch.__version__
    assert environment["torch"]["cuda"] == torch.version.cuda
    assert environment["torch"]["built_for"] == Build.of_torch().described
    assert environment["drivers"]["nvidia_driver"] == probe().nvidia_driver
    assert environment["devices"]["cpu"] == ["cpu"]
    assert environment["variables"] == {
        "DEVICEKIT_DEVICE": "cuda:7",
        "DEVICEKIT_CLAIM_DIR": str(tmp_path),
    }


# The doctor and the manager: one set of rules.


@dataclasses.dataclass
class Listed:
    """A backend listing one family of a snapshot, so that a manager sees what the doctor saw."""

    family: Family

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def device_type(self) -> str:
        return self.family.device_type

    @property
    def note(self) -> str | None:
        return self.family.note

    def devices(self) -> list[DeviceInfo]:
        return list(self.family.devices)


RANK_CODES = {"local-rank-not-a-number", "more-ranks-than-devices"}


def _in_environment(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]) -> None:
    """Make ``environ`` the process's launcher, visibility and devicekit variables."""
    names = {name for launcher in LAUNCHERS for name in (launcher.rank, launcher.size)}
    names |= {name for group in VISIBILITY_VARIABLES.values() for name in group}
    names |= {"SLURM_GPUS_PER_TASK", "SLURM_TRES_BIND", "SLURM_GPU_BIND"}
    for name in (*names, "DEVICEKIT_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def _manager_refuses(families: tuple[Family, ...]) -> Exception | None:
    """The error a manager with the default options raises here, or None where it chooses."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback, said once
            dk.DeviceManager.from_env(backends=[Listed(family) for family in families])
    except (ValueError, dk.DeviceUnavailableError) as error:
        return error
    return None


ONE = gpus(H100)
AGREEMENT: list[tuple[str, tuple[Family, ...], dict[str, str]]] = [
    ("no launcher", (TWO,), {}),
    ("a rank with its GPU", (TWO,), {"LOCAL_RANK": "1"}),
    ("a rank past the GPUs", (TWO,), {"LOCAL_RANK": "2"}),
    ("more ranks than GPUs", (TWO,), {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}),
    ("a rank that is no number", (TWO,), {"LOCAL_RANK": "x"}),
    ("an empty Slurm rank", (TWO,), {"SLURM_LOCALID": ""}),
    ("a malformed rank, the CPU named", (TWO,), {"LOCAL_RANK": "x", "DEVICEKIT_DEVICE": "cpu"}),
    ("a malformed rank, a GPU named", (TWO,), {"LOCAL_RANK": "x", "DEVICEKIT_DEVICE": "1"}),
    (
        "HIP_VISIBLE_DEVICES per rank",
        (ONE,),
        {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "HIP_VISIBLE_DEVICES": "1"},
    ),
    ("ROCR_VISIBLE_DEVICES per rank", (ONE,), {"LOCAL_RANK": "3", "ROCR_VISIBLE_DEVICES": "3"}),
    (
        "CUDA_VISIBLE_DEVICES per rank",
        (ONE,),
        {"MPI_LOCALRANKID": "5", "MPI_LOCALNRANKS": "8", "CUDA_VISIBLE_DEVICES": "5"},
    ),
    ("one GPU, a second rank", (ONE,), {"MPI_LOCALRANKID": "1"}),
    ("mpirun inside Slurm", (TWO,), {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"}),
    (
        "mpirun inside Slurm, a rank past the GPUs",
        (TWO,),
        {"OMPI_COMM_WORLD_LOCAL_RANK": "3", "SLURM_LOCALID": "0"},
    ),
    ("torchrun inside Slurm", (TWO,), {"LOCAL_RANK": "1", "SLURM_LOCALID": "7"}),
    ("srun --gpus-per-task=2", (TWO,), {**THIRD_TASK, "CUDA_VISIBLE_DEVICES": "4,5", **PER_TASK}),
    (
        "srun --gpus-per-task=2, Slurm 23.11",
        (TWO,),
        {**THIRD_TASK, "CUDA_VISIBLE_DEVICES": "4,5", **TRES_BIND},
    ),
    ("srun with plain --gres", (TWO,), {**THIRD_TASK, "CUDA_VISIBLE_DEVICES": "0,1"}),
    (
        "srun with plain --gres, no task count",
        (TWO,),
        {"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "0,1"},
    ),
    (
        "srun --gpus-per-task=2 --gpu-bind=none",
        (TWO,),
        {**THIRD_TASK, "CUDA_VISIBLE_DEVICES": "0,1", **PER_TASK, "SLURM_GPU_BIND": "none"},
    ),
    (
        "torchrun --nproc_per_node=4, CUDA_VISIBLE_DEVICES=0,1, rank 2",
        (TWO,),
        {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"},
    ),
    (
        "torchrun --nproc_per_node=4, CUDA_VISIBLE_DEVICES=0,1, rank 0",
        (TWO,),
        {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"},
    ),
    (
        "mpirun inside srun --gpus-per-task=2, a rank past the task's GPUs",
        (TWO,),
        {**THIRD_TASK, **PER_TASK, "CUDA_VISIBLE_DEVICES": "4,5", "MPI_LOCALRANKID": "2"},
    ),
    (
        "eight Slurm tasks on four GPUs",
        (FOUR,),
        {"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "8"},
    ),
    ("an MVAPICH2 rank with its GPU", (TWO,), {"MV2_COMM_WORLD_LOCAL_RANK": "1"}),
    (
        "three MVAPICH2 ranks on two GPUs",
        (TWO,),
        {"MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "3"},
    ),
    (
        "MVAPICH2 ranks srun started with --gpus-per-task=2",
        (TWO,),
        {**THIRD_TASK, **PER_TASK, "CUDA_VISIBLE_DEVICES": "4,5", **MV2_THIRD},
    ),
    (
        "srun --gpus-per-task=1, the variable unset",
        (ONE,),
        {**THIRD_TASK, "SLURM_GPUS_PER_TASK": "1"},
    ),
    ("srun --gpus-per-task=2, the variable unset", (TWO,), {**THIRD_TASK, **PER_TASK}),
    ("a rank without GPUs", (NONE,), {"LOCAL_RANK": "3"}),
    ("three ranks on two Intel GPUs", (XPUS,), {"LOCAL_RANK": "2"}),
    ("each rank its own Intel GPU", (XPUS,), {"LOCAL_RANK": "2", "ZE_AFFINITY_MASK": "2,3"}),
]


@pytest.mark.parametrize(
    ("families", "environ"), [case[1:] for case in AGREEMENT], ids=[case[0] for case in AGREEMENT]
)
def test_the_doctor_finds_a_rank_problem_exactly_where_the_manager_refuses(
    monkeypatch: pytest.MonkeyPatch, families: tuple[Family, ...], environ: dict[str, str]
) -> None:
    found = {f.code for f in diagnose(on(*families, environ=environ))} & RANK_CODES
    _in_environment(monkeypatch, environ)
    refused = _manager_refuses((*families, CPU_FAMILY))
    expected = {
        type(None): set(),
        ValueError: {"local-rank-not-a-number"},
        dk.DeviceUnavailableError: {"more-ranks-than-devices"},
    }
    assert found == expected[type(refused)]


def test_hip_visible_devices_gives_a_rank_its_gpu_for_the_doctor_and_the_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The second of two ranks, each given its own AMD GPU: it sees one, cuda:0.
    environ = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "HIP_VISIBLE_DEVICES": "1"}
    machine = on(gpus("AMD Instinct MI300X"), environ=environ, build=ROCM_BUILD)
    _in_environment(monkeypatch, environ)
    manager = dk.DeviceManager.from_env(backends=[Listed(family) for family in machine.families])
    assert manager.device == torch.device("cuda", 0)
    assert manager.reason == "LOCAL_RANK=1, and this process sees one cuda device"
    assert diagnose(machine) == []


def test_a_repeated_gpu_in_cuda_visible_devices_hides_every_gpu_for_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA reads "0,0" as no GPU at all; the doctor counted two, and so took a CUDA that
    # sees none for one started before the variable was set.
    environ = {"CUDA_VISIBLE_DEVICES": "0,0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    _in_environment(monkeypatch, environ)
    nvml = [NvmlGpu(f"GPU-{i}", H100, 80 * GiB, 79 * GiB, f"0000:0{i}:00.0") for i in range(2)]
    backends = [CudaBackend(nvml=lambda: nvml, compiled=True), CpuBackend()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback
        manager = dk.DeviceManager.from_env(backends=backends)
    assert manager.device == torch.device("cpu")
    seen_by_cuda = [info for info in manager.devices if info.device.type == "cuda"]
    assert seen_by_cuda == []
    machine = look(backends)._replace(
        environ=environ, cuda_started=True, cuda_count=len(seen_by_cuda)
    )
    findings = diagnose(machine)
    assert [f.code for f in findings if f.code != "claim-directory"] == [
        "visible-devices-repeated",
        "ranks-on-cpu",
    ]
    assert findings[0].what == "CUDA_VISIBLE_DEVICES='0,0' lists GPU 0 twice"


def test_a_repeated_gpu_is_named_with_the_value_meant_and_not_as_a_timing_problem() -> None:
    # CUDA started before the variable was set sees both GPUs; "set it earlier" would leave
    # the job with none, since CUDA shows no GPU where one is listed twice.
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,0"}
    machine = on(TWO, environ=environ, cuda_started=True, cuda_count=2, hardware=NVIDIA)
    (finding,) = diagnose(machine._replace(build=CUDA_BUILD))
    assert finding.line() == (
        "error: CUDA_VISIBLE_DEVICES='0,1,0' lists GPU 0 twice: CUDA shows no GPU at all where "
        "one is listed twice (PyTorch counts none too), so the job trains on the CPU, or fails "
        "where it asks for cuda. Fix: list each GPU once: CUDA_VISIBLE_DEVICES='0,1'."
    )
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-5f1c,GPU-5f1c"}
    (finding,) = diagnose(on(gpus(), environ=uuids, hardware=NVIDIA, build=CUDA_BUILD))
    assert finding.what == "CUDA_VISIBLE_DEVICES='GPU-5f1c,GPU-5f1c' lists 'GPU-5f1c' twice"
    # The CPU fallback's warning says the same words (why_cpu is what it warns of).
    assert [f.code for f in why_cpu(on(gpus(), environ=uuids, hardware=NVIDIA))] == [
        "build-without-cuda",
        "visible-devices-repeated",
    ]


# A family that prefer= does not name by default: an index names none of its devices.
GAUDI = gpus("Gaudi 2", device_type="hpu")
NAMED: list[tuple[str, tuple[Family, ...], str]] = [
    ("a GPU here", (TWO,), "cuda:1"),
    ("past the GPUs", (TWO,), "cuda:3"),
    ("the current GPU", (TWO,), "cuda"),
    ("no device at all", (TWO,), "gpu"),
    ("an index here", (TWO,), " 1 "),
    ("an index past the GPUs", (TWO,), "2"),
    ("the CPU without GPUs", (NONE,), "cpu"),
    ("meta", (TWO,), "meta"),
    ("a GPU without GPUs", (NONE,), "cuda:0"),
    ("a family with no device here", (TWO, gpus(device_type="mps", note="not available")), "mps"),
    ("a type this PyTorch has no backend for", (TWO,), "xla"),
    ("an index where only a family prefer leaves out has devices", (GAUDI,), "0"),
    ("a device of that family", (GAUDI,), "hpu:0"),
]


@pytest.mark.parametrize(
    ("families", "spec"), [case[1:] for case in NAMED], ids=[case[0] for case in NAMED]
)
def test_the_doctor_refuses_devicekit_device_exactly_where_the_manager_does_in_its_words(
    monkeypatch: pytest.MonkeyPatch, families: tuple[Family, ...], spec: str
) -> None:
    environ = {"DEVICEKIT_DEVICE": spec}
    machine = on(*families, environ=environ, loaded=has_backend)  # as look() takes it
    found = [f.what for f in diagnose(machine) if f.code == "devicekit-device"]
    _in_environment(monkeypatch, environ)
    refused = _manager_refuses(machine.families)
    assert found == ([] if refused is None else [str(refused).removesuffix(".")])


# What lies beneath PyTorch, read from files.


def _lay_out(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_probe_reads_the_drivers_and_device_files_under_a_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_hardware, "read_driver", lambda: ("570.86.15", (12, 8)))
    smi = _lay_out(tmp_path / "bin", {"nvidia-smi": "#!/bin/sh\n"})
    (smi / "nvidia-smi").chmod(0o755)
    server = _lay_out(
        tmp_path / "server",
        {
            "proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  "
            "535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc 12\n",
            "dev/nvidia0": "",
            "dev/nvidia1": "",
            "dev/nvidiactl": "",  # not a GPU
            "dev/nvidia-uvm": "",  # not a GPU
            "sys/class/drm/renderD128/device/vendor": "0x8086\n",  # the board's Intel graphics
            "sys/class/drm/renderD129/device/vendor": "0x10de\n",  # an NVIDIA GPU's node
        },
    )
    hardware = probe(server, path=str(smi))
    assert hardware.nvidia_driver == "535.104.05"  # the kernel module's, over NVML's
    assert (hardware.nvidia_files, hardware.nvidia_smi, hardware.driver_cuda) == (2, True, (12, 8))
    assert (hardware.amd, hardware.intel_gpus) == (False, 1)
    # A container started without its GPUs: the host's driver in /proc, no device file.
    monkeypatch.setattr(_hardware, "read_driver", lambda: None)  # NVML cannot start there
    container = _lay_out(
        tmp_path / "container",
        {"proc/driver/nvidia/version": "NVRM version: something else\n"},
    )
    hardware = probe(container, path=str(tmp_path / "nowhere"))
    assert (hardware.nvidia_driver, hardware.nvidia_files, hardware.nvidia_smi) == ("", 0, False)
    assert [f.code for f in why_cpu(Machine({}, hardware=hardware))] == [
        "build-without-cuda",
        "container-without-gpus",
    ]
    amd = _lay_out(tmp_path / "amd", {"dev/kfd": "", "sys/module/amdgpu/version": ""})
    hardware = probe(amd, path=str(tmp_path / "nowhere"))
    assert (hardware.amd_driver, hardware.kfd, hardware.nvidia) == (True, True, False)
    # Nothing at all: no driver is asked (NVML is not started where no NVIDIA driver is).
    monkeypatch.setattr(_hardware, "read_driver", lambda: pytest.fail("NVML read"))
    assert (
        probe(tmp_path / "empty", path=str(tmp_path / "nowhere"))._replace(
            system="", arch="", macos=None
        )
        == Hardware()
    )


def test_nvidia_smi_on_the_path_is_no_nvidia_gpu_without_its_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_hardware, "read_driver", lambda: None)  # NVML finds no driver
    smi = _lay_out(tmp_path / "bin", {"nvidia-smi": "#!/bin/sh\n"})
    (smi / "nvidia-smi").chmod(0o755)
    # A Linux machine whose module is not loaded: /proc, and nothing of NVIDIA's in it.
    linux = _lay_out(tmp_path / "linux", {"proc/cpuinfo": "", "dev/null": ""})
    hardware = probe(linux, path=str(smi))
    assert (hardware.nvidia_smi, hardware.nvidia_driver, hardware.nvidia) == (True, None, False)
    assert why_cpu(Machine({}, hardware=hardware)) == []
    # Windows: no /proc; the driver's own NVML library beside nvidia-smi says it is there.
    _lay_out(smi, {"nvml.dll": ""})
    hardware = probe(tmp_path / "windows", path=str(smi))
    assert (hardware.nvidia_driver, hardware.nvidia) == ("", True)


def test_the_doctor_command_exits_0_beside_nvidia_smi_without_a_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_hardware, "read_driver", lambda: None)
    if _hardware.probe().nvidia:
        pytest.skip("this machine has an NVIDIA driver")
    smi = _lay_out(tmp_path / "bin", {"nvidia-smi": "#!/bin/sh\n"})
    (smi / "nvidia-smi").chmod(0o755)
    _in_environment(monkeypatch, {"DEVICEKIT_CLAIM_DIR": str(tmp_path / "claims")})
    monkeypatch.setenv("PATH", f"{smi}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("DEVICEKIT_DEBUG", raising=False)
    status = _devicekit_cli.main(["doctor"])
    out = capsys.readouterr().out
    assert "build-without-cuda" not in out
    assert "this machine has an NVIDIA GPU" not in out
    assert "  Drivers: NVIDIA none (nvidia-smi without a driver); " in out
    assert status == (1 if any(f.severity == "error" for f in diagnose(look())) else 0)


def test_the_fix_names_the_pip_line_of_the_build_the_driver_runs() -> None:
    driver = NVIDIA._replace(driver_cuda=(12, 9))
    (finding,) = why_cpu(Machine({}, hardware=driver, build=Build("2.13.0+cpu")))
    assert finding.what == (
        "this PyTorch (2.13.0+cpu) is built for the CPU only, and this machine has an NVIDIA "
        "GPU (driver 570.86.15)"
    )
    assert finding.fix == (
        "install PyTorch's CUDA build: `pip install torch==2.13.0 --index-url "
        "https://download.pytorch.org/whl/cu128`"
    )
    (finding,) = why_cpu(Machine({}, hardware=OLD_DRIVER, build=CUDA_BUILD))
    assert finding.what == (
        "this PyTorch is built for CUDA 12.8, and the NVIDIA driver (470.256.02) runs CUDA "
        "11.4 at most"
    )
    assert finding.fix == "update the NVIDIA driver to one that runs CUDA 12.8"  # none runs 11.4
    behind = NVIDIA._replace(driver_cuda=(12, 6))
    (finding,) = why_cpu(Machine({}, hardware=behind, build=CUDA_BUILD))
    assert finding.fix == (
        "update the NVIDIA driver to one that runs CUDA 12.8, or install a build it runs: "
        "`pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126`"
    )
    (finding,) = why_cpu(on(NO_MPS, hardware=MAC._replace(macos=(13, 6)), build=MAC_BUILD))
    assert finding.what == "macOS 13.6 is older than the 14.0 this PyTorch's MPS needs"


def test_no_accelerator_at_all_is_no_finding() -> None:
    # This machine's own CPU-only PyTorch with no GPU beneath it: the CPU is the only choice.
    assert why_cpu(on(NONE, NO_XPU, hardware=Hardware(system="Linux", arch="x86_64"))) == []
