"""Fake device families for the DeviceManager tests: any number of GPUs, any free memory."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from devicekit import DeviceInfo, GpuProcess
from devicekit._select._backends import CpuBackend

from .helpers import GiB

if TYPE_CHECKING:
    from collections.abc import Sequence


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
