"""Device specifications: parsing, normalising and refusing what this machine lacks."""

from __future__ import annotations

import re

import pytest
import torch

import devicekit as dk
from devicekit._devices import available_devices, resolve_device


def test_host_devices_resolve_without_an_index() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu:0") == torch.device("cpu")  # tensors on the CPU say "cpu"
    assert resolve_device(torch.device("meta")) == torch.device("meta")


def test_available_devices_always_lists_the_host_devices() -> None:
    assert available_devices()[-2:] == ["cpu", "meta"]


def test_a_bool_is_not_a_device_index() -> None:
    with pytest.raises(TypeError, match=re.escape("got bool True.")):
        resolve_device(True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cuda_on_a_cpu_only_build_names_the_reason() -> None:
    msg = "Expected an available device, got 'cuda', but this PyTorch build has no CUDA support."
    if torch.backends.cuda.is_built():
        msg = "Expected an available device, got 'cuda', but no cuda device is visible."
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        resolve_device("cuda")


@pytest.mark.cuda
def test_cuda_without_an_index_is_the_current_device() -> None:
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(f"from 0 to {count - 1}")):
        resolve_device(f"cuda:{count}")
