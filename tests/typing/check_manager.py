"""User code that mypy --strict must accept: DeviceManager as scripts use it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from typing_extensions import assert_type

import devicekit as dk

manager = dk.DeviceManager(prefer=("cuda", "cpu"), min_free_memory="8GiB", fallback="error")
assert_type(manager.device, torch.device)
assert_type(manager.devices, tuple[dk.DeviceInfo, ...])
assert_type(manager.explain(), str)
assert_type(dk.DeviceManager.from_env(policy="most-free-memory"), dk.DeviceManager)
with manager as active:
    assert_type(active, dk.DeviceManager)
    assert_type(dk.current_device(), torch.device)


class OneFakeGpu:
    name = "cuda"
    device_type = "cuda"

    def devices(self) -> Sequence[dk.DeviceInfo]:
        return [dk.DeviceInfo(torch.device("cuda", 0), "cuda", 0, free_memory=1 << 30)]


fake: dk.Backend = OneFakeGpu()
dk.DeviceManager(backends=[fake], policy="local-rank")
