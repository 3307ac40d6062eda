"""Device families: what each can see on this machine, found lazily and without a CUDA context.

A :class:`Backend` lists the devices of one family (CUDA, ROCm, XPU, MPS, the CPU, or
a family of the user's own) as :class:`DeviceInfo` records. The built-in ones import
nothing optional until asked, and the CUDA one reads NVML rather than starting CUDA,
so listing devices keeps ``fork()`` safe: it starts no process, and takes no lock that
a fork could leave held in the child.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from devicekit._base import accelerator_type, gib, listing, shown
from devicekit._select._nvml import NvmlGpu, read_nvml, unforked, visible_gpus

__all__ = [
    "AcceleratorBackend",
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "DeviceInfo",
    "Family",
    "GpuProcess",
    "MpsBackend",
    "XpuBackend",
    "builtin_backends",
    "cuda_started",
    "describe",
    "who_uses",
]


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What devicekit knows about one device; None wherever its backend cannot tell.

    >>> import torch, devicekit as dk
    >>> info = dk.DeviceInfo(torch.device("cuda", 0), "cuda", 0, "NVIDIA H100", 80 << 30)
    >>> info.device, info.free_memory
    (device(type='cuda', index=0), None)
    """

    device: torch.device
    """The device, as ``to_device`` and PyTorch take it."""
    backend: str
    """The family that found it, such as ``"cuda"``, ``"rocm"``, ``"mps"`` or ``"cpu"``."""
    index: int | None
    """Its index within the family as this process sees it; None for the CPU."""
    name: str | None = None
    """The model name, such as ``"NVIDIA H100 80GB HBM3"``."""
    total_memory: int | None = None
    """Bytes of memory (system memory for the CPU)."""
    free_memory: int | None = None
    """Bytes free when devicekit looked, other processes' use included."""
    capability: tuple[int, int] | None = None
    """The CUDA compute capability, such as ``(9, 0)``."""
    uuid: str | None = None
    """The device's UUID, such as ``"GPU-5f1c…"``."""
    utilization: float | None = None
    """How busy it was when devicekit looked, from 0 to 1, as NVML measures it. That is
    the share of NVML's last sample period in which a kernel ran, any process's."""
    processes: tuple[GpuProcess, ...] | None = None
    """The processes using it, this one included, as NVML lists them; empty for none."""


class GpuProcess(NamedTuple):
    """A process using a GPU, as :attr:`DeviceInfo.processes` lists it.

    >>> import devicekit as dk
    >>> dk.GpuProcess(pid=4242, used_memory=31 << 30).used_memory / 2**30
    31.0
    """

    pid: int
    """Its process id, as the GPU driver sees it. Inside a container it may differ."""
    used_memory: int | None
    """Bytes of GPU memory it uses; None where the driver does not say (in containers)."""


def who_uses(info: DeviceInfo) -> str:
    """Who uses a GPU, as NVML lists them: ``31.0 GiB used by pid 4242 and used by pid 77``."""
    ordered = sorted(info.processes or (), key=lambda process: -(process.used_memory or 0))
    return listing(
        [
            f"{gib(process.used_memory)} used by pid {process.pid}"
            if process.used_memory is not None
            else f"used by pid {process.pid}"
            for process in ordered
        ]
    )


def describe(info: DeviceInfo) -> str:
    """One line about a device, as ``explain()`` and ``devicekit info`` show it."""
    parts = [f"{info.device!s:<8}", info.name or "unknown model"]
    if info.free_memory is not None and info.total_memory is not None:
        parts.append(f"{gib(info.free_memory)} free of {gib(info.total_memory)}")
    elif info.total_memory is not None:
        parts.append(f"{gib(info.total_memory)}, free memory unknown")
    if info.capability is not None:
        parts.append(f"compute capability {info.capability[0]}.{info.capability[1]}")
    if info.utilization is not None:
        parts.append(f"{info.utilization:.0%} busy")
    return f"{parts[0]} {', '.join(parts[1:])}"


@runtime_checkable
class Backend(Protocol):
    """A family of devices that :class:`~devicekit.DeviceManager` can select from.

    Implement it for a family devicekit does not know, or as a fake in tests, and pass
    instances in ``DeviceManager(backends=[...])``. A backend may also carry a ``note``
    attribute: a sentence that :meth:`DeviceManager.explain` shows, such as why it
    found nothing; and a ``make_current(device)`` method, which a manager following
    torchrun's ``LOCAL_RANK`` calls on the device it chose, as the built-in CUDA, XPU
    and other accelerator backends call ``set_device``.

    >>> import torch, devicekit as dk
    >>> class TwoFakeGpus:
    ...     name = device_type = "cuda"
    ...     def devices(self):
    ...         return [dk.DeviceInfo(torch.device("cuda", i), "cuda", i) for i in range(2)]
    >>> isinstance(TwoFakeGpus(), dk.Backend)
    True
    """

    @property
    def name(self) -> str:
        """The family's name as ``prefer=`` names it, such as ``"cuda"`` or ``"rocm"``."""
        ...

    @property
    def device_type(self) -> str:
        """The :class:`torch.device` type of its devices (``"cuda"`` for ROCm too)."""
        ...

    def devices(self) -> Sequence[DeviceInfo]:
        """The family's visible devices, in index order; empty when it has none.

        Must not create a CUDA context (or any device context): it runs when devices
        are merely listed.
        """
        ...


class Family(NamedTuple):
    """One device family as its backend listed it: ``cuda`` (ROCm too), ``xpu``, ``mps``."""

    name: str
    device_type: str
    devices: tuple[DeviceInfo, ...]
    note: str | None = None  # why it found nothing, where it knows

    @classmethod
    def listed(cls, backend: Backend) -> Family:
        """What ``backend`` lists now, checked: a custom backend's mistake is named here."""
        found = tuple(backend.devices())  # first: listing sets the note
        for position, info in enumerate(found):
            if not isinstance(info, DeviceInfo):  # for untyped backends
                msg = (  # type: ignore[unreachable]
                    f"Expected the {backend.name!r} backend's devices() to list "
                    f"devicekit.DeviceInfo objects, got {type(info).__name__} {shown(info)} "
                    f"at position {position}."
                )
                raise TypeError(msg)
        return cls(backend.name, backend.device_type, found, getattr(backend, "note", None))


def cuda_started() -> bool:
    """Whether this process already started CUDA: only then may devicekit ask it directly."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _cuda_compiled() -> bool:
    return torch.version.cuda is not None or torch.version.hip is not None


class CudaBackend:
    """NVIDIA GPUs through NVML, and AMD GPUs under ROCm builds (reported as ``"rocm"``).

    Args:
        nvml: Reads NVML; tests pass fakes. Returns None where NVML cannot be read.
        environ: Where ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` are read.
        compiled: Whether PyTorch was built with CUDA or ROCm; None asks PyTorch.
    """

    device_type = "cuda"

    def __init__(
        self,
        *,
        nvml: Callable[[], Sequence[NvmlGpu] | None] = read_nvml,
        environ: Mapping[str, str] | None = None,
        compiled: bool | None = None,
    ) -> None:
        self._nvml = nvml
        self._environ = os.environ if environ is None else environ
        self._compiled = _cuda_compiled() if compiled is None else compiled
        self.name = "rocm" if torch.version.hip is not None else "cuda"
        self.note: str | None = None

    def devices(self) -> list[DeviceInfo]:
        """The GPUs this process may use, in CUDA index order."""
        if self.name == "rocm":
            return self._rocm_devices()
        gpus = self._nvml()
        if not self._compiled:
            seen = f"NVML sees {len(gpus)} NVIDIA GPU(s), but " if gpus else ""
            self.note = f"{seen}this PyTorch build has no CUDA support"
            return []
        if gpus is None:
            return self._devices_from_torch()
        visible = self._in_cuda_order(gpus) if cuda_started() else None
        if visible is None:
            visible = visible_gpus(gpus, self._environ)
        if gpus and not visible:
            setting = self._environ.get("CUDA_VISIBLE_DEVICES")
            self.note = f"CUDA_VISIBLE_DEVICES={shown(setting)} hides all {len(gpus)} GPU(s)"
        return [
            DeviceInfo(
                torch.device("cuda", index),
                self.name,
                index,
                gpu.name,
                gpu.total_memory,
                gpu.free_memory,
                gpu.capability,
                gpu.uuid,
                gpu.utilization,
                None
                if gpu.processes is None
                else tuple(GpuProcess(pid, used) for pid, used in gpu.processes),
            )
            for index, gpu in enumerate(visible)
        ]

    def make_current(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process (``torch.cuda.set_device``)."""
        torch.cuda.set_device(device)

    @staticmethod
    def _in_cuda_order(gpus: Sequence[NvmlGpu]) -> list[NvmlGpu] | None:
        """CUDA's own order, read from a CUDA this process already started, matched by UUID.

        Exact where :func:`visible_gpus` must infer CUDA's order from the environment;
        None when a device cannot be matched (then the inference is all there is).
        """
        by_uuid = {gpu.uuid: gpu for gpu in gpus}
        by_uuid.update({mig.uuid: mig for gpu in gpus for mig in gpu.mig})
        ordered = []
        for index in range(torch.cuda.device_count()):
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            match = by_uuid.get(f"GPU-{uuid}") or by_uuid.get(f"MIG-{uuid}")
            if match is None:
                return None
            ordered.append(match)
        return ordered

    def _devices_from_torch(self) -> list[DeviceInfo]:
        # Without NVML's Python binding: PyTorch's NVML-based count, which creates no
        # context either. Names and memory come only from a CUDA already started.
        count_nvml = getattr(torch.cuda, "_device_count_nvml", None)
        count = unforked(count_nvml) if callable(count_nvml) else -1
        if cuda_started():
            count = torch.cuda.device_count()
        if count < 0:
            self.note = (
                "NVML could not be read (is the NVIDIA driver installed?); "
                "pip install nvidia-ml-py for names and memory"
            )
            return []
        return [self._from_torch(index) for index in range(count)]

    def _rocm_devices(self) -> list[DeviceInfo]:
        count_amdsmi = getattr(torch.cuda, "_device_count_amdsmi", None)
        count = unforked(count_amdsmi) if callable(count_amdsmi) else -1
        if count < 0 or cuda_started():
            count = torch.cuda.device_count()
        return [self._from_torch(index) for index in range(count)]

    def _from_torch(self, index: int) -> DeviceInfo:
        device = torch.device("cuda", index)
        if not cuda_started():
            return DeviceInfo(device, self.name, index)
        properties = torch.cuda.get_device_properties(index)
        return DeviceInfo(
            device,
            self.name,
            index,
            properties.name,
            properties.total_memory,
            capability=(properties.major, properties.minor),
        )


class XpuBackend:
    """Intel GPUs through ``torch.xpu``."""

    name = device_type = "xpu"

    def __init__(self) -> None:
        self.note: str | None = None

    def make_current(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process (``torch.xpu.set_device``)."""
        torch.xpu.set_device(device)

    def devices(self) -> list[DeviceInfo]:
        """The XPU devices PyTorch sees."""
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            self.note = "no XPU device is available to this PyTorch build"
            return []
        infos = []
        for index in range(xpu.device_count()):
            properties = xpu.get_device_properties(index)
            infos.append(
                DeviceInfo(
                    torch.device("xpu", index),
                    "xpu",
                    index,
                    properties.name,
                    properties.total_memory,
                )
            )
        return infos


class MpsBackend:
    """Apple GPUs through Metal (``mps``)."""

    name = device_type = "mps"

    def __init__(self) -> None:
        self.note: str | None = None

    def devices(self) -> list[DeviceInfo]:
        """The one MPS device, where Metal is available."""
        if not torch.backends.mps.is_built():
            self.note = "this PyTorch build has no MPS support"
            return []
        if not torch.backends.mps.is_available():
            self.note = "MPS is built in but not available on this machine"
            return []
        total = int(torch.mps.recommended_max_memory())
        return [DeviceInfo(torch.device("mps", 0), "mps", 0, "Apple GPU (MPS)", total)]


class AcceleratorBackend:
    """An accelerator PyTorch knows through ``torch.accelerator`` that no built-in covers.

    Args:
        device_type: Its device type, such as ``"hpu"`` or ``"mtia"``.
    """

    def __init__(self, device_type: str) -> None:
        self.name = self.device_type = device_type

    def make_current(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process, through ``torch.accelerator``."""
        torch.accelerator.set_device_index(device.index)

    def devices(self) -> list[DeviceInfo]:
        """One record per device ``torch.accelerator`` counts, with its memory where it says."""
        count = torch.accelerator.device_count()
        kind = self.device_type
        name_of = getattr(getattr(torch, kind, None), "get_device_name", None)
        found = []
        for index in range(count):
            free: int | None
            total: int | None
            try:
                free, total = torch.accelerator.get_memory_info(index)
            except (RuntimeError, NotImplementedError):  # a backend that keeps no figures
                free = total = None
            name = str(name_of(index)) if callable(name_of) else None
            found.append(DeviceInfo(torch.device(kind, index), kind, index, name, total, free))
        return found


def _cpu_name() -> str | None:
    """The CPU's architecture as the kernel names it (``x86_64``, ``arm64``).

    Read with no process started and no lock taken: ``platform.processor()`` runs
    ``uname -p`` the first time, under a lock (Python 3.11) that a process forked
    meanwhile finds held forever.

    >>> _cpu_name() == (platform.machine() or None)
    True
    """
    if hasattr(os, "uname"):
        return os.uname().machine or None
    return platform.machine() or None  # Windows: no uname, and no fork to leave a lock held


def _sysconf(name: str) -> int | None:
    try:
        value = os.sysconf(name)
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None
    return value if value > 0 else None


class CpuBackend:
    """The host CPU, always there; its memory is the system's."""

    name = device_type = "cpu"

    def devices(self) -> list[DeviceInfo]:
        """The one CPU device."""
        page = _sysconf("SC_PAGE_SIZE")
        total, free = _sysconf("SC_PHYS_PAGES"), _sysconf("SC_AVPHYS_PAGES")
        return [
            DeviceInfo(
                torch.device("cpu"),
                "cpu",
                None,
                _cpu_name(),
                total * page if total and page else None,
                free * page if free and page else None,
            )
        ]


def builtin_backends() -> list[Backend]:
    """The built-in backends, plus one for an accelerator PyTorch knows and they miss."""
    backends: list[Backend] = [CudaBackend(), XpuBackend(), MpsBackend(), CpuBackend()]
    other = accelerator_type()  # the build's, read without starting it
    if other is not None and all(backend.device_type != other for backend in backends):
        backends.insert(-1, AcceleratorBackend(other))
    return backends
