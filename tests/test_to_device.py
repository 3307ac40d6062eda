"""Example tests for every to_device rule, with meta as the second device on CPU machines.

Every test runs twice: once as a move to meta is (the host path), and once with meta
standing in for an accelerator (the walk taken apart and rebuilt, small tensors
packed), so both of to_device's paths keep every rule.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit._transfer import as_accelerator
from devicekit.testing import assert_same_structure

from .helpers import assert_unchanged, snapshot, tensor_leaves

META = torch.device("meta")
CPU = torch.device("cpu")
Point = namedtuple("Point", ["x", "y"])


@pytest.fixture(autouse=True, params=["host path", "accelerator path"])
def to_accelerator(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Whether meta stands in for an accelerator in this run of the test."""
    if request.param == "host path":
        yield False
        return
    with as_accelerator("meta"):
        yield True


class Encoding(UserDict[str, Any]):
    """Like transformers.BatchEncoding: a UserDict with extra state and an in-place .to()."""

    def __init__(self, data: dict[str, Any], encodings: list[str]) -> None:
        super().__init__(data)
        self.encodings = encodings

    def to(self, device: Any) -> Encoding:  # pragma: no cover - must never be called
        raise AssertionError("Mapping subclasses are rebuilt, not moved with their .to()")


@dataclasses.dataclass
class Detection:
    boxes: torch.Tensor
    labels: torch.Tensor
    source: str = "camera"
    area: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.area = self.boxes[:, 2] * self.boxes[:, 3]


@dataclasses.dataclass(frozen=True)
class Frozen:
    image: torch.Tensor
    calls: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.calls.append(1)


class Movable:
    """A user type with its own .to(), recording what it was given."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.received: dict[str, Any] = {}

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Movable:
        moved = Movable(self.tensor.to(device, non_blocking=non_blocking))
        moved.received = {"device": device, "non_blocking": non_blocking}
        return moved


# Containers keep their exact type.


@pytest.mark.parametrize(
    "make",
    [
        lambda t: {"a": t, "b": [t + 1, "s"]},
        lambda t: OrderedDict([("z", t), ("a", t + 1)]),
        lambda t: [t, (t + 1, None), {"k": 3}],
        lambda t: (t,),
        lambda t: Point(t, t + 1),
        lambda t: {t.sum().item(), "x"},
        lambda t: frozenset({1, 2}),
        lambda t: Encoding({"input_ids": t}, encodings=["e"]),
        lambda t: MappingProxyType({"a": t}),
        lambda t: torch.Size([2, 3]),
    ],
    ids=[
        "dict",
        "ordereddict",
        "list",
        "tuple",
        "namedtuple",
        "set",
        "frozenset",
        "userdict",
        "mappingproxy",
        "size",
    ],
)
def test_containers_keep_their_exact_type(make: Any) -> None:
    data = make(torch.arange(3.0))
    moved = dk.to_device(data, META)
    assert type(moved) is type(data)
    assert_same_structure(moved, data)
    assert all(t.device == META for t in tensor_leaves(moved))


def test_defaultdict_keeps_its_factory() -> None:
    data: defaultdict[str, list[torch.Tensor]] = defaultdict(list, {"a": [torch.ones(1)]})
    moved = dk.to_device(data, META)
    assert type(moved) is defaultdict
    assert moved.default_factory is list
    assert moved["missing"] == []
    assert "missing" not in data


def test_mapping_subclass_keeps_attributes_and_is_not_moved_with_its_own_to() -> None:
    data = Encoding({"input_ids": torch.ones(2)}, encodings=["tokens"])
    moved = dk.to_device(data, META)
    assert moved.encodings == ["tokens"]
    assert moved["input_ids"].device == META
    assert data["input_ids"].device == CPU


def test_ordered_dict_keeps_its_order() -> None:
    data = OrderedDict([("z", torch.ones(1)), ("a", torch.zeros(1)), ("m", 1)])
    assert list(dk.to_device(data, META)) == ["z", "a", "m"]


def test_dataclass_is_copied_with_fields_outside_init() -> None:
    data = Detection(torch.ones(2, 4), torch.tensor([1, 2]))
    moved = dk.to_device(data, META)
    assert type(moved) is Detection
    assert moved is not data
    assert (moved.boxes.device, moved.labels.device, moved.area.device) == (META, META, META)
    assert moved.source == "camera"
    assert data.area.device == CPU


def test_frozen_dataclass_is_rebuilt_without_running_its_init_again() -> None:
    data = Frozen(torch.ones(2))
    moved = dk.to_device(data, META)
    assert type(moved) is Frozen
    assert moved.image.device == META
    assert data.image.device == CPU
    assert moved.calls == [1]  # __post_init__ ran once, when the user made it


def test_str_and_bytes_are_leaves_not_sequences() -> None:
    data = {"name": "image.png", "raw": b"\x00\x01", "tensor": torch.ones(1)}
    moved = dk.to_device(data, META)
    assert moved["name"] == "image.png"
    assert moved["raw"] == b"\x00\x01"


def test_other_leaves_come_back_unchanged() -> None:
    array = np.zeros(3)
    marker = object()
    data = [1, 2.5, None, array, marker, True]
    moved = dk.to_device(data, META)
    assert moved == [1, 2.5, None, array, marker, True]
    assert moved[3] is array
    assert moved[4] is marker


# Tensors.


def test_values_survive_a_cpu_round_trip_through_dtypes() -> None:
    data = {"x": torch.randn(4, 3), "ids": torch.arange(5), "mask": torch.tensor([True, False])}
    moved = dk.to_device(data, CPU, dtype=torch.float64)
    assert moved["x"].dtype == torch.float64
    assert torch.equal(moved["x"], data["x"].double())
    assert moved["ids"] is data["ids"]
    assert moved["mask"] is data["mask"]


def test_dtype_casts_floating_point_tensors_only() -> None:
    data = [torch.ones(2), torch.ones(2, dtype=torch.float64), torch.arange(2), torch.ones(1) > 0]
    moved = dk.to_device(data, META, dtype=torch.bfloat16)
    assert [t.dtype for t in moved] == [torch.bfloat16, torch.bfloat16, torch.int64, torch.bool]


def test_a_tensor_already_on_the_target_is_returned_as_is() -> None:
    tensor = torch.ones(3)
    assert dk.to_device(tensor, CPU) is tensor
    assert dk.to_device({"t": tensor}, "cpu")["t"] is tensor
    assert dk.to_device(tensor, CPU, dtype=torch.float32) is tensor


def test_copy_returns_new_tensors_even_on_the_target() -> None:
    tensor = torch.ones(3)
    copied = dk.to_device([tensor, tensor], CPU, copy=True)
    assert copied[0] is not tensor
    assert copied[0] is copied[1]
    assert torch.equal(copied[0], tensor)
    copied[0].add_(1)
    assert torch.equal(tensor, torch.ones(3))


def test_memory_format_applies_to_four_dimensional_tensors_only() -> None:
    data = {"image": torch.randn(2, 3, 4, 4), "label": torch.arange(2)}
    moved = dk.to_device(data, CPU, memory_format=torch.channels_last)
    assert moved["image"].is_contiguous(memory_format=torch.channels_last)
    assert not data["image"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(moved["image"], data["image"])
    assert moved["label"] is data["label"]


def test_channels_last_3d_applies_to_five_dimensional_tensors() -> None:
    volume = torch.randn(1, 2, 3, 3, 3)
    moved = dk.to_device(volume, CPU, memory_format=torch.channels_last_3d)
    assert moved.is_contiguous(memory_format=torch.channels_last_3d)


def test_aliasing_is_preserved() -> None:
    shared = torch.ones(2)
    data = {"a": shared, "b": [shared, (shared,)], "other": torch.ones(2)}
    moved = dk.to_device(data, META)
    assert moved["a"] is moved["b"][0] is moved["b"][1][0]
    assert moved["other"] is not moved["a"]


def test_the_input_is_never_mutated() -> None:
    data = {"x": torch.ones(2), "nested": [torch.zeros(3), {"y": torch.arange(2)}], "n": 4}
    before = snapshot(data)
    dk.to_device(data, META, dtype=torch.float16)
    assert_unchanged(data, before)
    assert data["n"] == 4


def test_gradients_flow_through_a_move() -> None:
    weight = torch.ones(3, requires_grad=True)
    moved = dk.to_device({"w": weight}, CPU, dtype=torch.float64)["w"]
    moved.sum().backward()
    assert weight.grad is not None
    assert torch.equal(weight.grad, torch.ones(3))


class Tagged(torch.Tensor):
    """A tensor subclass that keeps its type through PyTorch's ops, as most do."""


def test_parameters_and_tensor_subclasses_move_and_keep_their_type() -> None:
    param = nn.Parameter(torch.ones(2))
    tagged = torch.ones(3).as_subclass(Tagged)
    frozen = nn.Parameter(torch.ones(1), requires_grad=False)
    moved = dk.to_device([param, tagged, frozen, param], META)
    assert type(moved[0]) is nn.Parameter
    assert moved[0].device == META
    assert moved[0].requires_grad
    assert moved[0].is_leaf  # a parameter of its own, not a copy with a graph to the old
    assert moved[0] is moved[3]  # found twice, moved once
    assert type(moved[1]) is Tagged
    assert moved[1].device == META
    assert type(moved[2]) is nn.Parameter
    assert not moved[2].requires_grad
    assert param.device == CPU


# Modules and optimizers.


def test_modules_move_in_place_and_are_returned() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    data = {"model": model, "x": torch.ones(1, 2)}
    moved = dk.to_device(data, CPU, dtype=torch.float64)
    assert moved["model"] is model
    assert all(p.dtype == torch.float64 for p in model.parameters())
    # Integer buffers (BatchNorm's counter) keep their dtype, as in Module.to.
    assert model[1].num_batches_tracked.dtype == torch.int64


def test_module_moves_to_meta() -> None:
    model = nn.Linear(2, 2)
    assert dk.to_device(model, META) is model
    assert model.weight.device == META


def test_module_memory_format() -> None:
    model = nn.Conv2d(3, 4, 3)
    dk.to_device(model, CPU, memory_format=torch.channels_last)
    assert model.weight.is_contiguous(memory_format=torch.channels_last)


def _trained_adam(model: nn.Module, **options: Any) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), **options)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return optimizer


@pytest.mark.usefixtures("swap_module_params")
def test_optimizer_state_follows_the_parameters() -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    dk.to_device(model, META)
    assert dk.to_device(optimizer, META) is optimizer
    state = optimizer.state[model.weight]
    assert state["exp_avg"].device == META
    assert state["exp_avg_sq"].device == META
    # "step" stays on the host unless the optimizer is capturable or fused, as in PyTorch.
    assert state["step"].device == CPU


@pytest.mark.usefixtures("swap_module_params")
def test_capturable_optimizer_moves_its_step() -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    for group in optimizer.param_groups:
        group["capturable"] = True
    dk.to_device(model, META)
    dk.to_device(optimizer, META)
    assert optimizer.state[model.weight]["step"].device == META


def test_optimizer_state_takes_the_dtype_of_its_parameters() -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    dk.to_device(model, CPU, dtype=torch.float64)
    dk.to_device(optimizer, CPU)
    assert optimizer.state[model.weight]["exp_avg"].dtype == torch.float64
    assert optimizer.state[model.weight]["step"].dtype == torch.float32


def test_an_optimizer_whose_model_stayed_behind_is_refused() -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    msg = (
        "Cannot move data['optimizer'] (an optimizer) to meta: its state follows its parameters, "
        "and param_groups[0]['params'][0] is on cpu."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"optimizer": optimizer}, META)
    assert optimizer.state[model.weight]["exp_avg"].device == CPU


def test_copy_of_a_module_is_refused() -> None:
    msg = (
        "Cannot copy data[0]: the module Linear moves in place, so copy=True cannot give a "
        "separate copy. Use copy.deepcopy on it first, then move the copy."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device([nn.Linear(1, 1)], CPU, copy=True)


# Objects with .to() and registered types.


def test_objects_with_a_to_method_move_with_it() -> None:
    data = {"thing": Movable(torch.ones(2))}
    moved = dk.to_device(data, META, non_blocking=True)
    assert moved["thing"].tensor.device == META
    assert moved["thing"].received == {"device": META, "non_blocking": True}


def test_packed_sequence_moves_with_its_own_to() -> None:
    packed = nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    moved = dk.to_device({"seq": packed}, META)["seq"]
    assert type(moved) is nn.utils.rnn.PackedSequence
    assert moved.data.device == META
    assert moved.batch_sizes.device == CPU  # PackedSequence.to keeps these on the host


def test_the_to_signature_is_read_once_per_type(to_accelerator: bool) -> None:
    calls: list[tuple[Any, ...]] = []

    class Counted:
        def to(self, device: torch.device, **options: Any) -> Counted:
            calls.append((device, options))
            return self

    dk.to_device([Counted(), Counted()], META, dtype=torch.float16)
    # Objects that move themselves get non_blocking only where their copies need no wait,
    # and never dtype, which their .to() would apply to every tensor they hold.
    asked = {"non_blocking": True} if to_accelerator else {}
    assert calls == [(META, asked)] * 2


class Sample:
    """A user type whose .to() hands every option to every tensor, ids included."""

    def __init__(self, image: torch.Tensor, ids: torch.Tensor) -> None:
        self.image = image
        self.ids = ids

    def to(self, *args: Any, **kwargs: Any) -> Sample:
        return Sample(self.image.to(*args, **kwargs), self.ids.to(*args, **kwargs))


def test_options_a_to_method_does_not_take_are_applied_inside_it() -> None:
    sample = Sample(torch.ones(1, 3, 2, 2), torch.tensor([70001]))
    moved = dk.to_device(
        {"sample": sample}, META, dtype=torch.float16, memory_format=torch.channels_last
    )["sample"]
    assert moved.image.dtype == torch.float16
    assert moved.image.is_contiguous(memory_format=torch.channels_last)
    assert moved.ids.dtype == torch.int64  # never cast: an id is not a float
    assert sample.image.dtype == torch.float32  # the input is untouched
    assert sample.image.device == CPU
    copied = dk.to_device(sample, CPU, copy=True, dtype=torch.float64)
    assert copied.ids is not sample.ids
    assert copied.ids.tolist() == [70001]
    assert copied.image.dtype == torch.float64


def test_a_to_method_returning_none_is_refused() -> None:
    class InPlace:
        def to(self, device: torch.device) -> None:
            pass

    msg = (
        "Cannot move data[1]: InPlace.to() returned None for the InPlace there; expected the "
        "moved object. A method that moves in place must return self."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device([1, InPlace()], META)


def test_registered_rules_win_over_to_and_containers(to_accelerator: bool) -> None:
    seen: list[dict[str, Any]] = []

    @dataclasses.dataclass
    class Boxes:
        xyxy: torch.Tensor

        def to(self, device: torch.device) -> Boxes:  # pragma: no cover - the rule wins
            raise AssertionError("the registered rule must win over .to()")

    @dk.register_transfer(Boxes)
    def move_boxes(boxes: Boxes, device: torch.device, **options: Any) -> Boxes:
        seen.append(options)
        return Boxes(boxes.xyxy.to(device))

    class SubBoxes(Boxes):
        pass

    moved = dk.to_device({"b": Boxes(torch.ones(1, 4)), "s": SubBoxes(torch.ones(1, 4))}, META)
    assert type(moved["b"]) is Boxes
    assert moved["b"].xyxy.device == META
    assert moved["s"].xyxy.device == META  # subclasses use their base's rule
    assert seen[0] == {
        "non_blocking": to_accelerator,
        "dtype": None,
        "copy": False,
        "memory_format": torch.preserve_format,
    }


def test_registering_a_rule_replaces_cached_decisions() -> None:
    class Late:
        pass

    late = Late()
    assert dk.to_device([late], META)[0] is late

    @dk.register_transfer(Late)
    def move_late(obj: Late, device: torch.device, **options: Any) -> Late:
        moved = Late()
        moved.device = device  # type: ignore[attr-defined]
        return moved

    assert dk.to_device([late], META)[0].device == META


def test_a_registered_rule_returning_none_is_refused() -> None:
    class Broken:
        pass

    @dk.register_transfer(Broken)
    def move_broken(obj: Broken, device: torch.device, **options: Any) -> None:
        return None

    msg = "Cannot move data['x']: the rule registered for Broken returned None"
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"x": Broken()}, META)


def test_register_transfer_refuses_what_is_not_a_user_class() -> None:
    with pytest.raises(TypeError, match=re.escape("Expected a class to register")):
        dk.register_transfer("Boxes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("Register a tensor subclass instead.")):
        dk.register_transfer(torch.Tensor)


# strict=True.


def test_strict_refuses_leaves_it_cannot_move_and_names_their_path() -> None:
    msg = (
        "Cannot move data['meta'][1]: it is a numpy.ndarray, which is neither a tensor, a "
        "container, a type with a .to() method, a registered type, nor a plain scalar."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"meta": [1, np.zeros(2)]}, META, strict=True)


def test_strict_accepts_plain_scalars_modules_and_optimizers() -> None:
    model = nn.Linear(1, 1)
    data = [None, True, 1, 2.0, 3j, "s", b"b", model, torch.optim.SGD(model.parameters())]
    moved = dk.to_device(data, CPU, strict=True)
    assert moved[:7] == data[:7]


# Structural errors.


def test_a_reference_cycle_is_reported_with_its_path() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    msg = (
        "Expected data without reference cycles, but data['batch'][1] is the list "
        "data['batch'] itself, which contains it."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"batch": loop}, META)


def test_a_dict_cycle_is_reported_with_its_path() -> None:
    inner: dict[str, Any] = {}
    outer = {"a": [inner]}
    inner["back"] = outer
    msg = "but data['a'][0]['back'] is the dict data itself, which contains it."
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device(outer, META)


def _nested(depth: int) -> Any:
    data: Any = torch.ones(1)
    for _ in range(depth):
        data = [data]
    return data


def test_ten_thousand_levels_are_fine() -> None:
    moved = dk.to_device(_nested(10_000), META)
    for _ in range(10_000):
        moved = moved[0]
    assert moved.device == META


def test_deeper_than_ten_thousand_levels_is_refused_without_recursion_error() -> None:
    msg = (
        "Expected data nested at most 10,000 containers deep, but "
        "data[0][0][0][0][0][0][0][0]...<9,984 more levels>...[0][0][0][0][0][0][0][0] goes deeper."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device(_nested(10_001), META)


def test_a_meta_tensor_cannot_move_to_a_real_device() -> None:
    msg = (
        "Cannot move data['weights'][0] to cpu: it is a tensor on the meta device, which has a "
        "shape but no data."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"weights": [torch.ones(2, device="meta")]}, CPU)


def test_errors_from_user_code_keep_their_type_and_gain_the_path() -> None:
    class Exploding:
        def to(self, device: torch.device) -> Exploding:
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as info:
        dk.to_device({"x": [Exploding()]}, META)
    assert info.value.__notes__ == ["devicekit: raised while handling data['x'][0] (Exploding)."]


# Options and devices.


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"non_blocking": "yes"}, "Expected non_blocking to be 'auto', True or False, got 'yes'."),
        ({"non_blocking": 1}, "Expected non_blocking to be 'auto', True or False, got 1."),
        (
            {"dtype": torch.int64},
            (
                "Expected dtype to be None or a floating-point dtype such as torch.float16 or "
                "torch.bfloat16, got torch.int64"
            ),
        ),
        (
            {"memory_format": "channels_last"},
            (
                "Expected memory_format to be None or a torch.memory_format such as "
                "torch.channels_last, got 'channels_last'."
            ),
        ),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        dk.to_device(torch.ones(1), CPU, **options)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (
            "gpu",
            "Expected a device such as 'cpu', 'cuda', 'cuda:0', 'mps', 'xpu' or 'meta', got 'gpu'.",
        ),
        (
            "cuda:abc",
            (
                "Expected a device such as 'cpu', 'cuda', 'cuda:0', 'mps', 'xpu' or 'meta', "
                "got 'cuda:abc'."
            ),
        ),
        (
            "cuda:-1",
            (
                "Expected a device such as 'cpu', 'cuda', 'cuda:0', 'mps', 'xpu' or 'meta', "
                "got 'cuda:-1'."
            ),
        ),
    ],
)
def test_device_specs_that_do_not_parse_are_refused(device: str, message: str) -> None:
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(message)):
        dk.to_device(torch.ones(1), device)


def test_a_device_spec_of_the_wrong_type_is_refused() -> None:
    msg = (
        "Expected a device as a torch.device, a string such as 'cpu', 'cuda', 'cuda:0', 'mps', "
        "'xpu' or 'meta', or an index, got float 1.5."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.to_device(torch.ones(1), 1.5)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_an_absent_accelerator_is_refused_with_the_devices_that_exist() -> None:
    with pytest.raises(dk.DeviceUnavailableError, match=r"Available here: .*'cpu', 'meta'\.$"):
        dk.to_device(torch.ones(1), "cuda:7")
    msg = "Expected an accelerator for the device index 0, but this machine has none."
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
        dk.to_device(torch.ones(1), 0)


def test_device_none_means_the_current_device() -> None:
    with dk.DeviceManager("meta"):
        assert dk.to_device({"x": torch.ones(1)})["x"].device == META


def test_non_blocking_auto_on_host_targets_is_safe_to_read() -> None:
    data = {"x": torch.arange(6.0)}
    moved = dk.to_device(data, CPU, copy=True, non_blocking="auto")
    assert torch.equal(moved["x"], torch.arange(6.0))
