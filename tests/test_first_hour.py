"""A user's first hour: every bad input a probe found gets one sentence, where it is made.

Each test names what the user wrote and checks the message: what was expected, what
came, and where.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis.errors import Unsatisfiable

import devicekit as dk
from devicekit.testing import assert_batches_equal, batches, devices, tensors

from .fakes import machine

META = torch.device("meta")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "DEVICEKIT_DEVICE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


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


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"min_free_memory": "9" * 400 + "GiB"},
            ValueError,
            "Expected min_free_memory as a size a device can have, got '99999",
        ),
        ({"prefer": []}, ValueError, "Expected prefer to list device families among"),
        (
            {"backends": [object()]},
            TypeError,
            (
                "Expected backends with a name, a device_type and devices() (the "
                "devicekit.Backend protocol), got object <object object at"
            ),
        ),
    ],
)
def test_manager_options_are_checked_where_they_are_given(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        dk.DeviceManager(**options)


def test_from_env_takes_a_device_that_the_variable_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert dk.DeviceManager.from_env(device="cpu", backends=machine(70)).device == torch.device(
        "cpu"
    )
    monkeypatch.setenv("DEVICEKIT_DEVICE", "meta")
    manager = dk.DeviceManager.from_env(device="cpu", backends=machine(70))
    assert manager.device == META
    assert manager.reason == "DEVICEKIT_DEVICE asks for it"


def test_guard_takes_a_module() -> None:
    msg = "Expected a torch.nn.Module to guard, got int 5."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.guard(5)  # type: ignore[arg-type]


def test_check_same_device_takes_the_device_by_keyword() -> None:
    msg = (
        "Expected tensors, modules, optimizers or containers of them as the data, and the "
        "device as device=..., got the device 'meta' as data[1]. Write "
        "check_same_device(..., device='meta')."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.check_same_device(torch.ones(1), "meta")


def test_strict_takes_dtypes_devices_and_ranges_as_plain_values() -> None:
    config = {"dtype": torch.float16, "device": torch.device("cpu"), "steps": range(3)}
    assert dk.to_device(config, META, strict=True) == config


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"transform": 5},
            TypeError,
            "Expected transform to be a function of a batch (or None), got int 5.",
        ),
        (
            {"non_blocking": "yes"},
            ValueError,
            "Expected non_blocking to be 'auto', True or False, got 'yes'.",
        ),
    ],
)
def test_loader_options_are_checked_when_it_is_made(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        dk.DeviceDataLoader([torch.ones(1)], META, **options)


def test_a_generator_left_early_is_not_called_used_up() -> None:
    loader = dk.DeviceDataLoader((torch.ones(1) for _ in range(5)), META)
    for _ in loader:
        break
    msg = (
        "Expected a re-iterable loader for another epoch, but the wrapped generator is an "
        "iterator that an earlier epoch already started and left early"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        list(loader)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty."),
        (b"hello, world", "is not one (it begins with b'hello, w')."),
    ],
)
def test_load_says_when_a_file_is_not_a_checkpoint(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(
        ValueError,
        match=re.escape(f"Expected a file written by torch.save, but '{path}' {message}"),
    ):
        dk.load(path, "cpu")


# devicekit.testing


@given(batches(containers="list"))
def test_a_container_kind_named_alone_is_one_kind(batch: Any) -> None:
    def kinds(data: Any) -> set[type]:
        found = {type(data)}
        if isinstance(data, list):
            for item in data:
                found |= kinds(item)
        return found

    assert kinds(batch) <= {list, torch.Tensor, type(None), int, str, bool}


@given(tensors(shapes=(2, 3)))
def test_a_shape_given_as_a_tuple_is_that_shape(tensor: torch.Tensor) -> None:
    assert tensor.shape == (2, 3)


def test_devices_can_be_asked_for_accelerators_only() -> None:
    if torch.cuda.is_available():
        assert find(devices(host=False), lambda d: True).type == "cuda"
    else:
        with pytest.raises(Unsatisfiable):  # it draws nothing: no accelerator here
            find(devices(host=False), lambda d: True, settings=settings(max_examples=10))


def test_batches_equal_takes_nan_for_nan_equal_refuses_cycles_and_takes_deques() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert_batches_equal([nan.clone()], [nan.clone()])
    left: list[Any] = [torch.ones(1)]
    left.append(left)
    right: list[Any] = [torch.ones(1)]
    right.append(right)
    # Compared as to_device walks them: a batch with a cycle is not one it can move.
    msg = "Expected data without reference cycles, but data[1] is the list data itself"
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        assert_batches_equal(left, right)
    assert_batches_equal(collections.deque([torch.ones(2)]), collections.deque([torch.ones(2)]))
    with pytest.raises(AssertionError, match=re.escape("data[0]: values differ")):
        assert_batches_equal([torch.tensor([1.0])], [torch.tensor([float("nan")])])
