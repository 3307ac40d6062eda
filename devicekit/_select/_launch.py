"""What launchers tell a process about its place: its local rank, and the devices it sees.

Read from the environment, parsed once here: the manager's rules for ``LOCAL_RANK`` and
the variables that give each process its own devices (``CUDA_VISIBLE_DEVICES`` and the
like, and Slurm's word that it bound GPUs to each task) read these functions, never
``os.environ`` directly, and so does ``devicekit doctor``, on the environment of its
snapshot: one reading of each variable for both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final, NamedTuple

from devicekit._base import shown

__all__ = [
    "LAUNCHERS",
    "VISIBILITY_VARIABLES",
    "BadRank",
    "Launcher",
    "LocalRank",
    "Repeated",
    "devicekit_device",
    "given_devices",
    "local_rank",
    "own_devices_variable",
    "parse_visible_devices",
    "repeated_visible_device",
    "slurm_gpus_per_task",
    "whole_number",
]

VISIBILITY_VARIABLES: Final = {
    "cuda": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    "xpu": ("ZE_AFFINITY_MASK",),
}
"""The variables that give a process its own devices, by device type: the only table.

Each family's first is the one advice names. ROCm applies its three in the reverse order:
``ROCR_VISIBLE_DEVICES`` first, then ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``)
numbers the devices that are left. Their values are read by :func:`parse_visible_devices`.
"""


def _environment(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def devicekit_device(environ: Mapping[str, str] | None = None) -> str:
    """``DEVICEKIT_DEVICE``, stripped: the device every entry point uses; "" where unset.

    >>> devicekit_device({"DEVICEKIT_DEVICE": " cuda:1 "}), devicekit_device({})
    ('cuda:1', '')
    """
    return _environment(environ).get("DEVICEKIT_DEVICE", "").strip()


def given_devices(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The device types whose devices a launcher gave this process (a visibility variable set).

    >>> sorted(given_devices({"HIP_VISIBLE_DEVICES": "1", "ZE_AFFINITY_MASK": ""}))
    ['cuda']
    """
    environ = _environment(environ)
    return frozenset(
        device_type
        for device_type, names in VISIBILITY_VARIABLES.items()
        if any(environ.get(name) for name in names)
    )


_MOST_DIGITS = 9  # an index longer than this names no GPU


def _leading_integer(token: str) -> int:
    """The integer a token starts with, as the CUDA runtime reads it ("1gpu" is 1); -1 if none."""
    digits = token[1:] if token[:1] in "+-" else token
    length = len(digits) - len(digits.lstrip("0123456789"))
    if length == 0:
        return -1
    if length > _MOST_DIGITS:  # no GPU has that index; int() would refuse 4,301 digits
        return -1 if token.startswith("-") else 10**_MOST_DIGITS
    return int(token[: length + (len(token) - len(digits))])


def parse_visible_devices(
    value: str | None, variable: str = "CUDA_VISIBLE_DEVICES"
) -> list[int] | list[str] | None:
    """The devices a visibility variable lists, read as its runtime reads it.

    ``CUDA_VISIBLE_DEVICES`` (and ROCm's two, in the same form) as the CUDA runtime and
    PyTorch read it: indices, or UUID prefixes (``GPU-…``, ``MIG-…``); the list stops at
    the first entry that is not of the same kind (a negative index, say), and a repeated
    entry hides every GPU (:func:`repeated_visible_device` tells which). ``ZE_AFFINITY_MASK``
    as Level Zero's: devices by index, a tile as ``0.1``; blank is no mask, and a
    malformed one leaves no device.

    >>> parse_visible_devices(None) is None, parse_visible_devices("2,0"), parse_visible_devices("")
    (True, [2, 0], [])
    >>> parse_visible_devices("1,-1,0"), parse_visible_devices("0,0")
    ([1], [])
    >>> parse_visible_devices("GPU-ab,x")
    ['GPU-ab']
    >>> mask = "ZE_AFFINITY_MASK"
    >>> parse_visible_devices("0.1, 1", mask), parse_visible_devices("first", mask)
    (['0.1', '1'], [])

    Returns:
        None when unset (every device is visible); otherwise the visible devices as
        indices in the runtime's order, or as UUID prefixes (Level Zero's as written).
    """
    if value is None or (variable == "ZE_AFFINITY_MASK" and not value.strip()):
        return None
    if variable == "ZE_AFFINITY_MASK":
        entries = [entry.strip() for entry in value.split(",")]
        parses = all(part.isdecimal() for entry in entries for part in entry.split("."))
        return entries if parses else []
    listed, repeated = _cuda_entries(value)
    return [] if repeated is not None else listed


class Repeated(NamedTuple):
    """An entry that ``CUDA_VISIBLE_DEVICES`` lists twice, and the list meant."""

    entry: str  # the index (as CUDA reads it: "1gpu" is 1) or the UUID prefix repeated
    once: str  # the variable's entries, each once, in its order: the value to set


def repeated_visible_device(value: str | None) -> Repeated | None:
    """The first entry a ``CUDA_VISIBLE_DEVICES`` value repeats, which hides every GPU.

    >>> repeated_visible_device("0,1,0,2")
    Repeated(entry='0', once='0,1,2')
    >>> repeated_visible_device("GPU-ab,GPU-ab"), repeated_visible_device("0,1")
    (Repeated(entry='GPU-ab', once='GPU-ab'), None)
    >>> repeated_visible_device("0,-1,0") is None  # CUDA stops at -1, before the repeat
    True
    """
    if value is None:
        return None
    listed, repeated = _cuda_entries(value)
    return None if repeated is None else Repeated(repeated, ",".join(map(str, listed)))


def _cuda_entries(value: str) -> tuple[list[int] | list[str], str | None]:
    """The entries CUDA reads in a ``CUDA_VISIBLE_DEVICES`` value, each once; the first repeat.

    The repeat is the first entry listed a second time, None where none is.

    A repeated entry hides every GPU. NVIDIA's documentation says nothing of repeats;
    this is how PyTorch's own parser of the variable reads it ("Repeated ordinal results
    in empty set"), written to agree with the CUDA runtime, which then finds no device.
    """
    for prefix in ("GPU-", "MIG-"):
        if value.startswith(prefix):
            uuids: list[str] = []
            repeated: str | None = None
            for token in value.split(","):  # UUIDs are taken verbatim, spaces included
                if not token.startswith(prefix):
                    break
                if token in uuids:
                    repeated = repeated or token
                else:
                    uuids.append(token)
            return uuids, repeated
    indices: list[int] = []
    repeated_index: str | None = None
    for token in value.split(","):
        index = _leading_integer(token.strip())
        if index < 0:
            break
        if index in indices:
            repeated_index = repeated_index or str(index)
        else:
            indices.append(index)
    return indices, repeated_index


def own_devices_variable(device_type: str) -> str:
    """The variable that gives each process its own devices of a type, as advice names it.

    >>> own_devices_variable("xpu"), own_devices_variable("cuda")
    ('ZE_AFFINITY_MASK', 'CUDA_VISIBLE_DEVICES')
    """
    return VISIBILITY_VARIABLES.get(device_type, VISIBILITY_VARIABLES["cuda"])[0]


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
    srun_starts: bool = False
    """Whether srun can start its processes itself, each a Slurm task (an MPI library's
    direct launch, ``srun --mpi=pmix``): torchrun always starts its own."""


LAUNCHERS: Final = (
    Launcher("torchrun", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun --nproc_per_node={}"),
    Launcher(
        "Open MPI",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "mpirun --npernode {}",
        srun_starts=True,
    ),
    Launcher(
        "MVAPICH2",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
        "mpiexec -ppn {}",
        srun_starts=True,
    ),
    Launcher(
        "MPICH or Intel MPI",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "mpiexec -ppn {}",
        srun_starts=True,
    ),
    Launcher("Cray PALS", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE", "mpiexec --ppn {}"),
    Launcher("Slurm", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "srun --ntasks-per-node={}"),
)
"""In the order they are read, the innermost launcher first.

A launcher started inside another's job inherits the outer one's variables: torchrun or
mpirun inside a Slurm allocation sees the batch step's ``SLURM_LOCALID=0`` in every
process it starts. The launcher that started the process set its own variables last,
and only they tell the processes apart; Slurm, which starts the others, comes last.
The MPI libraries come next to each other, their order telling only which is named
where two set their variables at once; MVAPICH2, whose ``MV2_`` variables no other sets,
comes before the ``MPI_LOCALRANKID`` that MPICH-based launchers share. Where srun
starts MPI ranks itself, both its variables and the library's are set, and agree.
"""


_SLURM: Final = next(launcher for launcher in LAUNCHERS if launcher.name == "Slurm")


class LocalRank(NamedTuple):
    """This process's rank on its node, as its launcher set it.

    >>> rank = local_rank({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    >>> rank.said, rank.started_by
    ('OMPI_COMM_WORLD_LOCAL_RANK=1', 'Open MPI inside Slurm')
    """

    rank: int
    launcher: Launcher
    size: int | None  # the processes on the node, where the launcher says
    outer: tuple[Launcher, ...] = ()  # launchers whose variables it inherited, not read
    per_task: str = ""
    """Where this process is a Slurm task (:attr:`srun_task`), the variable saying that
    Slurm bound each task to GPUs of its own (:func:`slurm_gpus_per_task`), as messages
    show it; else ""."""
    srun_started: bool = False
    """Where the rank is an MPI library's, whether srun started the process itself: the
    rank and count agree with Slurm's (``srun --mpi=pmix``, not mpirun inside a job)."""

    @property
    def srun_task(self) -> bool:
        """Whether srun started this process as a task of its own, not torchrun or mpirun.

        So where the rank is Slurm's, or an MPI library's that srun started itself.
        """
        return self.launcher == _SLURM or self.srun_started

    @property
    def said(self) -> str:
        """``LOCAL_RANK=1``: the variable and its value, as messages show them."""
        return f"{self.launcher.rank}={self.rank}"

    @property
    def started_by(self) -> str:
        """The launcher followed, and those it runs inside: ``torchrun inside Slurm``."""
        return " inside ".join(launcher.name for launcher in (self.launcher, *self.outer))


class BadRank(NamedTuple):
    """A launcher's local rank that is no whole number: an error wherever it is used."""

    launcher: Launcher
    value: str  # as set

    @property
    def message(self) -> str:
        """The message of the ValueError that using it raises."""
        return (
            f"Expected {self.launcher.rank} (set by {self.launcher.name}) to be a whole number "
            f"of 0 or more, got {shown(self.value)}."
        )


def local_rank(environ: Mapping[str, str] | None = None) -> LocalRank | BadRank | None:
    """This process's rank on its node, from its innermost launcher; None if none set one.

    ``LOCAL_RANK`` (torchrun), then ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI),
    ``MV2_COMM_WORLD_LOCAL_RANK`` (MVAPICH2), ``MPI_LOCALRANKID`` (MPICH, Intel MPI),
    ``PALS_LOCAL_RANKID`` (Cray PALS), then ``SLURM_LOCALID`` (srun): the first set is
    read, the others are named as ``outer``.
    A value that is not a whole number of 0 or more comes back as a :class:`BadRank`,
    for whoever uses the rank to refuse; a device the user names does not need it.
    Where this process is a Slurm task (``srun_task``), ``per_task`` says whether Slurm
    bound GPUs to each task (an inner launcher's processes share what Slurm gave its task).
    An MPI library's rank is a Slurm task where its rank and count are Slurm's own (srun
    started it). Ranks that mpirun starts all inherit one ``SLURM_LOCALID``, so one rank
    at most agrees by chance: in a batch script, rank 0, which takes the first device
    either way.

    >>> rank = local_rank({"SLURM_LOCALID": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    >>> rank.rank, rank.size, rank.started_by
    (1, 2, 'torchrun inside Slurm')
    >>> local_rank({"LOCAL_RANK": "x"}).message
    "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, got 'x'."
    >>> local_rank({}) is None
    True
    """
    environ = _environment(environ)
    found = [launcher for launcher in LAUNCHERS if environ.get(launcher.rank) is not None]
    if not found:
        return None
    launcher, *outer = found
    value = environ[launcher.rank]
    rank = whole_number(value)
    if rank is None:
        return BadRank(launcher, value)
    size = whole_number(environ.get(launcher.size, ""))
    started = launcher.srun_starts and _slurm_s_own(environ, rank, size)
    per_task = slurm_gpus_per_task(environ) if launcher is _SLURM or started else ""
    return LocalRank(rank, launcher, size, tuple(outer), per_task, started)


def _slurm_s_own(environ: Mapping[str, str], rank: int, size: int | None) -> bool:
    """Whether an MPI rank and count are Slurm's task's too: srun started the rank itself.

    Both counts must be known: a rank alone may agree by chance (mpirun's rank 2, started
    in srun's third task, which Slurm gave two GPUs that its ranks share).

    >>> _slurm_s_own({"SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4"}, 2, 4)
    True
    >>> _slurm_s_own({"SLURM_LOCALID": "2"}, 2, 4), _slurm_s_own({"SLURM_LOCALID": "0"}, 2, 4)
    (False, False)
    """
    slurm_rank = whole_number(environ.get(_SLURM.rank, ""))
    slurm_size = whole_number(environ.get(_SLURM.size, ""))
    return slurm_rank == rank and size is not None and size == slurm_size


def slurm_gpus_per_task(environ: Mapping[str, str] | None = None) -> str:
    """Where Slurm bound each task to GPUs of its own, the variable that says so; else "".

    ``srun --gpus-per-task=N`` binds each task to N GPUs (``--gpu-bind=per_task:N``,
    implied since Slurm 21.08), and so does ``--gpu-bind=per_task:N`` itself. Slurm 23.11
    and later say so in ``SLURM_TRES_BIND`` (``gres/gpu:per_task:2``, implied or given);
    earlier releases in ``SLURM_GPUS_PER_TASK``, with ``SLURM_GPU_BIND`` where
    ``--gpu-bind`` was given. Any other GPU binding (``none``, ``closest``, a map or mask)
    overrides the implied one, and tasks may then share their GPUs: "".

    >>> slurm_gpus_per_task({"SLURM_TRES_BIND": "gres/gpu:verbose,per_task:2"})
    'SLURM_TRES_BIND=gres/gpu:verbose,per_task:2'
    >>> slurm_gpus_per_task({"SLURM_GPUS_PER_TASK": "2"})
    'SLURM_GPUS_PER_TASK=2'
    >>> slurm_gpus_per_task({"SLURM_GPUS_PER_TASK": "2", "SLURM_GPU_BIND": "closest"})
    ''
    """
    environ = _environment(environ)
    bind = environ.get("SLURM_TRES_BIND", "")  # "gres/gpu:per_task:2+gres/nic:..."
    for part in bind.split("+"):
        kind, _, options = part.strip().partition(":")
        if kind.strip().lower() == "gres/gpu":
            return f"SLURM_TRES_BIND={part.strip()}" if _per_task(options) else ""
    bind = environ.get("SLURM_GPU_BIND", "").strip()  # "[verbose,]per_task:2"
    if bind:
        return f"SLURM_GPU_BIND={bind}" if _per_task(bind) else ""
    count = environ.get("SLURM_GPUS_PER_TASK", "").strip()  # "2", "a100:2", "a100:1,v100:1"
    counts = [item.rpartition(":")[2] for item in count.split(",")]
    if count and all(whole_number(number) for number in counts):
        return f"SLURM_GPUS_PER_TASK={count}"
    return ""


def _per_task(options: str) -> bool:
    """Whether Slurm's GPU binding options bind each task to GPUs of its own (``per_task:N``).

    >>> _per_task("verbose,per_task:2"), _per_task("single:1"), _per_task("per_task:0")
    (True, False, False)
    """
    return any(
        name.strip().lower() == "per_task" and bool(whole_number(number))
        for name, _, number in (option.partition(":") for option in options.split(","))
    )
