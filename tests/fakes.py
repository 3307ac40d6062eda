"""Fake device families for the DeviceManager tests: any number of GPUs, any free memory.

And a stand-in for pynvml (:func:`fake_pynvml`), for what devicekit reads through NVML.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from devicekit import DeviceInfo, GpuProcess
from devicekit._select._backends import CpuBackend

from .helpers import GiB

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


@dataclasses.dataclass
class FakeGpus:
    """A family of GPUs with the given free memory in GiB each (None: unknown)."""

    free: Sequence[float | None]
    name: str = "cuda"
    device_type: str = "cuda"
    total: float = 80
    note: str | None = None
    busy: Sequence[float | None] = ()
    """Utilization of each GPU, 0-1 (missing: unknown)."""
    processes: dict[int, tuple[GpuProcess, ...]] = dataclasses.field(default_factory=dict)
    made_current: list[torch.device] = dataclasses.field(default_factory=list)
    """What the manager made the current device, as torch.cuda.set_device would."""

    def make_current(self, device: torch.device) -> None:
        self.made_current.append(device)

    def devices(self) -> list[DeviceInfo]:
        return [
            DeviceInfo(
                torch.device(self.device_type, index),
                self.name,
                index,
                "Fake GPU",  # one model, as most machines have
                int(self.total * GiB),
                None if free is None else int(free * GiB),
                (9, 0),
                f"GPU-{index:04d}",
                self.busy[index] if index < len(self.busy) else None,
                self.processes.get(index),
            )
            for index, free in enumerate(self.free)
        ]


def machine(*free: float | None, note: str | None = None) -> list[object]:
    """Backends for a machine with GPUs of the given free memory, and its CPU."""
    return [FakeGpus(free, note=note), CpuBackend()]


class NvmlError(Exception):
    """pynvml's NVMLError, as :func:`fake_pynvml` raises it (NVML_ERROR_NOT_SUPPORTED...)."""


LINK_READERS = {
    "max_generation": "nvmlDeviceGetMaxPcieLinkGeneration",
    "max_width": "nvmlDeviceGetMaxPcieLinkWidth",
    "generation": "nvmlDeviceGetCurrPcieLinkGeneration",
    "width": "nvmlDeviceGetCurrPcieLinkWidth",
}
"""What each key of :func:`fake_pynvml`'s ``links`` is read with."""


def fake_pynvml(
    links: Sequence[Mapping[str, int]], *, migs: int = 0, calls: list[str] | None = None
) -> SimpleNamespace:
    """pynvml for a machine of one H100 per entry of ``links``, each a GPU's PCIe figures.

    ``links[i]`` maps keys of :data:`LINK_READERS` to what NVML answers; a missing key is
    NVML_ERROR_NOT_SUPPORTED; a ``"c2c"`` key is what NVML says of NVLink-C2C (1: the GPU
    reaches host memory over it, as a GH200 does), none where it does not know. GPU ``i``
    is ``GPU-<i>`` on PCI bus ``i + 1``; with ``migs``,
    MIG mode is on and it has that many instances, ``MIG-<i>-<slot>``, whose link queries
    NVML does not support. ``calls`` collects the name of each function called.
    """

    def called(name: str, answer: Any) -> Any:
        def call(*args: Any) -> Any:
            if calls is not None:
                calls.append(name)
            return answer(*args) if callable(answer) else answer

        return call

    def unsupported(*_: Any) -> Any:
        raise NvmlError

    def link(reader: str) -> Any:
        def read(handle: Any) -> int:
            if isinstance(handle, tuple) or reader not in links[handle]:
                raise NvmlError  # a MIG instance's handle, or a figure the board lacks
            return links[handle][reader]

        return read

    def c2c(handle: Any) -> SimpleNamespace:
        if isinstance(handle, tuple) or "c2c" not in links[handle]:
            raise NvmlError  # a driver before C2C's query, or a MIG instance's handle
        return SimpleNamespace(isC2cEnabled=links[handle]["c2c"])

    def uuid(handle: Any) -> bytes:
        return (
            f"MIG-{handle[0]}-{handle[1]}" if isinstance(handle, tuple) else f"GPU-{handle}"
        ).encode()

    functions = {
        "nvmlInit": None,
        "nvmlShutdown": None,
        "nvmlDeviceGetCount": len(links),
        "nvmlDeviceGetHandleByIndex": lambda index: index,
        "nvmlDeviceGetMemoryInfo": SimpleNamespace(total=80 * GiB, free=70 * GiB),
        "nvmlDeviceGetCudaComputeCapability": (9, 0),
        "nvmlDeviceGetPciInfo": lambda handle: SimpleNamespace(
            busId=f"00000000:{handle + 1:02x}:00.0".encode()
        ),
        "nvmlDeviceGetUUID": uuid,
        "nvmlDeviceGetName": b"NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=0, memory=0),
        "nvmlDeviceGetComputeRunningProcesses": [],
        "nvmlDeviceGetGraphicsRunningProcesses": [],
        "nvmlDeviceGetMigMode": (1, 1) if migs else unsupported,
        "nvmlDeviceGetMaxMigDeviceCount": migs,
        "nvmlDeviceGetMigDeviceHandleByIndex": lambda handle, slot: (handle, slot),
        "nvmlDeviceGetC2cModeInfoV": c2c,
        **{reader: link(key) for key, reader in LINK_READERS.items()},
    }
    return SimpleNamespace(
        NVMLError=NvmlError, **{name: called(name, answer) for name, answer in functions.items()}
    )
