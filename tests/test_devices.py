"""Device specifications: parsing, normalising and refusing what this machine lacks."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import devicekit as dk
from devicekit._base import _devices
from devicekit._base._devices import available_devices, resolve_device

from .fakes import machine
from .helpers import META


def test_host_devices_resolve_without_an_index() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu:0") == torch.device("cpu")  # tensors on the CPU say "cpu"
    assert resolve_device(torch.device("meta")) == torch.device("meta")


def test_available_devices_always_lists_the_host_devices() -> None:
    assert available_devices()[-2:] == ["cpu", "meta"]


def test_a_bool_is_not_a_device_index() -> None:
    with pytest.raises(TypeError, match=re.escape("got bool True.")):
        resolve_device(True)


def test_the_device_of_a_spec_does_not_depend_on_what_was_asked_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_devices, "_resolved", {})
    monkeypatch.setattr(_devices, "_default_family", lambda: "meta")  # 0 names a device
    assert _devices.resolve_device(0) == META
    for spec in (False, 0.0, np.float64(0)):
        with pytest.raises(TypeError, match=re.escape("Expected a device as a torch.device")):
            _devices.resolve_device(spec)  # type: ignore[arg-type]
    assert _devices.resolve_device(np.int64(0)) == META  # an integer index is one


def test_a_backend_this_pytorch_lacks_is_refused() -> None:
    msg = (
        "Expected a device of a backend this PyTorch has, got 'xla': no xla backend is "
        "loaded (an extension such as torch_xla registers one when imported)."
    )
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.DeviceManager("xla", backends=machine(70))
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.to_device(torch.ones(1), "xla")


def test_a_long_device_string_is_cut_short_in_the_message() -> None:
    with pytest.raises(dk.DeviceUnavailableError) as info:
        dk.to_device(torch.ones(1), "c" * 100_000)
    assert len(str(info.value)) < 400
    assert "(100,000 characters)" in str(info.value)


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


def test_an_index_pytorch_would_wrap_around_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch keeps an index in 8 bits: "cuda:257" is cuda:1 to it, a GPU not asked for.
    said = "Expected a device index PyTorch can keep, got"
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(f"{said} 'cuda:257', which")):
        dk.DeviceManager("cuda:257", backends=machine(70, 70))
    monkeypatch.setattr(_devices, "_resolved", {})
    monkeypatch.setattr(_devices, "_default_family", lambda: "meta")  # 0 names a device
    for spec, read in [
        ("meta:256", "which it would read as meta:0."),
        (257, "which it would read as meta:1."),
        (255, "which it would read as meta."),  # the current device
        (2**63, "which it cannot hold."),
    ]:
        with pytest.raises(dk.DeviceUnavailableError, match=re.escape(f"{said} {spec!r}, {read}")):
            _devices.resolve_device(spec)
    assert _devices.parse_device(127) == torch.device("meta", 127)  # the largest kept


def test_an_index_of_thousands_of_digits_is_refused_in_devicekit_s_words() -> None:
    # More digits than Python writes out (4,300): its ValueError was the message once.
    index = 10**5000
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape("<an int of 5,001 digits>")):
        dk.to_device(torch.ones(1), index)
    msg = "Expected the index of an accelerator device, got <an int of 5,001 digits>; devices"
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.DeviceManager(index, backends=machine(70))
