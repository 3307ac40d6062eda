"""The choice of a device, as a table of cases: what was seen, what was asked, what comes out.

:func:`devicekit._select._selection.choose` is pure (no environment, no sleeping, no warning),
so each rule of the manager's choice is a row here; tests/test_manager.py and
tests/test_shared_server.py cover what the manager does around it (looking, waiting,
claiming, warning, making a rank's device current).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from devicekit._select._backends import DeviceInfo, Family
from devicekit._select._claims import Holder
from devicekit._select._launch import LAUNCHERS, BadRank, LocalRank, local_rank, slurm_gpus_per_task
from devicekit._select._selection import (
    Chosen,
    RankProblem,
    Refused,
    Request,
    Seen,
    Wait,
    choose,
)

from .helpers import CPU, GiB, cuda


def gpu(index: int, free: float | None = 79.0, busy: float | None = 0.0) -> DeviceInfo:
    return DeviceInfo(
        cuda(index),
        "cuda",
        index,
        "H100",
        80 * GiB,
        None if free is None else int(free * GiB),
        (9, 0),
        f"GPU-{index}",
        busy,
    )


TORCHRUN, OPEN_MPI, MVAPICH2, MPICH, PALS, SLURM = LAUNCHERS


def rank(number: int, size: int | None = None, launcher: Any = TORCHRUN, *outer: Any) -> LocalRank:
    return LocalRank(number, launcher, size, outer)


def launched(environ: dict[str, str]) -> LocalRank:
    """The local rank :func:`devicekit._select._launch.local_rank` reads in ``environ``."""
    found = local_rank(environ)
    assert isinstance(found, LocalRank)
    return found


# The other fix of ranks that would share GPUs: srun's tasks have a CUDA_VISIBLE_DEVICES
# each already (the same, unless srun binds GPUs to each); other processes get theirs set.
OWN_VARIABLE = "give each process its own CUDA_VISIBLE_DEVICES"
BIND_TASKS = "bind each task to GPUs of its own (srun --gpus-per-task=1, with no other --gpu-bind)"


def sharing(variable: str, value: int, devices: int, launcher: Any = TORCHRUN) -> RankProblem:
    """What a refusal of ranks that would share a device says of itself, for the doctor."""
    apart = BIND_TASKS if launcher == SLURM else OWN_VARIABLE
    return RankProblem(
        "more-ranks-than-devices", variable, str(value), launcher, "cuda", devices, apart
    )


def machine(*gpus: DeviceInfo, **seen: Any) -> Seen:
    return Seen((Family("cuda", "cuda", gpus, None if gpus else "no CUDA here"),), **seen)


TWO = machine(gpu(0), gpu(1))
BUSY_FIRST = machine(gpu(0, busy=0.9), gpu(1))
CUDA = frozenset({"cuda"})  # a visibility variable set: the launcher gave devices

# srun --ntasks-per-node=4 on a node's GPUs: the third task, which sees two of them.
SLURM_TASK_2 = {"SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4"}
PER_TASK = {**SLURM_TASK_2, "SLURM_GPUS_PER_TASK": "2"}  # with --gpus-per-task=2 (<= 23.02)
PER_TASK_THIRD = launched(PER_TASK)
MV2_TASK_2 = {"MV2_COMM_WORLD_LOCAL_RANK": "2", "MV2_COMM_WORLD_LOCAL_SIZE": "4"}

OWN = Holder(ours=True)
OURS = "this process (another of its managers)"
ONE_OURS = machine(gpu(0), claimed={cuda(0): OWN})
OWN_CLAIM = (
    "no cuda, xpu or mps device is usable: cuda:0 is claimed by this process (another of its "
    "managers): close() it, leave its with block, or name the device to share it"
)

CASES: list[tuple[str, Seen, Request, Any]] = [
    (
        "idle: the lowest index",
        TWO,
        Request(),
        Chosen(cuda(0), "it has the most free memory (79.0 GiB of 80.0 GiB)"),
    ),
    (
        "about as free: still the lowest",
        machine(gpu(0, free=78.0), gpu(1, free=79.0)),
        Request(),
        Chosen(cuda(0), "the first with about the most free memory (78.0 GiB of 80.0 GiB)"),
    ),
    (
        "most-free-memory: strictly",
        machine(gpu(0, free=78.0), gpu(1, free=79.0)),
        Request(policy="most-free-memory"),
        Chosen(cuda(1), "it has the most free memory (79.0 GiB of 80.0 GiB)"),
    ),
    (
        "free memory unknown",
        machine(gpu(0, free=None), gpu(1)),
        Request(),
        Chosen(cuda(0), "the first cuda device; free memory is unknown"),
    ),
    (
        "a busy GPU passed over",
        BUSY_FIRST,
        Request(max_busy=0.5),
        Chosen(
            cuda(1),
            "the only usable cuda device (79.0 GiB of 80.0 GiB free)",
            ("cuda:0: 90% busy, more than the 50% max_utilization allows",),
        ),
    ),
    (
        "too little memory passed over",
        machine(gpu(0, free=5.0), gpu(1)),
        Request(min_free=40 * GiB),
        Chosen(
            cuda(1),
            "the only usable cuda device (79.0 GiB of 80.0 GiB free)",
            ("cuda:0: 5.0 GiB free of 80.0 GiB, less than the 40.0 GiB min_free_memory asks",),
        ),
    ),
    (
        "claimed by another job",
        machine(gpu(0), gpu(1), claimed={cuda(0): 4242}),
        Request(),
        Chosen(
            cuda(1),
            "the only usable cuda device (79.0 GiB of 80.0 GiB free)",
            ("cuda:0: claimed by pid 4242",),
        ),
    ),
    (
        "nothing usable: the CPU, warned of",
        machine(gpu(0, busy=0.9)),
        Request(max_busy=0.5),
        Chosen(
            CPU,
            "no cuda, xpu or mps device is usable, so the CPU is the fallback",
            ("cuda:0: 90% busy, more than the 50% max_utilization allows",),
            fell_back="no cuda, xpu or mps device is usable",
        ),
    ),
    (
        "nothing usable, fallback=error",
        machine(gpu(0, busy=0.9)),
        Request(max_busy=0.5, fallback="error"),
        Refused(
            "Expected a usable cuda, xpu or mps device, but no cuda, xpu or mps device is "
            "usable. Passed over cuda:0: 90% busy, more than the 50% max_utilization allows. "
            "Devices here: cuda:0."
        ),
    ),
    (
        "nothing usable, waiting: wait",
        machine(gpu(0, busy=0.9)),
        Request(max_busy=0.5, waiting=True),
        Wait(
            "no cuda, xpu or mps device is usable",
            ("Passed over cuda:0: 90% busy, more than the 50% max_utilization allows.",),
        ),
    ),
    (
        "no GPU at all, waiting: nothing to wait for",
        machine(),
        Request(waiting=True),
        Chosen(
            CPU,
            "no cuda, xpu or mps device is usable (none is visible, so wait= has nothing to "
            "wait for), so the CPU is the fallback",
            fell_back="no cuda, xpu or mps device is usable (none is visible, so wait= has "
            "nothing to wait for)",
        ),
    ),
    (
        "waited out",
        machine(gpu(0, busy=0.9)),
        Request(max_busy=0.5, waited=600.0),
        Chosen(
            CPU,
            "no cuda, xpu or mps device is usable after waiting 10 min, so the CPU is the fallback",
            ("cuda:0: 90% busy, more than the 50% max_utilization allows",),
            fell_back="no cuda, xpu or mps device is usable after waiting 10 min",
        ),
    ),
    (
        "prefer the CPU first",
        TWO,
        Request(prefer=("cpu",)),
        Chosen(CPU, "prefer puts the CPU first"),
    ),
    ("an explicit device", TWO, Request(device="cuda:1"), Chosen(cuda(1), "asked for cuda:1")),
    (
        "'cuda' is the current CUDA device",
        machine(gpu(0), gpu(1), cuda_index=1),
        Request(device="cuda"),
        Chosen(cuda(1), "asked for cuda"),
    ),
    (
        "an explicit device this machine lacks",
        TWO,
        Request(device="cuda:7"),
        Refused(
            "Expected one of 'cuda:0', 'cuda:1' (the devices here), got 'cuda:7': this "
            "process sees 2 cuda devices (cuda:0, cuda:1)."
        ),
    ),
    ("an index", TWO, Request(device=1), Chosen(cuda(1), "asked for index 1 of cuda")),
    (
        "an index too far",
        TWO,
        Request(device=5),
        Refused(
            "Expected the index of an accelerator device, got 5; devices here: cuda:0, cuda:1."
        ),
    ),
    (
        "an explicit device another job claims",
        machine(gpu(0), gpu(1), claimed={cuda(1): 7}),
        Request(device="cuda:1"),
        Refused("Cannot claim cuda:1, asked for as 'cuda:1': pid 7 claims it."),
    ),
    (
        "an explicit device another job claims, waiting",
        machine(gpu(0), gpu(1), claimed={cuda(1): 7}),
        Request(device="cuda:1", waiting=True),
        Wait("Cannot claim cuda:1, asked for as 'cuda:1': pid 7 claims it"),
    ),
    (
        "a device type PyTorch has a backend for, unlisted",
        machine(gpu(0), loaded=lambda device_type: device_type == "xla"),
        Request(device="xla:0"),
        Chosen(torch.device("xla", 0), "asked for xla:0, a device type devicekit cannot check"),
    ),
    (
        "DEVICEKIT_DEVICE",
        machine(gpu(0), gpu(1), devicekit_device="cuda:1"),
        Request(),
        Chosen(cuda(1), "DEVICEKIT_DEVICE asks for it"),
    ),
    (
        "DEVICEKIT_DEVICE an index",
        machine(gpu(0), gpu(1), devicekit_device="1"),
        Request(),
        Chosen(cuda(1), "DEVICEKIT_DEVICE asks for it"),
    ),
    (
        "DEVICEKIT_DEVICE this machine lacks",
        machine(gpu(0), devicekit_device="cuda:3"),
        Request(),
        Refused(
            "DEVICEKIT_DEVICE='cuda:3' cannot be used: Expected one of 'cuda:0' (the devices "
            "here), got 'cuda:3': this process sees 1 cuda device (cuda:0)."
        ),
    ),
    (
        "LOCAL_RANK picks its GPU, made current",
        machine(gpu(0), gpu(1), local_rank=rank(1)),
        Request(),
        Chosen(cuda(1), "LOCAL_RANK=1 (torchrun) selects it", current=True),
    ),
    (
        "LOCAL_RANK with one GPU given to the process",
        machine(gpu(0), local_rank=rank(3), split=frozenset({"cuda"})),
        Request(),
        Chosen(cuda(0), "LOCAL_RANK=3, and this process sees one cuda device", current=True),
    ),
    (
        "more ranks than GPUs",
        machine(gpu(0), gpu(1), local_rank=rank(0, 4)),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "LOCAL_WORLD_SIZE=4: ranks would share a device, which NCCL refuses ('Duplicate "
            "GPU detected'). Start 2 per node (torchrun --nproc_per_node=2), or give each "
            "process its own CUDA_VISIBLE_DEVICES.",
            sharing("LOCAL_WORLD_SIZE", 4, 2),
        ),
    ),
    (
        "a rank beyond the GPUs",
        machine(gpu(0), gpu(1), local_rank=rank(2)),
        Request(),
        Refused(
            "Expected LOCAL_RANK to be below the number of cuda devices this process sees "
            "(2), got 2: ranks would share a device, which NCCL refuses ('Duplicate GPU "
            "detected'). Start at most 2 processes per node (torchrun --nproc_per_node=2), or "
            "give each process its own CUDA_VISIBLE_DEVICES.",
            sharing("LOCAL_RANK", 2, 2),
        ),
    ),
    (
        "a rank's GPU that another job keeps busy",
        machine(gpu(0), gpu(1, busy=0.9), local_rank=rank(1)),
        Request(max_busy=0.5),
        Refused(
            "LOCAL_RANK=1 selects cuda:1, but cuda:1: 90% busy, more than the 50% "
            "max_utilization allows."
        ),
    ),
    (
        "policy local-rank without LOCAL_RANK",
        TWO,
        Request(policy="local-rank"),
        Refused(
            "Expected a launcher's local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, "
            "MV2_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, PALS_LOCAL_RANKID, SLURM_LOCALID) for "
            "policy='local-rank', but none is set."
        ),
    ),
    (
        "Slurm's SLURM_LOCALID picks its GPU",
        machine(gpu(0), gpu(1), local_rank=rank(1, 2, SLURM)),
        Request(),
        Chosen(cuda(1), "SLURM_LOCALID=1 (Slurm) selects it", current=True),
    ),
    (
        "Open MPI's local rank picks its GPU",
        machine(gpu(0), gpu(1), gpu(2), local_rank=rank(2, None, OPEN_MPI)),
        Request(),
        Chosen(cuda(2), "OMPI_COMM_WORLD_LOCAL_RANK=2 (Open MPI) selects it", current=True),
    ),
    (
        "MPICH's local rank with one GPU given to the process",
        machine(gpu(0), local_rank=rank(5, 8, MPICH), split=frozenset({"cuda"})),
        Request(),
        Chosen(
            cuda(0),
            "MPI_LOCALRANKID=5, and this process sees one cuda device",
            current=True,
        ),
    ),
    (
        "more Cray PALS ranks than GPUs, named by its own variables",
        machine(gpu(0), gpu(1), local_rank=rank(0, 4, PALS)),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "PALS_LOCAL_SIZE=4: ranks would share a device, which NCCL refuses ('Duplicate "
            "GPU detected'). Start 2 per node (mpiexec --ppn 2), or give each "
            "process its own CUDA_VISIBLE_DEVICES.",
            sharing("PALS_LOCAL_SIZE", 4, 2, PALS),
        ),
    ),
    (
        "a Slurm rank beyond the GPUs",
        machine(gpu(0), local_rank=rank(1, None, SLURM)),
        Request(),
        Refused(
            "Expected SLURM_LOCALID to be below the number of cuda devices this process sees "
            "(1), got 1: ranks would share a device, which NCCL refuses ('Duplicate GPU "
            "detected'). Start at most 1 process per node (srun --ntasks-per-node=1), or "
            f"{BIND_TASKS}.",
            sharing("SLURM_LOCALID", 1, 1, SLURM),
        ),
    ),
    (
        "mpirun inside a Slurm job: Open MPI's rank, the launcher named",
        machine(gpu(0), gpu(1), local_rank=rank(1, 2, OPEN_MPI, SLURM)),
        Request(),
        Chosen(
            cuda(1), "OMPI_COMM_WORLD_LOCAL_RANK=1 (Open MPI inside Slurm) selects it", current=True
        ),
    ),
    (
        "srun --gpus-per-task=2: a task's rank past its own GPUs takes its first",
        machine(gpu(0), gpu(1), local_rank=PER_TASK_THIRD, split=CUDA),
        Request(),
        Chosen(
            cuda(0),
            "SLURM_LOCALID=2 (Slurm), and Slurm bound each task to cuda devices of its own "
            "(SLURM_GPUS_PER_TASK=2): the first of this process's 2",
            current=True,
        ),
    ),
    (
        "srun --gpus-per-task=2 on Slurm 23.11 and later: SLURM_TRES_BIND says so",
        machine(
            gpu(0),
            gpu(1),
            local_rank=launched({**SLURM_TASK_2, "SLURM_TRES_BIND": "gres/gpu:per_task:2"}),
            split=CUDA,
        ),
        Request(),
        Chosen(
            cuda(0),
            "SLURM_LOCALID=2 (Slurm), and Slurm bound each task to cuda devices of its own "
            "(SLURM_TRES_BIND=gres/gpu:per_task:2): the first of this process's 2",
            current=True,
        ),
    ),
    (
        "per-task GPUs, a rank among them: its own first too",
        machine(
            gpu(0),
            gpu(1),
            local_rank=PER_TASK_THIRD._replace(rank=1),
            split=CUDA,
        ),
        Request(),
        Chosen(
            cuda(0),
            "SLURM_LOCALID=1 (Slurm), and Slurm bound each task to cuda devices of its own "
            "(SLURM_GPUS_PER_TASK=2): the first of this process's 2",
            current=True,
        ),
    ),
    (
        "srun --gpus-per-task=1, the variable unset: the one GPU it sees is the task's",
        machine(gpu(0), local_rank=launched({**SLURM_TASK_2, "SLURM_GPUS_PER_TASK": "1"})),
        Request(),
        Chosen(
            cuda(0),
            "SLURM_LOCALID=2 (Slurm), and Slurm bound each task to cuda devices of its own "
            "(SLURM_GPUS_PER_TASK=1): the one it sees",
            current=True,
        ),
    ),
    (
        "srun --gpus-per-task=2, the variable unset: which two are the task's is unknown",
        machine(gpu(0), gpu(1), local_rank=PER_TASK_THIRD),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "SLURM_NTASKS_PER_NODE=4: ranks would share a device, which NCCL refuses "
            "('Duplicate GPU detected'). Start 2 per node (srun --ntasks-per-node=2), or leave "
            "CUDA_VISIBLE_DEVICES as srun sets it for each task bound to its GPUs "
            "(SLURM_GPUS_PER_TASK=2).",
            sharing("SLURM_NTASKS_PER_NODE", 4, 2, SLURM)._replace(
                apart="leave CUDA_VISIBLE_DEVICES as srun sets it for each task bound to its "
                "GPUs (SLURM_GPUS_PER_TASK=2)"
            ),
        ),
    ),
    (
        "MVAPICH2's ranks that srun started, --gpus-per-task=2: the task's first",
        machine(gpu(0), gpu(1), local_rank=launched({**PER_TASK, **MV2_TASK_2}), split=CUDA),
        Request(),
        Chosen(
            cuda(0),
            "MV2_COMM_WORLD_LOCAL_RANK=2 (MVAPICH2 inside Slurm), and Slurm bound each task to "
            "cuda devices of its own (SLURM_GPUS_PER_TASK=2): the first of this process's 2",
            current=True,
        ),
    ),
    (
        "Open MPI's ranks that srun started, refused: srun's binding is the fix",
        machine(
            gpu(0),
            gpu(1),
            local_rank=launched(
                {
                    **SLURM_TASK_2,
                    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                }
            ),
            split=CUDA,
        ),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "OMPI_COMM_WORLD_LOCAL_SIZE=4: ranks would share a device, which NCCL refuses "
            "('Duplicate GPU detected'). Start 2 per node (mpirun --npernode 2), or "
            f"{BIND_TASKS}.",
            sharing("OMPI_COMM_WORLD_LOCAL_SIZE", 4, 2, OPEN_MPI)._replace(apart=BIND_TASKS),
        ),
    ),
    (
        "MVAPICH2's rank 2 of four, mpirun started in the batch script: its own GPU",
        machine(
            gpu(0),
            gpu(1),
            gpu(2),
            gpu(3),
            local_rank=launched({"SLURM_LOCALID": "0", "SLURM_GPUS_PER_TASK": "1", **MV2_TASK_2}),
            split=CUDA,
        ),
        Request(),
        Chosen(
            cuda(2), "MV2_COMM_WORLD_LOCAL_RANK=2 (MVAPICH2 inside Slurm) selects it", current=True
        ),
    ),
    (
        "a rank past the GPUs, which are the same for every process: refused",
        machine(gpu(0), gpu(1), local_rank=rank(2, 4, SLURM)),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "SLURM_NTASKS_PER_NODE=4: ranks would share a device, which NCCL refuses "
            "('Duplicate GPU detected'). Start 2 per node (srun --ntasks-per-node=2), or "
            f"{BIND_TASKS}.",
            sharing("SLURM_NTASKS_PER_NODE", 4, 2, SLURM),
        ),
    ),
    (
        "srun with plain --gres: one CUDA_VISIBLE_DEVICES=0,1 for every task, refused",
        machine(gpu(0), gpu(1), local_rank=launched(SLURM_TASK_2), split=CUDA),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "SLURM_NTASKS_PER_NODE=4: ranks would share a device, which NCCL refuses "
            "('Duplicate GPU detected'). Start 2 per node (srun --ntasks-per-node=2), or "
            f"{BIND_TASKS}.",
            sharing("SLURM_NTASKS_PER_NODE", 4, 2, SLURM),
        ),
    ),
    (
        "srun with plain --gres, no task count: the rank past the GPUs refused",
        machine(gpu(0), gpu(1), local_rank=rank(2, None, SLURM), split=CUDA),
        Request(),
        Refused(
            "Expected SLURM_LOCALID to be below the number of cuda devices this process sees "
            "(2), got 2: ranks would share a device, which NCCL refuses ('Duplicate GPU "
            "detected'). Start at most 2 processes per node (srun --ntasks-per-node=2), or "
            f"{BIND_TASKS}.",
            sharing("SLURM_LOCALID", 2, 2, SLURM),
        ),
    ),
    (
        "srun --gpus-per-task with --gpu-bind=none: tasks may share, refused",
        machine(
            gpu(0),
            gpu(1),
            local_rank=launched(
                {**SLURM_TASK_2, "SLURM_GPUS_PER_TASK": "2", "SLURM_TRES_BIND": "gres/gpu:none"}
            ),
            split=CUDA,
        ),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "SLURM_NTASKS_PER_NODE=4: ranks would share a device, which NCCL refuses "
            "('Duplicate GPU detected'). Start 2 per node (srun --ntasks-per-node=2), or "
            f"{BIND_TASKS}.",
            sharing("SLURM_NTASKS_PER_NODE", 4, 2, SLURM),
        ),
    ),
    (
        "torchrun --nproc_per_node=4 with CUDA_VISIBLE_DEVICES=0,1: rank 2 refused",
        machine(gpu(0), gpu(1), local_rank=rank(2, 4), split=CUDA),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "LOCAL_WORLD_SIZE=4: ranks would share a device, which NCCL refuses ('Duplicate "
            "GPU detected'). Start 2 per node (torchrun --nproc_per_node=2), or give each "
            "process its own CUDA_VISIBLE_DEVICES.",
            sharing("LOCAL_WORLD_SIZE", 4, 2),
        ),
    ),
    (
        "torchrun --nproc_per_node=4 with CUDA_VISIBLE_DEVICES=0,1: rank 0 refused too",
        machine(gpu(0), gpu(1), local_rank=rank(0, 4), split=CUDA),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "LOCAL_WORLD_SIZE=4: ranks would share a device, which NCCL refuses ('Duplicate "
            "GPU detected'). Start 2 per node (torchrun --nproc_per_node=2), or give each "
            "process its own CUDA_VISIBLE_DEVICES.",
            sharing("LOCAL_WORLD_SIZE", 4, 2),
        ),
    ),
    (
        "a torchrun rank past the visible GPUs, no LOCAL_WORLD_SIZE: refused",
        machine(gpu(0), gpu(1), local_rank=rank(2), split=CUDA),
        Request(),
        Refused(
            "Expected LOCAL_RANK to be below the number of cuda devices this process sees "
            "(2), got 2: ranks would share a device, which NCCL refuses ('Duplicate GPU "
            "detected'). Start at most 2 processes per node (torchrun --nproc_per_node=2), or "
            "give each process its own CUDA_VISIBLE_DEVICES.",
            sharing("LOCAL_RANK", 2, 2),
        ),
    ),
    (
        "torchrun inside a task Slurm gave GPUs of its own: its ranks share them, refused",
        machine(
            gpu(0),
            gpu(1),
            local_rank=launched({**PER_TASK, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}),
            split=CUDA,
        ),
        Request(),
        Refused(
            "Expected at most 2 processes on this node, one per cuda device, but "
            "LOCAL_WORLD_SIZE=4: ranks would share a device, which NCCL refuses ('Duplicate "
            "GPU detected'). Start 2 per node (torchrun --nproc_per_node=2), or give each "
            "process its own CUDA_VISIBLE_DEVICES.",
            sharing("LOCAL_WORLD_SIZE", 4, 2),
        ),
    ),
    (
        "mpirun inside a task Slurm gave GPUs of its own: a rank past them refused",
        machine(
            gpu(0),
            gpu(1),
            local_rank=launched({**PER_TASK, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}),
            split=CUDA,
        ),
        Request(),
        Refused(
            "Expected OMPI_COMM_WORLD_LOCAL_RANK to be below the number of cuda devices this "
            "process sees (2), got 2: ranks would share a device, which NCCL refuses "
            "('Duplicate GPU detected'). Start at most 2 processes per node (mpirun "
            "--npernode 2), or give each process its own CUDA_VISIBLE_DEVICES.",
            sharing("OMPI_COMM_WORLD_LOCAL_RANK", 2, 2, OPEN_MPI),
        ),
    ),
    (
        "one GPU per process given by the launcher: its own, as before",
        machine(gpu(0), local_rank=rank(2, 4), split=CUDA),
        Request(),
        Chosen(cuda(0), "LOCAL_RANK=2, and this process sees one cuda device", current=True),
    ),
    (
        "this process's own claim on the only GPU, waiting: no wait, the CPU at once",
        ONE_OURS,
        Request(waiting=True),
        Chosen(
            CPU,
            f"{OWN_CLAIM} (wait= does not wait for this process), so the CPU is the fallback",
            (f"cuda:0: claimed by {OURS}",),
            fell_back=f"{OWN_CLAIM} (wait= does not wait for this process)",
        ),
    ),
    (
        "this process's own claim on the only GPU, fallback=error: refused at once",
        ONE_OURS,
        Request(waiting=True, fallback="error"),
        Refused(
            f"Expected a usable cuda, xpu or mps device, but {OWN_CLAIM} (wait= does not "
            f"wait for this process). Passed over cuda:0: claimed by {OURS}. Devices here: "
            "cuda:0."
        ),
    ),
    (
        "this process's own claims on two GPUs, one also busy: no wait",
        machine(gpu(0), gpu(1, busy=0.9), claimed={cuda(0): OWN, cuda(1): OWN}),
        Request(max_busy=0.5, waiting=True),
        Chosen(
            CPU,
            "no cuda, xpu or mps device is usable: cuda:0 and cuda:1 are claimed by this "
            "process (another of its managers): close() it, leave its with block, or name "
            "the device to share it (wait= does not wait for this process), so the CPU is the "
            "fallback",
            (
                f"cuda:0: claimed by {OURS}",
                f"cuda:1: 90% busy, more than the 50% max_utilization allows; claimed by {OURS}",
            ),
            fell_back="no cuda, xpu or mps device is usable: cuda:0 and cuda:1 are claimed by "
            "this process (another of its managers): close() it, leave its with block, or "
            "name the device to share it (wait= does not wait for this process)",
        ),
    ),
    (
        "this process's claim and another job's: another job's may end, so wait",
        machine(gpu(0), gpu(1), claimed={cuda(0): OWN, cuda(1): 4242}),
        Request(waiting=True),
        Wait(
            "no cuda, xpu or mps device is usable",
            (f"Passed over cuda:0: claimed by {OURS}.", "Passed over cuda:1: claimed by pid 4242."),
        ),
    ),
    (
        "this process's claim, a GPU named: shared",
        ONE_OURS,
        Request(device="cuda:0", waiting=True),
        Chosen(cuda(0), "asked for cuda:0"),
    ),
    (
        "a local rank that is no number, where it is used",
        machine(gpu(0), gpu(1), local_rank=BadRank(TORCHRUN, "x")),
        Request(),
        Refused(
            "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, got 'x'.",
            RankProblem("local-rank-not-a-number", "LOCAL_RANK", "x", TORCHRUN),
        ),
    ),
    (
        "a local rank that is no number, without an accelerator",
        machine(local_rank=BadRank(SLURM, "")),
        Request(),
        Refused(
            "Expected SLURM_LOCALID (set by Slurm) to be a whole number of 0 or more, got ''.",
            RankProblem("local-rank-not-a-number", "SLURM_LOCALID", "", SLURM),
        ),
    ),
    (
        "a device named wins over a malformed local rank",
        machine(gpu(0), gpu(1), local_rank=BadRank(TORCHRUN, "x")),
        Request(device="cpu"),
        Chosen(CPU, "asked for cpu"),
    ),
    (
        "DEVICEKIT_DEVICE wins over a malformed local rank",
        machine(gpu(0), gpu(1), local_rank=BadRank(TORCHRUN, "x"), devicekit_device="cuda:1"),
        Request(),
        Chosen(cuda(1), "DEVICEKIT_DEVICE asks for it"),
    ),
    (
        "most-free-memory does not read a malformed local rank",
        machine(gpu(0, free=78.0), gpu(1), local_rank=BadRank(TORCHRUN, "x")),
        Request(policy="most-free-memory"),
        Chosen(cuda(1), "it has the most free memory (79.0 GiB of 80.0 GiB)"),
    ),
    (
        "LOCAL_RANK without an accelerator",
        machine(local_rank=rank(0)),
        Request(),
        Chosen(
            CPU,
            "LOCAL_RANK=0, but no accelerator was found, so the CPU is the fallback",
            fell_back="LOCAL_RANK=0, but no accelerator was found",
        ),
    ),
]


@pytest.mark.parametrize(
    ("seen", "request_", "outcome"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_the_choice(seen: Seen, request_: Request, outcome: Any) -> None:
    assert choose(seen, request_) == outcome


def test_the_choice_reads_nothing_but_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment is the manager's to read: here it changes nothing.
    monkeypatch.setenv("DEVICEKIT_DEVICE", "cuda:1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert choose(TWO, Request()) == CASES[0][3]
    assert TWO._replace(local_rank=rank(1)) != TWO  # the snapshot is what differs


@pytest.mark.parametrize(
    ("environ", "said", "started_by"),
    [
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "0"}, "LOCAL_RANK=1", "torchrun inside Slurm"),
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"},
            "OMPI_COMM_WORLD_LOCAL_RANK=1",
            "Open MPI inside Slurm",
        ),
        (
            {"MPI_LOCALRANKID": "1", "SLURM_LOCALID": "0"},
            "MPI_LOCALRANKID=1",
            "MPICH or Intel MPI inside Slurm",
        ),
        (
            {"MV2_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"},
            "MV2_COMM_WORLD_LOCAL_RANK=1",
            "MVAPICH2 inside Slurm",
        ),
        ({"PALS_LOCAL_RANKID": "3"}, "PALS_LOCAL_RANKID=3", "Cray PALS"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2", "Slurm"),
    ],
)
def test_the_innermost_launcher_s_rank_is_read(
    environ: dict[str, str], said: str, started_by: str
) -> None:
    # mpirun inside a Slurm allocation: every rank inherits the batch step's SLURM_LOCALID=0.
    found = local_rank(environ)
    assert isinstance(found, LocalRank)
    assert (found.said, found.started_by) == (said, started_by)


def test_an_outer_launcher_s_malformed_rank_is_not_read() -> None:
    found = local_rank({"LOCAL_RANK": "1", "SLURM_LOCALID": "x"})
    assert isinstance(found, LocalRank)
    assert found.said == "LOCAL_RANK=1"
    assert local_rank({"LOCAL_RANK": " ", "SLURM_LOCALID": "0"}) == BadRank(TORCHRUN, " ")


@pytest.mark.parametrize(
    ("environ", "said"),
    [
        ({"SLURM_GPUS_PER_TASK": "2"}, "SLURM_GPUS_PER_TASK=2"),  # srun/sbatch up to 23.02
        ({"SLURM_GPUS_PER_TASK": "a100:1,v100:1"}, "SLURM_GPUS_PER_TASK=a100:1,v100:1"),
        ({"SLURM_GPUS_PER_TASK": "0"}, ""),
        ({"SLURM_GPUS_PER_TASK": "two"}, ""),
        # 23.11 and later: --gpus-per-task implies, and --gpu-bind sets, SLURM_TRES_BIND.
        ({"SLURM_TRES_BIND": "gres/gpu:per_task:2"}, "SLURM_TRES_BIND=gres/gpu:per_task:2"),
        (
            {"SLURM_TRES_BIND": "gres/shard:per_task:1+gres/gpu:verbose,per_task:4"},
            "SLURM_TRES_BIND=gres/gpu:verbose,per_task:4",
        ),
        ({"SLURM_TRES_BIND": "gres/gpu:single:1"}, ""),
        ({"SLURM_TRES_BIND": "gres/gpu:closest", "SLURM_GPUS_PER_TASK": "2"}, ""),
        ({"SLURM_TRES_BIND": "gres/shard:per_task:1"}, ""),  # no GPU binding said
        ({"SLURM_GPU_BIND": "per_task:2"}, "SLURM_GPU_BIND=per_task:2"),  # --gpu-bind, <= 23.02
        ({"SLURM_GPU_BIND": "none", "SLURM_GPUS_PER_TASK": "2"}, ""),
        ({"SLURM_GPU_BIND": "map_gpu:0,1"}, ""),
        ({"SLURM_STEP_GPUS": "4,5", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}, ""),  # step-wide
        ({}, ""),
    ],
)
def test_slurm_s_word_that_each_task_has_gpus_of_its_own(
    environ: dict[str, str], said: str
) -> None:
    assert slurm_gpus_per_task(environ) == said
    found = local_rank({"SLURM_LOCALID": "2", **environ})
    assert isinstance(found, LocalRank)
    assert found.per_task == said


def test_only_slurm_s_own_rank_reads_its_per_task_gpus() -> None:
    # torchrun or mpirun inside such a task: their ranks share the task's GPUs.
    for variable in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        found = local_rank({"SLURM_LOCALID": "0", "SLURM_GPUS_PER_TASK": "2", variable: "1"})
        assert isinstance(found, LocalRank)
        assert (found.launcher.name != "Slurm", found.per_task) == (True, "")
