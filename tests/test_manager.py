"""DeviceManager with fake backends: policies, fallback, bad specs, environment, contexts."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import TYPE_CHECKING

import pytest
import torch

import devicekit as dk
from devicekit._base import _units
from devicekit._select import Machine, _claims, _hardware, _launch, _manager, why_cpu
from devicekit._select._hardware import Build, Hardware

from .fakes import FakeGpus, machine
from .helpers import CPU, META, cuda

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

FALLBACK_WARNING = (
    "devicekit uses the CPU: no cuda, xpu or mps device is usable; see DeviceManager().explain()."
)
NO_HARDWARE = Hardware()
NVIDIA = Hardware(nvidia_driver="570.86.15", nvidia_files=1, driver_cuda=(12, 8))
CPU_ONLY = Build("2.13.0+cpu")
EXPECTED_A_DEVICE = "Expected a device such as 'cpu', 'cuda', 'cuda:0', 'mps', 'xpu' or 'meta'"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    launchers = [name for launcher in _launch.LAUNCHERS for name in (launcher.rank, launcher.size)]
    slurm = ("SLURM_GPUS_PER_TASK", "SLURM_TRES_BIND", "SLURM_GPU_BIND")
    visibility = [name for names in _launch.VISIBILITY_VARIABLES.values() for name in names]
    for name in (*launchers, *slurm, *visibility, "DEVICEKIT_DEVICE", "DEVICEKIT_CLAIM_DIR"):
        monkeypatch.delenv(name, raising=False)
    # The machine beneath PyTorch is each test's to say: none, unless a test gives one.
    monkeypatch.setattr(_hardware, "probe", lambda: NO_HARDWARE)
    _manager._fallback_warned.clear()
    yield
    _manager._fallback_warned.clear()


# Selection.


def test_one_gpu_is_selected() -> None:
    manager = dk.DeviceManager(backends=machine(70))
    assert manager.device == cuda(0)
    assert manager.reason == "the only usable cuda device (70.0 GiB of 80.0 GiB free)"


def test_auto_passes_over_a_busy_gpu_to_the_first_with_about_the_most_free() -> None:
    manager = dk.DeviceManager(backends=machine(10, 70, 71, 30))
    assert manager.device == cuda(1)
    assert manager.reason == "the first with about the most free memory (70.0 GiB of 80.0 GiB)"


def test_auto_on_an_idle_machine_takes_the_first_gpu() -> None:
    assert dk.DeviceManager(backends=machine(79.5, 79.9, 79.7, 79.8)).device == cuda(0)


def test_most_free_memory_takes_the_most_free() -> None:
    manager = dk.DeviceManager(policy="most-free-memory", backends=machine(10, 70, 71, 30))
    assert manager.device == cuda(2)
    assert manager.reason == "it has the most free memory (71.0 GiB of 80.0 GiB)"


def test_unknown_free_memory_takes_the_first() -> None:
    manager = dk.DeviceManager(policy="most-free-memory", backends=machine(None, None))
    assert manager.device == cuda(0)
    assert manager.reason == "the first cuda device; free memory is unknown"


def test_min_free_memory_skips_full_gpus() -> None:
    manager = dk.DeviceManager(min_free_memory="50GiB", backends=machine(10, 60, 30))
    assert manager.device == cuda(1)
    assert (
        "Skipped cuda:0: 10.0 GiB free of 80.0 GiB, less than the 50.0 GiB min" in manager.explain()
    )


def test_min_free_memory_in_bytes() -> None:
    manager = dk.DeviceManager(min_free_memory=65 * 2**30, backends=machine(60, 70))
    assert manager.device == cuda(1)


def test_prefer_orders_the_families() -> None:
    backends = [FakeGpus([50]), FakeGpus([50], name="xpu", device_type="xpu")]
    assert dk.DeviceManager(backends=backends).device == cuda(0)
    assert dk.DeviceManager(prefer=("xpu", "cuda"), backends=backends).device == torch.device(
        "xpu", 0
    )


def test_cuda_in_prefer_matches_rocm_gpus() -> None:
    backends = [FakeGpus([50], name="rocm")]
    manager = dk.DeviceManager(backends=backends)
    assert manager.device == cuda(0)
    assert manager.devices[0].backend == "rocm"


# Fallback.


def test_a_machine_without_accelerators_uses_its_cpu_without_a_warning() -> None:
    # filterwarnings=error: any warning fails the test.
    manager = dk.DeviceManager(backends=machine(note="this PyTorch build has no CUDA support"))
    assert manager.device == CPU
    assert manager.device_id is None
    assert manager.reason == "no cuda, xpu or mps device is usable, so the CPU is the fallback"
    assert (
        manager.explain()
        .splitlines()[0]
        .endswith(": no cuda, xpu or mps device is usable, so the CPU is the fallback.")
    )
    assert "  no cuda: this PyTorch build has no CUDA support" in manager.explain()


def test_an_accelerator_present_but_unusable_is_warned_of_once_with_the_doctor_s_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_hardware, "probe", lambda: NVIDIA)
    monkeypatch.setattr(Build, "of_torch", lambda: CPU_ONLY)
    backends = machine(note="this PyTorch build has no CUDA support")
    (cause,) = why_cpu(Machine({}, hardware=NVIDIA, build=CPU_ONLY))
    assert cause.code == "build-without-cuda"
    expected = f"{FALLBACK_WARNING} Cause: {cause.sentence()}"
    assert "pip install torch==" in expected
    with pytest.warns(RuntimeWarning, match=f"^{re.escape(expected)}$") as record:
        manager = dk.DeviceManager(backends=backends)
    assert record[0].filename == __file__  # the user's line, not devicekit's
    assert manager.device == CPU
    assert f"Cause: {cause.sentence()}" in manager.explain().splitlines()
    again = dk.DeviceManager(backends=backends)  # no second warning: filterwarnings=error
    assert f"Cause: {cause.sentence()}" in again.explain().splitlines()


def test_full_gpus_fall_back_too_and_say_why_for_each() -> None:
    msg = FALLBACK_WARNING
    with pytest.warns(RuntimeWarning, match=f"^{re.escape(msg)}$"):
        manager = dk.DeviceManager(min_free_memory="8GiB", backends=machine(1, 2))
    assert manager.device == CPU
    for index, free in ((0, 1), (1, 2)):  # the warning's one sentence points here
        skipped = (
            f"Skipped cuda:{index}: {free}.0 GiB free of 80.0 GiB, less than the 8.0 GiB "
            "min_free_memory asks."
        )
        assert skipped in manager.explain()


def test_fallback_error_lists_what_was_found() -> None:
    msg = (
        "Expected a usable cuda, xpu or mps device, but no cuda, xpu or mps device is usable. "
        "No cuda device is visible (this PyTorch build has no CUDA support). Devices here: cpu."
    )
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.DeviceManager(
            fallback="error", backends=machine(note="this PyTorch build has no CUDA support")
        )


# Claims of this very process: nothing to wait for.


class FakeClock:
    """time.monotonic and time.sleep for a manager that may wait: sleeping moves time on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        monkeypatch.setattr(_manager, "_clock", lambda: self.now)
        monkeypatch.setattr(_manager, "_sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A claim directory for this test alone, and the claims it took given back after it."""
    directory = tmp_path / "claims"
    monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", str(directory))
    yield directory
    for claim in list(_claims._taken.values()):
        while claim.key in _claims._taken:
            claim.release()


OWN_CLAIM = (
    "no cuda, xpu or mps device is usable: cuda:0 is claimed by this process (another of its "
    "managers): close() it, leave its with block, or name the device to share it (wait= does "
    "not wait for this process)"
)


@pytest.mark.usefixtures("claims")
def test_a_cell_run_twice_falls_back_at_once_rather_than_wait_for_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A notebook on a one-GPU machine: the cell's first run still holds cuda:0. Only this
    # process can give it back, so wait="10m" would wait ten minutes, then use the CPU.
    clock, backends = FakeClock(monkeypatch), machine(70)
    first = dk.DeviceManager(claim=True, wait="10m", backends=backends)
    assert first.device == cuda(0)
    msg = f"devicekit uses the CPU: {OWN_CLAIM}; see DeviceManager().explain()."
    with pytest.warns(RuntimeWarning, match=f"^{re.escape(msg)}$"):
        second = dk.DeviceManager(claim=True, wait="10m", backends=backends)
    assert (second.device, clock.sleeps) == (CPU, [])
    assert second.reason == f"{OWN_CLAIM}, so the CPU is the fallback"
    assert "Skipped cuda:0: claimed by this process (another of its managers)." in (
        second.explain()
    )
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(f"but {OWN_CLAIM}. Passed")):
        dk.DeviceManager(claim=True, wait="10m", fallback="error", backends=backends)
    assert clock.sleeps == []
    # What the reason advises: name the device (its claim is shared), or close the first.
    named = dk.DeviceManager("cuda:0", claim=True, wait="10m", backends=backends)
    assert named.device == cuda(0)
    named.close()
    first.close()
    assert dk.DeviceManager(claim=True, wait="10m", backends=backends).device == cuda(0)
    assert clock.sleeps == []


def test_preferring_the_cpu_is_not_a_fallback() -> None:
    manager = dk.DeviceManager(prefer=("cpu",), backends=machine(70))
    assert manager.device == CPU
    assert manager.reason == "prefer puts the CPU first"
    # The CPU first, an accelerator after it, usable GPUs: the CPU, without a warning.
    manager = dk.DeviceManager(prefer=("cpu", "cuda"), backends=machine(70))
    assert manager.device == CPU
    assert manager.reason == "prefer puts the CPU first"


def test_the_fallback_warning_points_at_the_user_s_line_from_to_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit._select import _manager  # noqa: PLC0415 - the process default is what is tested

    monkeypatch.setattr(_manager, "builtin_backends", machine)
    monkeypatch.setattr(_hardware, "probe", lambda: NVIDIA)  # a GPU this PyTorch cannot use
    monkeypatch.setattr(Build, "of_torch", lambda: CPU_ONLY)
    _manager._process_default.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="devicekit uses the CPU") as record:
            dk.to_device(torch.ones(1))  # the default manager is made, deep inside
        assert record[0].filename == __file__
    finally:
        _manager._process_default.cache_clear()


# Explicit devices and bad specs.


def test_explicit_devices_and_indices() -> None:
    backends = machine(10, 20, 30, 40)
    assert dk.DeviceManager("cuda:3", backends=backends).device == cuda(3)
    assert dk.DeviceManager(torch.device("cuda", 2), backends=backends).device == cuda(2)
    assert dk.DeviceManager(1, backends=backends).device == cuda(1)
    assert dk.DeviceManager("cuda", backends=backends).device == cuda(0)
    assert dk.DeviceManager("cpu", backends=backends).device == CPU
    assert dk.DeviceManager("meta", backends=backends).device == META


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "gpu",
            f"{EXPECTED_A_DEVICE}, got 'gpu'.",
        ),
        (
            "cuda:7",
            (
                "Expected one of 'cuda:0', 'cpu' (the devices here), got 'cuda:7': this "
                "process sees 1 cuda device (cuda:0)."
            ),
        ),
        (
            "cuda:-1",
            f"{EXPECTED_A_DEVICE}, got 'cuda:-1'.",
        ),
        (
            "cuda:abc",
            f"{EXPECTED_A_DEVICE}, got 'cuda:abc'.",
        ),
        (3, "Expected the index of an accelerator device, got 3; devices here: cuda:0, cpu."),
    ],
)
def test_bad_device_specs_are_refused_with_the_choices(spec: object, message: str) -> None:
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(message)):
        dk.DeviceManager(spec, backends=machine(70))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"min_free_memory": "lots"},
            (
                "Expected min_free_memory as a number of bytes or a size such as '8GiB', "
                "'500MB' or '1.5 GB', got 'lots'."
            ),
        ),
        ({"min_free_memory": -1}, "got -1."),
        (
            {"prefer": ("cuda", "tpu")},
            (
                "Expected prefer to list device families among ['cpu', 'cuda', 'mps', 'rocm', "
                "'xpu'], in order of preference, got ('cuda', 'tpu')."
            ),
        ),
        ({"prefer": "cuda"}, "got 'cuda'."),
        (
            {"policy": "fastest"},
            (
                "Expected policy to be one of ('auto', 'most-free-memory', 'local-rank'), "
                "got 'fastest'."
            ),
        ),
        ({"fallback": "gpu"}, "Expected fallback to be one of ('cpu', 'error'), got 'gpu'."),
    ],
)
def test_bad_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        dk.DeviceManager(backends=machine(70), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"min_free_memory": "9" * 400 + "GiB"},
            ValueError,
            "Expected min_free_memory as a size a device can have, got '99999",
        ),
        ({"prefer": []}, ValueError, "Expected prefer to list device families among"),
        (
            {"backends": [object()]},
            TypeError,
            (
                "Expected backends with a name, a device_type and devices() (the "
                "devicekit.Backend protocol), got object <object object at"
            ),
        ),
    ],
)
def test_manager_options_are_checked_where_they_are_given(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        dk.DeviceManager(**options)  # type: ignore[arg-type]


# torchrun and the environment.


def test_local_rank_selects_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    manager = dk.DeviceManager.from_env(backends=machine(70, 70, 70, 70))
    assert manager.device == cuda(2)
    assert manager.reason == "LOCAL_RANK=2 (torchrun) selects it"
    # "auto" follows LOCAL_RANK too, without from_env.
    assert dk.DeviceManager(backends=machine(70, 70, 70, 70)).device == cuda(2)


def test_local_rank_with_one_visible_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the launcher gave each rank its own
    manager = dk.DeviceManager.from_env(backends=machine(70))
    assert manager.device == cuda(0)
    assert manager.reason == "LOCAL_RANK=3, and this process sees one cuda device"


def test_more_ranks_than_gpus_is_refused_before_nccl_finds_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun --nproc_per_node=2 on a machine with one GPU: both ranks would use cuda:0.
    monkeypatch.setenv("LOCAL_RANK", "1")
    msg = (
        "Expected LOCAL_RANK to be below the number of cuda devices this process sees (1), "
        "got 1: ranks would share a device, which NCCL refuses ('Duplicate GPU detected'). "
        "Start at most 1 process per node (torchrun --nproc_per_node=1), or give each "
        "process its own CUDA_VISIBLE_DEVICES."
    )
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.DeviceManager.from_env(backends=machine(70))
    # Rank 0 of the same launch is told too, from LOCAL_WORLD_SIZE, so no rank waits on NCCL.
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    msg = (
        "Expected at most 1 process on this node, one per cuda device, but "
        "LOCAL_WORLD_SIZE=2: ranks would share a device, which NCCL refuses ('Duplicate GPU "
        "detected'). Start 1 per node (torchrun --nproc_per_node=1), or give each process its "
        "own CUDA_VISIBLE_DEVICES."
    )
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.DeviceManager.from_env(backends=machine(70))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert dk.DeviceManager.from_env(backends=machine(70)).device == cuda(0)


def test_local_rank_policy_needs_a_launcher_s_local_rank() -> None:
    msg = (
        "Expected a launcher's local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, "
        "MV2_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, PALS_LOCAL_RANKID, SLURM_LOCALID) for "
        "policy='local-rank', but none is set."
    )
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.DeviceManager(policy="local-rank", backends=machine(70))


@pytest.mark.parametrize(
    ("variable", "launcher"),
    [
        ("SLURM_LOCALID", "Slurm"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
        ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH2"),
        ("MPI_LOCALRANKID", "MPICH or Intel MPI"),
        ("PALS_LOCAL_RANKID", "Cray PALS"),
    ],
)
def test_every_launcher_s_local_rank_selects_its_gpu(
    monkeypatch: pytest.MonkeyPatch, variable: str, launcher: str
) -> None:
    # Under srun or mpirun every rank used to take cuda:0.
    monkeypatch.setenv(variable, "2")
    manager = dk.DeviceManager.from_env(backends=machine(70, 70, 70, 70))
    assert manager.device == cuda(2)
    assert manager.reason == f"{variable}=2 ({launcher}) selects it"
    assert f"{variable}=2 ({launcher}) selects it" in manager.explain()
    assert dk.DeviceManager(policy="local-rank", backends=machine(70, 70, 70, 70)).device == cuda(2)


def test_torchrun_s_rank_is_read_first_inside_a_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun started by srun: SLURM_LOCALID is the node's one task, LOCAL_RANK the rank.
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dk.DeviceManager.from_env(backends=machine(70, 70)).device == cuda(1)


@pytest.mark.parametrize(
    ("variable", "launcher"),
    [
        ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
        ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH2"),
        ("MPI_LOCALRANKID", "MPICH or Intel MPI"),
    ],
)
def test_mpirun_inside_a_slurm_job_follows_the_mpi_rank(
    monkeypatch: pytest.MonkeyPatch, variable: str, launcher: str
) -> None:
    # Every rank mpirun starts inherits the batch step's SLURM_LOCALID=0: all on cuda:0.
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    monkeypatch.setenv(variable, "1")
    manager = dk.DeviceManager.from_env(backends=machine(70, 70))
    assert manager.device == cuda(1)
    assert manager.reason == f"{variable}=1 ({launcher} inside Slurm) selects it"
    assert manager.explain().startswith(
        f"Selected cuda:1 (Fake GPU): {variable}=1 ({launcher} inside Slurm) selects it."
    )


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SLURM_GPUS_PER_TASK", "2"), ("SLURM_TRES_BIND", "gres/gpu:per_task:2")],
)
def test_a_task_given_gpus_of_its_own_uses_its_first(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    # srun --ntasks-per-node=4 --gpus-per-task=2: the third task sees GPUs 4 and 5 as
    # cuda:0 and cuda:1, and SLURM_LOCALID=2; Slurm says it bound GPUs to each task
    # (SLURM_GPUS_PER_TASK up to 23.02, SLURM_TRES_BIND from 23.11).
    monkeypatch.setenv("SLURM_LOCALID", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv(variable, value)
    backends = machine(70, 70)
    manager = dk.DeviceManager.from_env(backends=backends)
    assert manager.device == cuda(0)
    assert manager.reason == (
        "SLURM_LOCALID=2 (Slurm), and Slurm bound each task to cuda devices of its own "
        f"({variable}={value}): the first of this process's 2"
    )
    assert backends[0].made_current == [cuda(0)]  # type: ignore[attr-defined]


def test_tasks_given_the_same_gpus_by_slurm_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # srun --ntasks-per-node=4 --gres=gpu:2: every task sees CUDA_VISIBLE_DEVICES=0,1.
    monkeypatch.setenv("SLURM_LOCALID", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    msg = (
        "Expected SLURM_LOCALID to be below the number of cuda devices this process sees (2), "
        "got 2: ranks would share a device, which NCCL refuses ('Duplicate GPU detected'). "
        "Start at most 2 processes per node (srun --ntasks-per-node=2), or bind each task to "
        "GPUs of its own (srun --gpus-per-task=1, with no other --gpu-bind)."
    )  # not "give each its own CUDA_VISIBLE_DEVICES": srun set one for each, the same
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.DeviceManager.from_env(backends=machine(70, 70))
    monkeypatch.setenv("SLURM_LOCALID", "0")  # the first task is told too
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape("SLURM_NTASKS_PER_NODE=4")):
        dk.DeviceManager.from_env(backends=machine(70, 70))


def test_torchrun_ranks_past_the_visible_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node=4: ranks 0, 2 and 3 took cuda:0.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "2")  # inside srun --gpus-per-task: the same
    msg = (
        "Expected at most 2 processes on this node, one per cuda device, but "
        "LOCAL_WORLD_SIZE=4: ranks would share a device, which NCCL refuses ('Duplicate GPU "
        "detected'). Start 2 per node (torchrun --nproc_per_node=2), or give each process its "
        "own CUDA_VISIBLE_DEVICES."
    )
    for local in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
            dk.DeviceManager.from_env(backends=machine(70, 70))


def test_a_device_named_wins_over_a_malformed_launcher_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "x")
    assert dk.DeviceManager("cpu", backends=machine(70, 70)).device == CPU
    assert dk.DeviceManager(1, backends=machine(70, 70)).device == cuda(1)
    assert dk.DeviceManager.from_env(device="cpu", backends=machine(70, 70)).device == CPU
    most_free = dk.DeviceManager(policy="most-free-memory", backends=machine(60, 70))
    assert most_free.device == cuda(1)  # a policy that reads no rank
    monkeypatch.setenv("DEVICEKIT_DEVICE", "cpu")
    for manager in (
        dk.DeviceManager(backends=machine(70, 70)),
        dk.DeviceManager.from_env(backends=machine(70, 70)),
        dk.DeviceManager(policy="local-rank", backends=machine(70, 70)),
    ):
        assert (manager.device, manager.reason) == (CPU, "DEVICEKIT_DEVICE asks for it")
    # Where the rank is what decides, its error stays.
    monkeypatch.delenv("DEVICEKIT_DEVICE")
    msg = "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, got 'x'."
    for policy in ("auto", "local-rank"):
        with pytest.raises(ValueError, match=re.escape(msg)):
            dk.DeviceManager(policy=policy, backends=machine(70, 70))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(msg)):
        dk.DeviceManager.from_env(backends=machine(70, 70))


def test_a_launcher_s_bad_rank_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "first")
    msg = (
        "Expected OMPI_COMM_WORLD_LOCAL_RANK (set by Open MPI) to be a whole number of 0 or "
        "more, got 'first'."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        dk.DeviceManager.from_env(backends=machine(70, 70))
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape("OMPI_COMM_WORLD_LOCAL_SIZE=3")):
        dk.DeviceManager.from_env(backends=machine(70, 70))


def test_devicekit_device_is_one_rule_for_every_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The constructor, from_env() and current_device() agree, so that a script using
    # both a manager and to_device(x) never splits itself across two devices.
    monkeypatch.setenv("DEVICEKIT_DEVICE", "meta")
    _manager._process_default.cache_clear()
    try:
        assert dk.DeviceManager().device == META
        assert dk.DeviceManager.from_env().device == META
        assert dk.current_device() == META
        assert dk.DeviceManager().reason == "DEVICEKIT_DEVICE asks for it"
    finally:
        _manager._process_default.cache_clear()
    # A device passed to the constructor is used as given.
    assert dk.DeviceManager("cpu").device == CPU


def test_choosing_the_cpu_through_the_environment_is_no_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEVICEKIT_DEVICE", "cpu")
    manager = dk.DeviceManager(backends=machine(note="this PyTorch build has no CUDA support"))
    # No warning (filterwarnings turns one into an error), and the reason says why.
    assert (manager.device, manager.reason) == (CPU, "DEVICEKIT_DEVICE asks for it")


def test_a_backend_listing_something_else_than_device_infos_is_named() -> None:
    class Broken:
        name = "mybackend"
        device_type = "cuda"

        def devices(self) -> list[object]:
            return [None]

    msg = (
        "Expected the 'mybackend' backend's devices() to list devicekit.DeviceInfo objects, "
        "got NoneType None at position 0."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.DeviceManager(backends=[Broken()])


def test_devicekit_device_wins_over_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("DEVICEKIT_DEVICE", "cuda:1")
    manager = dk.DeviceManager.from_env(backends=machine(70, 70))
    assert manager.device == cuda(1)
    assert manager.reason == "DEVICEKIT_DEVICE asks for it"
    monkeypatch.setenv("DEVICEKIT_DEVICE", "1")
    assert dk.DeviceManager.from_env(backends=machine(70, 70)).device == cuda(1)


def test_from_env_takes_a_device_that_the_variable_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert dk.DeviceManager.from_env(device="cpu", backends=machine(70)).device == torch.device(
        "cpu"
    )
    monkeypatch.setenv("DEVICEKIT_DEVICE", "meta")
    manager = dk.DeviceManager.from_env(device="cpu", backends=machine(70))
    assert manager.device == META
    assert manager.reason == "DEVICEKIT_DEVICE asks for it"


@pytest.mark.parametrize(
    ("variable", "value", "error", "message"),
    [
        (
            "LOCAL_RANK",
            "5",
            dk.DeviceUnavailableError,
            (
                "Expected LOCAL_RANK to be below the number of cuda devices this process sees "
                "(4), got 5: ranks would share a device, which NCCL refuses ('Duplicate GPU "
                "detected'). Start at most 4 processes per node (torchrun --nproc_per_node=4), "
                "or give each process its own CUDA_VISIBLE_DEVICES."
            ),
        ),
        (
            "LOCAL_RANK",
            "-3",
            ValueError,
            "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, got '-3'.",
        ),
        (
            "DEVICEKIT_DEVICE",
            "nonsense",
            dk.DeviceUnavailableError,
            f"DEVICEKIT_DEVICE='nonsense' cannot be used: {EXPECTED_A_DEVICE}, got 'nonsense'.",
        ),
        (
            "DEVICEKIT_DEVICE",
            "²",
            dk.DeviceUnavailableError,
            "DEVICEKIT_DEVICE='²' cannot be used: Expected a device such as",
        ),
        (
            "LOCAL_RANK",
            "9" * 5000,
            ValueError,
            (
                "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, got "
                "'999999999999999999999999999999999999999999999999999999999... (5,000 characters)."
            ),
        ),
        (
            "LOCAL_RANK",
            "٣",  # an Arabic-Indic three: a digit to str.isdigit, not to a launcher
            ValueError,
            "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, got '٣'.",
        ),
    ],
)
def test_a_bad_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    error: type[Exception],
    message: str,
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(error, match=re.escape(message)):
        dk.DeviceManager.from_env(backends=machine(70, 70, 70, 70))


# explain().


def test_explain_says_what_was_chosen_why_and_what_was_seen() -> None:
    no_xpu = FakeGpus([], name="xpu", device_type="xpu", note="no XPU here")
    manager = dk.DeviceManager(backends=[FakeGpus([10, 70, None]), no_xpu])
    assert manager.explain() == (
        "Selected cuda:0 (Fake GPU): the first cuda device; free memory is unknown.\n"
        "Default: devicekit calls given no device use cuda:0 until close(), outside other "
        "managers' `with` blocks.\n"
        "Devices seen:\n"
        "  cuda:0   Fake GPU, 10.0 GiB free of 80.0 GiB, compute capability 9.0\n"
        "  cuda:1   Fake GPU, 70.0 GiB free of 80.0 GiB, compute capability 9.0\n"
        "  cuda:2   Fake GPU, 80.0 GiB, free memory unknown, compute capability 9.0\n"
        "  no xpu: no XPU here"
    )


def test_devices_lists_every_family() -> None:
    manager = dk.DeviceManager(backends=machine(10, 70))
    assert [str(info.device) for info in manager.devices] == ["cuda:0", "cuda:1", "cpu"]
    assert manager.devices[0] == dk.DeviceInfo(
        cuda(0), "cuda", 0, "Fake GPU", 80 * 2**30, 10 * 2**30, (9, 0), "GPU-0000"
    )


# The default device: `with manager:` blocks, per thread and per task.


def test_with_blocks_nest_and_restore() -> None:
    outer = dk.DeviceManager("meta")
    inner = dk.DeviceManager("cpu")
    with outer:
        assert dk.current_device() == META
        with inner:
            assert dk.current_device() == CPU
            with outer:
                assert dk.current_device() == META
            assert dk.current_device() == CPU
        assert dk.current_device() == META


def test_a_manager_leaving_out_of_order_takes_only_its_own_device_away() -> None:
    outer, inner = dk.DeviceManager("cpu"), dk.DeviceManager("meta")
    with dk.DeviceManager("meta"):
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)  # out of order: the inner block is still open
        assert dk.current_device() == META  # inner's, not outer's
        inner.__exit__(None, None, None)
        outer.__exit__(None, None, None)  # left already: nothing more to take away
        assert dk.current_device() == META


def test_threads_see_only_their_own_devices() -> None:
    managers = [dk.DeviceManager(f"cuda:{i}", backends=machine(*[70] * 8)) for i in range(8)]
    other = dk.DeviceManager("meta")
    failures: list[str] = []
    start = threading.Barrier(8)

    def switch(index: int) -> None:
        mine = managers[index].device
        start.wait()
        for step in range(1000):
            with managers[index]:
                with other:
                    if dk.current_device() != other.device:
                        failures.append(f"thread {index} step {step}: inner")
                if dk.current_device() != mine:
                    failures.append(f"thread {index} step {step}: saw {dk.current_device()}")

    threads = [threading.Thread(target=switch, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_asyncio_tasks_see_only_their_own_devices() -> None:
    async def run(manager: dk.DeviceManager) -> list[torch.device]:
        seen = []
        with manager:
            for _ in range(20):
                await asyncio.sleep(0)
                seen.append(dk.current_device())
        return seen

    async def main() -> list[list[torch.device]]:
        return await asyncio.gather(run(dk.DeviceManager("meta")), run(dk.DeviceManager("cpu")))

    meta_seen, cpu_seen = asyncio.run(main())
    assert set(meta_seen) == {META}
    assert set(cpu_seen) == {CPU}


def test_parse_bytes_units() -> None:
    assert _units.parse_bytes("500MB", "memory") == 500 * 10**6
    assert _units.parse_bytes("2 kib", "memory") == 2048
    assert _units.parse_bytes("3", "memory") == 3


@pytest.mark.usefixtures("watchdog")
def test_parse_bytes_fails_at_once_on_a_long_run_of_spaces() -> None:
    # Backtracking, 200,000 spaces take minutes: the watchdog fails the test instead.
    with pytest.raises(ValueError, match="Expected min_free_memory"):
        _units.parse_bytes("1" + " " * 200_000 + "!", "min_free_memory")
    assert _units.parse_bytes(" 8 GiB ", "min_free_memory") == 8 * 2**30


def test_the_default_choice_is_the_first_gpu_within_5_percent_of_the_most_free_memory() -> None:
    # As the docstring, the selection guide and the README say: equal GPUs whose free
    # memory differs by a little give the first, and "most-free-memory" is exact.
    assert "within 5% of the most free" in " ".join((dk.DeviceManager.__doc__ or "").split())
    assert dk.DeviceManager(backends=machine(76.0, 79.0)).device == cuda(0)  # 76 >= 0.95 * 79
    assert dk.DeviceManager(backends=machine(74.0, 79.0)).device == cuda(1)  # 74 < 75.05
    exact = dk.DeviceManager(policy="most-free-memory", backends=machine(76.0, 79.0))
    assert exact.device == cuda(1)
