"""NVIDIA GPUs as NVML sees them, and which of them CUDA will show this process.

NVML reads the driver's view of the GPUs without creating a CUDA context, so
listing devices stays cheap and keeps ``fork()`` safe. NVML numbers GPUs in PCI bus
order; CUDA numbers them in its own order (``CUDA_DEVICE_ORDER``) and then applies
``CUDA_VISIBLE_DEVICES`` (read by :func:`devicekit._select._launch.parse_visible_devices`).
:func:`visible_gpus` turns the first into the second, matching GPUs by UUID, never by
assuming the two numberings agree.

A fork never happens in the middle of a read: the binding (``pynvml``) takes a lock of
its own as NVML starts and stops, and NVML has its own inside; a child forked while
another thread held them would wait for them forever as its first read began. So reads
(:func:`unforked`) take one lock of this module's, which each fork takes too, made anew
in the child.

Each GPU's PCIe link is read where asked for (``read_nvml(links=True)``), and
:func:`pcie_peak` turns it into what the link carries, so that a copy's speed can be
judged against it: :func:`read_link`, which devicekit._base's ``link_peak`` asks.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import torch

from devicekit._base import LinkPeak, register_link_reader
from devicekit._select._fork_locks import ForkSafeLock
from devicekit._select._launch import parse_visible_devices

__all__ = [
    "NvmlGpu",
    "gpu_of",
    "pcie_peak",
    "read_driver",
    "read_link",
    "read_nvml",
    "unforked",
    "visible_gpus",
]

_T = TypeVar("_T")


class NvmlGpu(NamedTuple):
    """One GPU, or one MIG instance of a GPU, as NVML reports it."""

    uuid: str
    """``GPU-…`` for a whole GPU, ``MIG-…`` for a MIG instance."""
    name: str
    total_memory: int
    free_memory: int
    pci_bus_id: str = ""
    capability: tuple[int, int] | None = None
    mig: tuple[NvmlGpu, ...] = ()
    """The GPU's MIG instances, when MIG mode is on."""
    utilization: float | None = None
    """The share of the last sample period a kernel ran, 0-1; None where NVML cannot tell."""
    processes: tuple[tuple[int, int | None], ...] | None = None
    """(pid, bytes used) of each process using it; None where NVML cannot tell."""
    link: LinkPeak | None = None
    """Its PCIe link to the host (see :func:`_read_link`); None where NVML cannot tell, or
    was not asked (``read_nvml(links=True)`` asks). A MIG instance's is its GPU's: the
    slices share one link.
    """


# PCIe's transfer rate per lane in GT/s, and the share of the bits that are data once the
# line code is taken off: 8b/10b up to gen2, 128b/130b for gen3-5; gen6 sends 256-byte
# FLITs (PAM4) of which 242 bytes are packets and their link-layer words (the 8 CRC and
# 6 FEC bytes are not), the efficiency PCI-SIG quotes. Packet headers cost more still, on
# every generation: no copy reaches these figures.
_PCIE_LANE: dict[int, tuple[float, float]] = {
    1: (2.5, 8 / 10),
    2: (5.0, 8 / 10),
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 242 / 256),
}


def pcie_peak(generation: int, width: int) -> float | None:
    """What a PCIe link carries in GB/s (10**9 bytes), one direction; None for an unknown one.

    Per lane: the transfer rate times the line code's efficiency, over 8 bits a byte.

    >>> [round(pcie_peak(generation, 16), 2) for generation in range(1, 7)]
    [4.0, 8.0, 15.75, 31.51, 63.02, 121.0]
    >>> round(pcie_peak(4, 8), 2), pcie_peak(7, 16), pcie_peak(5, 0)
    (15.75, None, None)
    """
    if generation not in _PCIE_LANE or width <= 0:
        return None
    rate, efficiency = _PCIE_LANE[generation]
    return rate * efficiency / 8 * width


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older bindings give bytes


def _read_gpu(nvml: Any, handle: Any, *, links: bool = False) -> NvmlGpu:
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    capability: tuple[int, int] | None = None
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        capability = (int(major), int(minor))
    except nvml.NVMLError:
        pass
    try:
        pci_bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except nvml.NVMLError:
        pci_bus_id = ""
    return NvmlGpu(
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        total_memory=int(memory.total),
        free_memory=int(memory.free),
        pci_bus_id=pci_bus_id,
        capability=capability,
        utilization=_utilization(nvml, handle),
        processes=_processes(nvml, handle),
        link=_read_link(nvml, handle) if links else None,
    )


def _asked(nvml: Any, reader: str, handle: Any) -> int | None:
    try:
        return int(getattr(nvml, reader)(handle))
    except nvml.NVMLError:  # NotSupported: some boards, vGPUs, MIG handles
        return None


def _read_link(nvml: Any, handle: Any) -> LinkPeak | None:
    """A GPU's PCIe link at the most that both the GPU and its slot support.

    Not the link's current state: at idle the GPU lowers its link's generation to save
    power (many show gen1 then), and raises it again as soon as a copy starts; the
    current figures would judge a copy against a link that is not the one it runs on.
    NVML's maximum is the device's and the system's both (a gen5 GPU in a gen4 slot says
    4). Where NVML does not give it (some boards), the current figure is taken.

    None where the GPU reaches host memory over NVLink-C2C (GH200, GB200: about 350 GB/s
    measured, ten times its PCIe link's): its copies do not use the PCIe link.
    """
    if _over_c2c(nvml, handle):
        return None
    generation = _asked(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle) or _asked(
        nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle
    )
    width = _asked(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle) or _asked(
        nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle
    )
    if generation is None or width is None:
        return None
    peak = pcie_peak(generation, width)
    return None if peak is None else LinkPeak(generation, width, peak)


def _over_c2c(nvml: Any, handle: Any) -> bool:
    """Whether NVML says the GPU's host link is NVLink-C2C; False where it cannot tell."""
    query = getattr(nvml, "nvmlDeviceGetC2cModeInfoV", None)  # nvidia-ml-py 12.550 and later
    if query is None:
        return False
    try:
        return bool(query(handle).isC2cEnabled)
    except nvml.NVMLError:  # a driver before the query, a board without C2C, MIG handles
        return False


def _utilization(nvml: Any, handle: Any) -> float | None:
    try:
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100
    except nvml.NVMLError:  # not supported (a MIG instance, some vGPUs)
        return None


def _processes(nvml: Any, handle: Any) -> tuple[tuple[int, int | None], ...] | None:
    """Compute and graphics processes on a GPU, once each, with the memory NVML reports."""
    found: dict[int, int | None] = {}
    try:
        for reader in (
            nvml.nvmlDeviceGetComputeRunningProcesses,
            nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            for process in reader(handle):
                used = process.usedGpuMemory  # None where the driver hides it (containers)
                found.setdefault(int(process.pid), None if used is None else int(used))
    except nvml.NVMLError:
        return None
    return tuple(found.items())


def _read_mig(nvml: Any, handle: Any, parent: NvmlGpu) -> tuple[NvmlGpu, ...]:
    try:
        current, _ = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # not a MIG-capable GPU
        return ()
    if current != 1:
        return ()
    instances = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError:  # an empty slot
            continue
        memory = nvml.nvmlDeviceGetMemoryInfo(mig)
        instances.append(
            parent._replace(
                uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                total_memory=int(memory.total),
                free_memory=int(memory.free),
                utilization=None,  # the whole GPU's would say nothing of this slice
                processes=_processes(nvml, mig),
            )
        )
    return tuple(instances)


@functools.cache
def _binding() -> Any:
    """The ``pynvml`` module, or None where it is not installed: looked for once a process.

    A failed import searches the whole path again each time: DeviceManager() took
    0.17 ms with it, 0.07 ms without, on a machine without pynvml.
    """
    try:
        import pynvml  # noqa: PLC0415 - optional, and only imported when devices are listed
    except ImportError:
        return None
    return pynvml


# Held while NVML is read, and by the forking thread around each fork (see the module).
_reading = ForkSafeLock()


def unforked(read: Callable[[], _T]) -> _T:
    """``read()``, with no fork while it runs: for every reader of NVML (PyTorch's count too).

    >>> unforked(lambda: 42)
    42
    """
    with _reading:
        return read()


def read_nvml(*, links: bool = False) -> list[NvmlGpu] | None:
    """Every GPU NVML sees, in NVML's (PCI bus) order; None where NVML cannot be read.

    Needs the ``nvidia-ml-py`` package (the ``nvml`` extra) and an NVIDIA
    driver. Creates no CUDA context, and no fork happens while it reads. With ``links``,
    each GPU's PCIe link too: four calls more per GPU, which listing devices does without.
    """
    return unforked(lambda: _read(_binding(), links=links))


def _read(pynvml: Any, *, links: bool = False) -> list[NvmlGpu] | None:
    if pynvml is None:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver, or no NVIDIA GPU at all
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu = _read_gpu(pynvml, handle, links=links)
            gpus.append(gpu._replace(mig=_read_mig(pynvml, handle, gpu)))
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
    return gpus


def read_driver() -> tuple[str, tuple[int, int]] | None:
    """The NVIDIA driver's version and the newest CUDA it runs: ``("570.86.15", (12, 8))``.

    None where NVML cannot be read. Creates no CUDA context, and no fork happens while it
    reads.
    """
    return unforked(lambda: _read_driver(_binding()))


def _read_driver(pynvml: Any) -> tuple[str, tuple[int, int]] | None:
    if pynvml is None:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        version = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())  # 12080 for CUDA 12.8
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
    return version, (cuda // 1000, cuda % 1000 // 10)


def _cuda_order(gpus: Sequence[NvmlGpu], device_order: str) -> list[NvmlGpu]:
    by_bus = sorted(gpus, key=lambda gpu: gpu.pci_bus_id)
    if device_order == "PCI_BUS_ID":
        return by_bus
    # CUDA's default, FASTEST_FIRST, puts the most capable GPUs first and breaks ties
    # by PCI bus; on machines with one GPU model the two orders are the same.
    return sorted(by_bus, key=lambda gpu: gpu.capability or (0, 0), reverse=True)


def _match_prefix(prefix: str, candidates: Sequence[NvmlGpu]) -> NvmlGpu | None:
    matches = [gpu for gpu in candidates if gpu.uuid.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None  # an ambiguous prefix matches nothing


def visible_gpus(gpus: Sequence[NvmlGpu], environ: Mapping[str, str]) -> list[NvmlGpu]:
    """The GPUs CUDA will show this process, in CUDA index order (``cuda:0`` first).

    >>> a, b = NvmlGpu("GPU-aa", "A", 8, 4, "0000:01"), NvmlGpu("GPU-bb", "B", 8, 6, "0000:02")
    >>> [gpu.uuid for gpu in visible_gpus([a, b], {"CUDA_VISIBLE_DEVICES": "1,0"})]
    ['GPU-bb', 'GPU-aa']
    >>> [gpu.uuid for gpu in visible_gpus([a, b], {"CUDA_VISIBLE_DEVICES": "GPU-b"})]
    ['GPU-bb']
    """
    ordered = _cuda_order(gpus, environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))
    wanted = parse_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if wanted is None:
        return ordered
    visible: list[NvmlGpu] = []
    for token in wanted:
        if isinstance(token, int):
            if token >= len(ordered):
                break  # CUDA stops at the first index past the last GPU
            visible.append(ordered[token])
            continue
        pool = [mig for gpu in ordered for mig in gpu.mig] if token.startswith("MIG-") else ordered
        found = _match_prefix(token, pool)
        if found is None:
            break
        if found in visible:
            return []
        visible.append(found)
        if token.startswith("MIG-"):
            break  # CUDA shows a process one MIG instance at most: the first it is given
    return visible


def gpu_of(
    index: int, gpus: Sequence[NvmlGpu], environ: Mapping[str, str], uuid: str | None = None
) -> NvmlGpu | None:
    """The GPU (or MIG instance) behind ``cuda:<index>``; None where none is.

    By ``uuid``, CUDA's own for the index where CUDA has started; else by CUDA's rules
    for the environment (:func:`visible_gpus`).

    >>> a, b = NvmlGpu("GPU-aa", "A", 8, 4, "0000:01"), NvmlGpu("GPU-bb", "B", 8, 6, "0000:02")
    >>> gpu_of(0, [a, b], {"CUDA_VISIBLE_DEVICES": "1"}).uuid, gpu_of(1, [a, b], {}).uuid
    ('GPU-bb', 'GPU-bb')
    >>> gpu_of(0, [a, b], {}, uuid="bb").uuid, gpu_of(2, [a, b], {})
    ('GPU-bb', None)
    """
    if uuid is not None:
        every = [*gpus, *(mig for gpu in gpus for mig in gpu.mig)]
        return next((gpu for gpu in every if gpu.uuid in (f"GPU-{uuid}", f"MIG-{uuid}")), None)
    visible = visible_gpus(gpus, environ)
    return visible[index] if 0 <= index < len(visible) else None


def read_link(device: torch.device) -> LinkPeak | None:
    """The PCIe link of a CUDA device, as NVML reports it; None where it cannot tell.

    None for other devices, for ROCm's (which NVML does not see), and where NVML cannot be
    read. Creates no CUDA context: CUDA is asked which GPU an index is only where this
    process already started it (``CUDA_VISIBLE_DEVICES`` says otherwise).
    """
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    started = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
    index = cast("int | None", device.index)  # None for "cuda", whatever the stubs say
    if index is None:
        index = torch.cuda.current_device() if started else 0  # CUDA's, before it starts
    gpus = read_nvml(links=True)
    if not gpus:
        return None
    uuid = None
    if started and 0 <= index < torch.cuda.device_count():
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    found = gpu_of(index, gpus, os.environ, uuid)
    return None if found is None else found.link


register_link_reader(read_link)  # devicekit._base's link_peak asks it
