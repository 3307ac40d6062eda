"""What launchers tell a process about its place: its local rank, and the devices it sees.

Read from the environment, parsed once here: the manager's rules for ``LOCAL_RANK`` and
the variables that give each process its own devices (``CUDA_VISIBLE_DEVICES`` and the
like) read these functions, never ``os.environ`` directly.
"""

from __future__ import annotations

import os
from typing import Final, NamedTuple

from devicekit._devices import shown

__all__ = [
    "LAUNCHERS",
    "VISIBILITY_VARIABLES",
    "Launcher",
    "LocalRank",
    "devicekit_device",
    "local_rank",
    "visibility_set",
]

VISIBILITY_VARIABLES: Final = {
    "cuda": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    "xpu": ("ZE_AFFINITY_MASK",),
}
"""The variables that give a process its own devices, by device type."""


def devicekit_device() -> str:
    """``DEVICEKIT_DEVICE``, stripped: the device every entry point uses; "" where unset."""
    return os.environ.get("DEVICEKIT_DEVICE", "").strip()


def visibility_set(device_type: str) -> bool:
    """Whether this process was given its own devices (CUDA_VISIBLE_DEVICES and the like)."""
    return any(os.environ.get(name) for name in VISIBILITY_VARIABLES.get(device_type, ()))


def whole_number(value: str) -> int | None:
    """``value`` as a small whole number (ASCII digits, as launchers write them), or None.

    >>> whole_number(" 3 "), whole_number("-1"), whole_number("٣")
    (3, None, None)
    """
    value = value.strip()
    return int(value) if value.isascii() and value.isdecimal() and len(value) <= 9 else None


class Launcher(NamedTuple):
    """How one launcher tells a process its rank on the node, and the node's process count."""

    name: str  # as messages name it
    rank: str  # the variable of the local rank
    size: str  # the variable of the processes on the node
    per_node: str  # its option that starts {} processes per node, as advice shows it


LAUNCHERS: Final = (
    Launcher("torchrun", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun --nproc_per_node={}"),
    Launcher("Slurm", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "srun --ntasks-per-node={}"),
    Launcher(
        "Open MPI",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "mpirun --npernode {}",
    ),
    Launcher("MPICH or Intel MPI", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpiexec -ppn {}"),
    Launcher("Cray PALS", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE", "mpiexec --ppn {}"),
)
"""In the order they are read: torchrun inside a Slurm job sets both, and its is the rank."""


class LocalRank(NamedTuple):
    """This process's rank on its node, as its launcher set it."""

    rank: int
    launcher: Launcher
    size: int | None  # the processes on the node, where the launcher says

    @property
    def said(self) -> str:
        """``LOCAL_RANK=1``: the variable and its value, as messages show them."""
        return f"{self.launcher.rank}={self.rank}"


def local_rank() -> LocalRank | None:
    """This process's rank on its node, from the first launcher variable set; None if none.

    ``LOCAL_RANK`` (torchrun), then ``SLURM_LOCALID`` (srun), ``OMPI_COMM_WORLD_LOCAL_RANK``
    (Open MPI), ``MPI_LOCALRANKID`` (MPICH, Intel MPI), ``PALS_LOCAL_RANKID`` (Cray PALS).

    Raises:
        ValueError: The variable is set but not a whole number of 0 or more.
    """
    for launcher in LAUNCHERS:
        value = os.environ.get(launcher.rank)
        if value is None:
            continue
        rank = whole_number(value)
        if rank is None:
            msg = (
                f"Expected {launcher.rank} (set by {launcher.name}) to be a whole number of 0 "
                f"or more, got {shown(value)}."
            )
            raise ValueError(msg)
        return LocalRank(rank, launcher, whole_number(os.environ.get(launcher.size, "")))
    return None
