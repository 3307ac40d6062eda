"""Example tests for every to_device rule, on both of to_device's paths.

Every test runs twice (the ``target`` fixture): once to meta, as a move to the host's
devices goes (the host path), and once to the stand-in accelerator of
:func:`devicekit.testing.stand_in` (the walk taken apart and rebuilt, asynchronous
copies), whose values are real: so both paths keep every rule, and on the accelerator
path what arrives is checked too. The accelerator path runs last (tests/conftest.py):
the stand-in stays started once started. Packing has tests of its own (test_packing.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import re
import shelve
from collections import ChainMap, OrderedDict, UserDict, UserList, defaultdict, deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit._core._transfer import as_accelerator
from devicekit.testing import assert_batches_equal, assert_same_structure

from .helpers import CPU, META, Pair, assert_unchanged, snapshot, tensor_leaves


@pytest.fixture(
    autouse=True,
    params=["host path", pytest.param("accelerator path", marks=pytest.mark.stand_in)],
)
def target(request: pytest.FixtureRequest) -> torch.device:
    """Where this run of the test moves data: meta, or the stand-in accelerator."""
    if request.param == "host path":
        return META
    device: torch.device = request.getfixturevalue("stand_in_device")
    return device


@contextlib.contextmanager
def meta_standing_in(target: torch.device) -> Iterator[torch.device]:
    """meta, standing in for an accelerator where ``target`` is the stand-in.

    For what the stand-in cannot carry: a tensor subclass cannot move there (its tensors
    are a wrapper of their own), and a Parameter there is a stand-in tensor marked as
    one, not of type nn.Parameter
    (:func:`test_parameters_and_tensor_subclasses_move_and_keep_their_type`).
    """
    if target == META:
        yield META
        return
    with as_accelerator("meta"):
        yield META


def assert_arrived(moved: Any, data: Any, target: torch.device) -> None:
    """``moved`` is ``data`` on ``target``: its structure, and its values where it has them.

    On the stand-in it is compared on its way back to the host, values included:
    assert_same_structure takes a stand-in tensor (a StandInTensor) for another type than
    a CPU tensor.
    """
    assert all(t.device == target for t in tensor_leaves(moved))
    if target == META:
        assert_same_structure(moved, data)
    else:
        assert_batches_equal(dk.to_device(moved, CPU), data)


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


# Containers keep their exact type, and every key its value.


@pytest.mark.parametrize(
    "make",
    [
        lambda t: {"a": t, "b": [t + 1, "s"]},
        lambda t: OrderedDict([("z", t), ("a", t + 1)]),
        lambda t: [t, (t + 1, None), {"k": 3}],
        lambda t: (t,),
        lambda t: Pair(t, t + 1),
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
def test_containers_keep_their_exact_type(make: Any, target: torch.device) -> None:
    data = make(torch.arange(3.0))
    moved = dk.to_device(data, target)
    assert type(moved) is type(data)
    assert_arrived(moved, data, target)


def test_defaultdict_keeps_its_factory(target: torch.device) -> None:
    data: defaultdict[str, list[torch.Tensor]] = defaultdict(list, {"a": [torch.ones(1)]})
    moved = dk.to_device(data, target)
    assert type(moved) is defaultdict
    assert moved.default_factory is list
    assert moved["missing"] == []
    assert "missing" not in data


def test_mapping_subclass_keeps_attributes_and_is_not_moved_with_its_own_to(
    target: torch.device,
) -> None:
    data = Encoding({"input_ids": torch.ones(2)}, encodings=["tokens"])
    moved = dk.to_device(data, target)
    assert moved.encodings == ["tokens"]
    assert moved["input_ids"].device == target
    assert_arrived(moved, data, target)
    assert data["input_ids"].device == CPU


def test_ordered_dict_keeps_its_order(target: torch.device) -> None:
    data = OrderedDict([("z", torch.ones(1)), ("a", torch.zeros(1)), ("m", 1)])
    assert list(dk.to_device(data, target)) == ["z", "a", "m"]


class SortedIter(dict[str, Any]):
    """A dict whose __iter__ is sorted, unlike its storage (and its values())."""

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(dict.__iter__(self)))


def test_values_stay_with_their_keys_whatever_iter_says() -> None:
    batch = SortedIter(labels=torch.tensor([1, 2]), image=torch.ones(2, 3))
    moved = dk.to_device(batch, CPU, dtype=torch.float16)
    assert type(moved) is SortedIter
    assert moved["image"].shape == (2, 3)
    assert moved["image"].dtype == torch.float16  # the cast hits the image
    assert moved["labels"].tolist() == [1, 2]
    assert moved["labels"].dtype == torch.int64
    paths = dk.find_devices(batch)[CPU]
    assert sorted(paths) == ["['image']", "['labels']"]


class ReversedKeys(UserDict[str, Any]):
    def keys(self) -> Any:  # out of order with .data, as a careless subclass might be
        return reversed(list(self.data))


def test_a_user_dict_keeps_its_pairs_and_shares_nothing(target: torch.device) -> None:
    batch = ReversedKeys({"ids": torch.arange(3), "mask": torch.ones(3, dtype=torch.bool)})
    batch.extra = "kept"  # type: ignore[attr-defined]
    moved = dk.to_device(batch, target)
    assert moved.data is not batch.data
    assert moved["ids"].dtype == torch.int64
    assert moved["mask"].dtype == torch.bool
    assert moved.extra == "kept"  # type: ignore[attr-defined]
    assert batch["ids"].device == CPU


def test_deques_and_user_lists_are_rebuilt_and_seen(target: torch.device) -> None:
    window: deque[torch.Tensor] = deque([torch.ones(1), torch.zeros(1)], maxlen=5)
    users = UserList([torch.ones(2)])
    moved = dk.to_device({"window": window, "users": users}, target)
    assert type(moved["window"]) is deque
    assert moved["window"].maxlen == 5
    assert all(t.device == target for t in moved["window"])
    assert type(moved["users"]) is UserList
    assert moved["users"][0].device == target
    assert_arrived(moved, {"window": window, "users": users}, target)
    assert users[0].device == CPU
    found = dk.find_devices({"window": window, "users": users})
    assert found == {CPU: ["['window'][0]", "['window'][1]", "['users'][0]"]}
    msg = "cpu has data['window'][0] and data['window'][1]."
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        dk.check_same_device({"window": window}, device="meta")


def test_str_and_bytes_are_leaves_not_sequences(target: torch.device) -> None:
    data = {"name": "image.png", "raw": b"\x00\x01", "tensor": torch.ones(1)}
    moved = dk.to_device(data, target)
    assert moved["name"] == "image.png"
    assert moved["raw"] == b"\x00\x01"


def test_other_leaves_come_back_unchanged(target: torch.device) -> None:
    array = np.zeros(3)
    marker = object()
    data = [1, 2.5, None, array, marker, True]
    moved = dk.to_device(data, target)
    assert moved == [1, 2.5, None, array, marker, True]
    assert moved[3] is array
    assert moved[4] is marker


# Containers it cannot rebuild as the same type are refused, the input left as it was.


def test_a_shelf_is_refused_and_its_file_keeps_its_data(
    tmp_path: Path, target: torch.device
) -> None:
    with shelve.open(str(tmp_path / "db")) as shelf:
        shelf["w"] = torch.arange(3.0)
        msg = (
            "Cannot rebuild data: it is a shelve.DbfilenameShelf, a mutable mapping whose copy "
            "could share its contents with the original. Register how to move it with "
            "@devicekit.register_transfer(DbfilenameShelf)."
        )
        with pytest.raises(dk.TransferError, match=re.escape(msg)):
            dk.to_device(shelf, target)
    with shelve.open(str(tmp_path / "db")) as shelf:
        assert torch.equal(shelf["w"], torch.arange(3.0))


def test_a_chain_map_is_refused_and_left_as_it_was(target: torch.device) -> None:
    first, second = {"a": torch.ones(1)}, {"b": torch.zeros(1)}
    chain = ChainMap(first, second)
    with pytest.raises(dk.TransferError, match=re.escape("Cannot rebuild data['x']: it is a")):
        dk.to_device({"x": chain}, target)
    assert chain.maps == [first, second]
    assert first["a"].device == CPU
    assert second["b"].device == CPU
    assert list(first) == ["a"]


class Ring(Sequence[Any]):
    """A Sequence devicekit has no rule for."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


def test_sequences_and_object_arrays_it_cannot_rebuild_are_refused(target: torch.device) -> None:
    msg = (
        "Cannot rebuild data['ring']: it is a tests.test_to_device.Ring, a "
        "Sequence that devicekit cannot rebuild as the same type. Register how to move it "
        "with @devicekit.register_transfer(Ring)."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"ring": Ring([torch.ones(1)])}, target)
    holder = np.empty(2, dtype=object)
    holder[0], holder[1] = torch.ones(1), "label"
    msg = (
        "Cannot move data['boxes']: it is a numpy array of objects holding tensors, which "
        "devicekit cannot move inside it. Make it a list (array.tolist()), or register how "
        "to move it with @devicekit.register_transfer(numpy.ndarray)."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"boxes": holder}, target)
    numbers = np.arange(3)
    assert dk.to_device({"n": numbers}, target)["n"] is numbers  # plain arrays stay leaves
    assert dk.to_device([range(3)], target, strict=True) == [range(3)]


class NeedsArgDict(collections.OrderedDict[str, Any]):
    def __init__(self, name: str, **items: Any) -> None:
        super().__init__(**items)
        self.name = name


class NeedsArgDefaultDict(collections.defaultdict[str, Any]):
    def __init__(self, name: str) -> None:
        super().__init__(list)
        self.name = name


class NeedsArgTuple(tuple[Any, ...]):
    def __new__(cls, first: Any, second: Any) -> NeedsArgTuple:
        return super().__new__(cls, (first, second))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: NeedsArgDict("n", x=torch.ones(1)), "which copy.copy cannot copy ("),
        (lambda: NeedsArgDefaultDict("n"), "which copy.copy cannot copy ("),
        (
            lambda: NeedsArgTuple(torch.ones(1), 2),
            "which cannot be built from a list of its items (",
        ),
    ],
    ids=["OrderedDict", "defaultdict", "tuple"],
)
def test_a_subclass_whose_constructor_needs_arguments_is_named(
    make: Any, why: str, target: torch.device
) -> None:
    container = make()
    if isinstance(container, dict):
        container["x"] = torch.ones(1)
    name = type(container).__name__
    with pytest.raises(dk.TransferError) as caught:
        dk.to_device({"k": container}, target)
    message = str(caught.value)
    assert message.startswith(f"Cannot rebuild data['k']: it is a {__name__}.{name}, {why}")
    assert message.endswith(f"Register how to move it with @devicekit.register_transfer({name}).")


# Dataclasses are rebuilt without running user code again. (Frozen ones were rebuilt
# with dataclasses.replace, which runs __init__ and __post_init__ again; the others were
# copied and had their fields replaced. Each kind has a rule here that a second
# __post_init__, or a rebuild that needs the InitVar again, would break.)


def test_dataclass_is_copied_with_fields_outside_init(target: torch.device) -> None:
    data = Detection(torch.ones(2, 4), torch.tensor([1, 2]))
    moved = dk.to_device(data, target)
    assert type(moved) is Detection
    assert moved is not data
    assert (moved.boxes.device, moved.labels.device, moved.area.device) == (target, target, target)
    assert_arrived(moved, data, target)
    assert moved.source == "camera"
    assert data.area.device == CPU


def test_frozen_dataclass_is_rebuilt_without_running_its_init_again(target: torch.device) -> None:
    data = Frozen(torch.ones(2))
    moved = dk.to_device(data, target)
    assert type(moved) is Frozen
    assert moved.image.device == target
    assert data.image.device == CPU
    assert moved.calls == [1]  # __post_init__ ran once, when the user made it


@dataclasses.dataclass(frozen=True)
class Doubled:
    x: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "x", self.x * 2)  # run twice, 1 becomes 4


@dataclasses.dataclass(frozen=True)
class FrozenScaled:
    x: torch.Tensor
    scale: dataclasses.InitVar[int] = 1
    y: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self, scale: int) -> None:
        object.__setattr__(self, "y", self.x * scale)  # run again: the default scale


@dataclasses.dataclass(frozen=True)
class FrozenNeedsScale:
    x: torch.Tensor
    scale: dataclasses.InitVar[int]

    def __post_init__(self, scale: int) -> None:
        object.__setattr__(self, "x", self.x * scale)  # replace() would need scale


@dataclasses.dataclass
class Scaled:
    x: torch.Tensor
    scale: dataclasses.InitVar[int] = 1
    y: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self, scale: int) -> None:
        self.y = self.x * scale


@dataclasses.dataclass
class WithCache:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.norm = self.x.abs()  # an attribute outside the fields

    @functools.cached_property
    def total(self) -> torch.Tensor:
        return self.x.sum()


def test_dataclasses_are_rebuilt_without_running_user_code_again() -> None:
    doubled = dk.to_device(Doubled(torch.tensor([1.0])), CPU, copy=True)
    assert doubled.x.tolist() == [2.0]  # not 4: __post_init__ did not run again
    scaled = dk.to_device(FrozenScaled(torch.tensor([1.0]), 3), CPU, copy=True)
    assert scaled.y.tolist() == [3.0]  # not 1: the InitVar is not needed again
    needs = dk.to_device(FrozenNeedsScale(torch.tensor([1.0]), 5), CPU, copy=True)
    assert needs.x.tolist() == [5.0]  # no "must be specified with replace()"
    # Not frozen: every field moves, the one __post_init__ computed too.
    source = Scaled(torch.tensor([1.0]), 3)
    moved = dk.to_device(source, CPU, copy=True)
    assert moved.y.tolist() == [3.0]
    assert moved.y is not source.y


def test_dataclass_attributes_move_and_cached_values_do_not_stay_stale(
    target: torch.device,
) -> None:
    data = WithCache(torch.ones(2))
    assert data.total.device == CPU  # cached on the input
    moved = dk.to_device(data, target)
    assert moved.x.device == target
    assert moved.norm.device == target  # set in __post_init__: moved too
    assert "total" not in vars(moved)
    assert moved.total.device == target  # computed afresh from the moved field
    assert_arrived(moved.total, data.total, target)
    assert data.x.device == CPU


@dataclasses.dataclass
class Later:
    x: torch.Tensor
    y: torch.Tensor = dataclasses.field(init=False)  # set later, or never


def test_a_dataclass_field_never_set_stays_unset(target: torch.device) -> None:
    moved = dk.to_device({"sample": Later(torch.ones(1))}, target)["sample"]
    assert moved.x.device == target
    assert not hasattr(moved, "y")
    assert dk.find_devices({"sample": Later(torch.ones(1))}) == {CPU: ["['sample'].x"]}


# Tensors.


def test_values_survive_a_cpu_round_trip_through_dtypes() -> None:
    data = {"x": torch.randn(4, 3), "ids": torch.arange(5), "mask": torch.tensor([True, False])}
    moved = dk.to_device(data, CPU, dtype=torch.float64)
    assert moved["x"].dtype == torch.float64
    assert torch.equal(moved["x"], data["x"].double())
    assert moved["ids"] is data["ids"]
    assert moved["mask"] is data["mask"]


def test_dtype_casts_floating_point_tensors_only(target: torch.device) -> None:
    data = [torch.ones(2), torch.ones(2, dtype=torch.float64), torch.arange(2), torch.ones(1) > 0]
    moved = dk.to_device(data, target, dtype=torch.bfloat16)
    assert [t.dtype for t in moved] == [torch.bfloat16, torch.bfloat16, torch.int64, torch.bool]
    assert_arrived(moved, [data[0].bfloat16(), data[1].bfloat16(), data[2], data[3]], target)


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


def test_aliasing_is_preserved(target: torch.device) -> None:
    shared = torch.ones(2)
    data = {"a": shared, "b": [shared, (shared,)], "other": torch.ones(2)}
    moved = dk.to_device(data, target)
    assert moved["a"] is moved["b"][0] is moved["b"][1][0]
    assert moved["other"] is not moved["a"]
    assert_arrived(moved, data, target)


def test_the_input_is_never_mutated(target: torch.device) -> None:
    data = {"x": torch.ones(2), "nested": [torch.zeros(3), {"y": torch.arange(2)}], "n": 4}
    before = snapshot(data)
    dk.to_device(data, target, dtype=torch.float16)
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


def test_parameters_and_tensor_subclasses_move_and_keep_their_type(target: torch.device) -> None:
    param = nn.Parameter(torch.ones(2))
    tagged = torch.ones(3).as_subclass(Tagged)
    frozen = nn.Parameter(torch.ones(1), requires_grad=False)
    # Not on the stand-in: a tensor subclass cannot hold its tensors, and a Parameter of
    # its own is a stand-in tensor marked as one (its type is not nn.Parameter).
    with meta_standing_in(target):
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


def test_a_module_moves_to_the_target(target: torch.device) -> None:
    model = nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    assert dk.to_device(model, target) is model
    assert model.weight.device == target
    assert_arrived(model.weight.detach(), weight, target)


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
def test_optimizer_state_follows_the_parameters(target: torch.device) -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    dk.to_device(model, target)
    assert dk.to_device(optimizer, target) is optimizer
    state = optimizer.state[model.weight]
    assert state["exp_avg"].device == target
    assert state["exp_avg_sq"].device == target
    # "step" stays on the host unless the optimizer is capturable or fused, as in PyTorch.
    assert state["step"].device == CPU


@pytest.mark.usefixtures("swap_module_params")
def test_capturable_optimizer_moves_its_step(target: torch.device) -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    for group in optimizer.param_groups:
        group["capturable"] = True
    dk.to_device(model, target)
    dk.to_device(optimizer, target)
    assert optimizer.state[model.weight]["step"].device == target


def test_optimizer_state_takes_the_dtype_of_its_parameters() -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    dk.to_device(model, CPU, dtype=torch.float64)
    dk.to_device(optimizer, CPU)
    assert optimizer.state[model.weight]["exp_avg"].dtype == torch.float64
    assert optimizer.state[model.weight]["step"].dtype == torch.float32


@dataclasses.dataclass
class FooState:
    exp_avg: torch.Tensor
    step: int


class FooOptimizer(torch.optim.Optimizer):
    """An optimizer whose per-parameter state is a dataclass, as in Lightning's tests."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param] = FooState(torch.zeros_like(param), 1)


@pytest.mark.usefixtures("swap_module_params")
def test_an_optimizer_whose_state_is_a_dataclass_moves(target: torch.device) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = FooOptimizer(model.parameters())
    optimizer.step()
    dk.to_device(model, target)
    dk.to_device(optimizer, target)
    state = optimizer.state[model.weight]
    assert isinstance(state, FooState)
    assert state.exp_avg.device == target
    assert state.step == 1


@dataclasses.dataclass
class Momentum:
    buffer: torch.Tensor
    step: torch.Tensor


class DataclassSGD(torch.optim.Optimizer):
    """An optimizer whose per-parameter state is a dataclass, not a dict."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if state is None:
                    state = self.state[param] = Momentum(torch.zeros_like(param), torch.tensor(0.0))
                state.buffer.mul_(0.9).add_(param.grad)
                state.step += 1


def test_dataclass_optimizer_state_follows_its_parameters_dtype_as_dict_state_does() -> None:
    model = nn.Linear(2, 1)
    optimizer = DataclassSGD(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    dk.to_device(model, CPU, dtype=torch.float64)
    dk.to_device(optimizer, CPU)
    state = optimizer.state[model.weight]
    assert type(state) is Momentum
    assert state.buffer.dtype == torch.float64  # as dict state would be
    assert state.step.dtype == torch.float32  # a step keeps its own, as in dict state


def test_an_optimizer_whose_model_stayed_behind_is_refused(target: torch.device) -> None:
    model = nn.Linear(2, 2)
    optimizer = _trained_adam(model)
    msg = (
        f"Cannot move data['optimizer'] (an optimizer) to {target}: its state follows its "
        "parameters, and param_groups[0]['params'][0] is on cpu."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"optimizer": optimizer}, target)
    assert optimizer.state[model.weight]["exp_avg"].device == CPU


def test_copy_of_a_module_is_refused() -> None:
    msg = (
        "Cannot copy data[0]: the module Linear moves in place, so copy=True cannot give a "
        "separate copy. Use copy.deepcopy on it first, then move the copy."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device([nn.Linear(1, 1)], CPU, copy=True)


# Objects with .to() and registered types.


def test_objects_with_a_to_method_move_with_it(target: torch.device) -> None:
    data = {"thing": Movable(torch.ones(2))}
    moved = dk.to_device(data, target, non_blocking=True)
    assert moved["thing"].tensor.device == target
    assert moved["thing"].received == {"device": target, "non_blocking": True}


def test_packed_sequence_moves_with_its_own_to(target: torch.device) -> None:
    packed = nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    moved = dk.to_device({"seq": packed}, target)["seq"]
    assert type(moved) is nn.utils.rnn.PackedSequence
    assert moved.data.device == target
    assert_arrived(moved.data, packed.data, target)
    assert moved.batch_sizes.device == CPU  # PackedSequence.to keeps these on the host


def test_a_packed_sequence_takes_every_option_and_keeps_its_token_ids(target: torch.device) -> None:
    tokens = torch.nn.utils.rnn.pack_sequence([torch.tensor([50257, 1]), torch.tensor([7])])
    features = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    images = torch.ones(2, 3, 4, 4)
    moved = dk.to_device(
        {"seq": features, "images": images}, target, memory_format=torch.channels_last
    )
    assert moved["seq"].data.device == target
    assert moved["images"].is_contiguous(memory_format=torch.channels_last)
    # dtype casts floating-point tensors only: token ids stay integers, and exact.
    cast = dk.to_device({"tokens": tokens, "features": features}, CPU, dtype=torch.float16)
    assert cast["tokens"].data.dtype == torch.int64
    assert cast["tokens"].data.tolist() == [50257, 7, 1]
    assert cast["features"].data.dtype == torch.float16
    assert cast["features"].batch_sizes.dtype == torch.int64  # on the host, as .to() keeps it
    assert cast["features"].batch_sizes.device == CPU
    # copy=True: nothing shared with the input, batch_sizes included.
    copied = dk.to_device(tokens, CPU, copy=True)
    assert type(copied) is torch.nn.utils.rnn.PackedSequence
    for mine, theirs in zip(copied, tokens, strict=True):
        if theirs is not None:
            assert mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()


def test_the_to_signature_is_read_once_per_type(target: torch.device) -> None:
    calls: list[tuple[Any, ...]] = []

    class Counted:
        def to(self, device: torch.device, **options: Any) -> Counted:
            calls.append((device, options))
            return self

    dk.to_device([Counted(), Counted()], target, dtype=torch.float16)
    # Objects that move themselves get non_blocking only where their copies need no wait,
    # and never dtype, which their .to() would apply to every tensor they hold.
    asked = {"non_blocking": True} if target != META else {}
    assert calls == [(target, asked)] * 2


class Sample:
    """A user type whose .to() hands every option to every tensor, ids included."""

    def __init__(self, image: torch.Tensor, ids: torch.Tensor) -> None:
        self.image = image
        self.ids = ids

    def to(self, *args: Any, **kwargs: Any) -> Sample:
        return Sample(self.image.to(*args, **kwargs), self.ids.to(*args, **kwargs))


def test_options_a_to_method_does_not_take_are_applied_inside_it(target: torch.device) -> None:
    sample = Sample(torch.ones(1, 3, 2, 2), torch.tensor([70001]))
    moved = dk.to_device(
        {"sample": sample}, target, dtype=torch.float16, memory_format=torch.channels_last
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


def test_a_to_method_returning_none_is_refused(target: torch.device) -> None:
    class InPlace:
        def to(self, device: torch.device) -> None:
            pass

    msg = (
        "Cannot move data[1]: InPlace.to() returned None for the InPlace there; expected the "
        "moved object. A method that moves in place must return self."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device([1, InPlace()], target)


class Distance:
    def __init__(self, metres: float) -> None:
        self.metres = metres

    def to(self, unit: str) -> str:  # a .to() that converts units, not devices
        return f"{self.metres} {unit}"


def test_a_to_method_that_means_something_else_is_not_trusted(target: torch.device) -> None:
    msg = (
        "Cannot move data['d']: Distance.to() returned a str for the Distance there, not a "
        "Distance, so it is not the moved object. Register how to move it with "
        "@devicekit.register_transfer(Distance), returning a Distance."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"d": Distance(3.0)}, target)


class Boxes:
    """A user type that moves with its own .to()."""

    def __init__(self, xyxy: torch.Tensor) -> None:
        self.xyxy = xyxy

    def to(self, device: Any, *, non_blocking: bool = False) -> Boxes:
        return Boxes(self.xyxy.to(device, non_blocking=non_blocking))


class Counted:
    """Moves itself with .to(), counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def to(self, device: Any, *, non_blocking: bool = False) -> Counted:
        self.calls += 1
        return self


def test_a_to_method_or_rule_runs_once_per_object(target: torch.device) -> None:
    counted = Counted()
    shared = torch.ones(2)  # a tensor found twice
    ruled = Boxes(torch.ones(1, 4))
    rule_calls: list[int] = []

    @dk.register_transfer(Boxes)
    def move_boxes(obj: Boxes, device: torch.device, **options: Any) -> Boxes:
        rule_calls.append(1)
        return Boxes(obj.xyxy.to(device))

    batch = {"a": [shared, counted, ruled], "b": (shared, counted, ruled)}
    try:
        moved = dk.to_device(batch, target)
    finally:
        dk.unregister_transfer(Boxes)
    # .to() ran once, on a copy: the input's own count is untouched.
    assert counted.calls == 0
    assert moved["a"][1].calls == 1
    assert moved["a"][1] is moved["b"][1]
    assert rule_calls == [1]
    assert moved["a"][0] is moved["b"][0]
    assert moved["a"][2] is moved["b"][2]


def test_registered_rules_win_over_to_and_containers(target: torch.device) -> None:
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

    try:
        moved = dk.to_device(
            {"b": Boxes(torch.ones(1, 4)), "s": SubBoxes(torch.ones(1, 4))}, target
        )
    finally:
        dk.unregister_transfer(Boxes)
    assert type(moved["b"]) is Boxes
    assert moved["b"].xyxy.device == target
    assert moved["s"].xyxy.device == target  # subclasses use their base's rule
    assert seen[0] == {
        "non_blocking": target != META,
        "dtype": None,
        "copy": False,
        "memory_format": torch.preserve_format,
    }


def test_registering_a_rule_replaces_cached_decisions(target: torch.device) -> None:
    class Late:
        pass

    late = Late()
    assert dk.to_device([late], target)[0] is late

    @dk.register_transfer(Late)
    def move_late(obj: Late, device: torch.device, **options: Any) -> Late:
        moved = Late()
        moved.device = device  # type: ignore[attr-defined]
        return moved

    try:
        assert dk.to_device([late], target)[0].device == target
    finally:
        dk.unregister_transfer(Late)


def test_a_registered_rule_returning_none_is_refused(target: torch.device) -> None:
    class Broken:
        pass

    @dk.register_transfer(Broken)
    def move_broken(obj: Broken, device: torch.device, **options: Any) -> None:
        return None

    msg = "Cannot move data['x']: the rule registered for Broken returned None"
    try:
        with pytest.raises(dk.TransferError, match=re.escape(msg)):
            dk.to_device({"x": Broken()}, target)
    finally:
        dk.unregister_transfer(Broken)


# strict=True.


def test_strict_refuses_leaves_it_cannot_move_and_names_their_path(target: torch.device) -> None:
    msg = (
        "Cannot move data['meta'][1]: it is a numpy.ndarray, which is neither a tensor, a "
        "container, a type with a .to() method, a registered type, nor a plain scalar."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"meta": [1, np.zeros(2)]}, target, strict=True)


def test_strict_accepts_plain_scalars_modules_and_optimizers() -> None:
    model = nn.Linear(1, 1)
    data = [None, True, 1, 2.0, 3j, "s", b"b", model, torch.optim.SGD(model.parameters())]
    moved = dk.to_device(data, CPU, strict=True)
    assert moved[:7] == data[:7]


def test_strict_takes_dtypes_devices_and_ranges_as_plain_values(target: torch.device) -> None:
    config = {"dtype": torch.float16, "device": torch.device("cpu"), "steps": range(3)}
    assert dk.to_device(config, target, strict=True) == config


def test_strict_keeps_numpy_scalars_as_it_keeps_python_numbers(target: torch.device) -> None:
    batch = [np.float32(1.0), np.int64(3), np.bool_(True), torch.ones(1)]
    moved = dk.to_device(batch, target, strict=True)
    assert moved[:3] == batch[:3]
    assert moved[3].device == target


class Unprintable:
    """A key of the user's whose __repr__ raises."""

    def __repr__(self) -> str:
        msg = "no repr"
        raise ValueError(msg)


def test_a_key_whose_repr_raises_is_shown_and_the_refusal_stands(target: torch.device) -> None:
    # Issue 46: the repr's ValueError took the refusal's place.
    msg = (
        "Cannot move data[<unprintable Unprintable: its __repr__ raised ValueError>][1]: it is "
        "a numpy.ndarray, which is neither a tensor, a container, a type with a .to() method, "
        "a registered type, nor a plain scalar."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({Unprintable(): [1, np.zeros(2)]}, target, strict=True)


# Structural errors.


def test_a_reference_cycle_is_reported_with_its_path(target: torch.device) -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    msg = (
        "Expected data without reference cycles, but data['batch'][1] is the list "
        "data['batch'] itself, which contains it."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"batch": loop}, target)


def test_a_dict_cycle_is_reported_with_its_path(target: torch.device) -> None:
    inner: dict[str, Any] = {}
    outer = {"a": [inner]}
    inner["back"] = outer
    msg = "but data['a'][0]['back'] is the dict data itself, which contains it."
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device(outer, target)


def _nested(depth: int) -> Any:
    data: Any = torch.ones(1)
    for _ in range(depth):
        data = [data]
    return data


def test_ten_thousand_levels_are_fine(target: torch.device) -> None:
    moved = dk.to_device(_nested(10_000), target)
    for _ in range(10_000):
        moved = moved[0]
    assert_arrived(moved, torch.ones(1), target)


def test_deeper_than_ten_thousand_levels_is_refused_without_recursion_error(
    target: torch.device,
) -> None:
    msg = (
        "Expected data nested at most 10,000 containers deep, but "
        "data[0][0][0][0][0][0][0][0]...<9,984 more levels>...[0][0][0][0][0][0][0][0] goes deeper."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device(_nested(10_001), target)


def test_a_meta_tensor_cannot_move_to_a_real_device() -> None:
    msg = (
        "Cannot move data['weights'][0] to cpu: it is a tensor on the meta device, and tensors "
        "on the meta device have shapes but no data."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"weights": [torch.ones(2, device="meta")]}, CPU)


def test_errors_from_user_code_keep_their_type_and_gain_the_path(target: torch.device) -> None:
    class Exploding:
        def to(self, device: torch.device) -> Exploding:
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as info:
        dk.to_device({"x": [Exploding()]}, target)
    assert info.value.__notes__ == ["devicekit: raised while handling data['x'][0] (Exploding)."]


# Options and devices.


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"non_blocking": "yes"},
            TypeError,
            "Expected non_blocking to be 'auto', True or False, got 'yes'.",
        ),
        (
            {"non_blocking": 1},
            TypeError,
            "Expected non_blocking to be 'auto', True or False, got 1.",
        ),
        (
            {"dtype": torch.int64},
            ValueError,
            (
                "Expected dtype to be None or a floating-point dtype such as torch.float16 or "
                "torch.bfloat16, got torch.int64"
            ),
        ),
        (
            {"memory_format": "channels_last"},
            ValueError,
            (
                "Expected memory_format to be None or a torch.memory_format such as "
                "torch.channels_last, got 'channels_last'."
            ),
        ),
    ],
)
def test_bad_options_are_refused(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        dk.to_device(torch.ones(1), CPU, **options)


@pytest.mark.parametrize(("name", "value"), [("copy", "False"), ("strict", "no"), ("copy", 0)])
def test_yes_no_options_take_booleans_only(name: str, value: object, target: torch.device) -> None:
    msg = f"Expected {name} to be True or False, got {value!r}."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.to_device([torch.ones(1)], target, **{name: value})  # type: ignore[arg-type]


def test_options_of_the_wrong_kind_are_named(target: torch.device) -> None:
    with pytest.raises(TypeError, match=re.escape("got array([ True]).")):
        dk.to_device(torch.ones(1), target, non_blocking=np.array([True]))  # type: ignore[arg-type]


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
def test_an_absent_accelerator_is_refused_with_the_devices_that_exist(
    target: torch.device,
) -> None:
    if target == META:  # this machine, with no accelerator
        with pytest.raises(dk.DeviceUnavailableError, match=r"Available here: .*'cpu', 'meta'\.$"):
            dk.to_device(torch.ones(1), "cuda:7")
        msg = "Expected an accelerator for the device index 0, but this machine has none."
        with pytest.raises(dk.DeviceUnavailableError, match=re.escape(msg)):
            dk.to_device(torch.ones(1), 0)
        return
    # The stand-in started: its devices are the machine's accelerators, and 0 is its first.
    there = f"Available here: '{target.type}:0', '{target.type}:1', 'cpu', 'meta'."
    with pytest.raises(dk.DeviceUnavailableError, match=re.escape(there) + "$"):
        dk.to_device(torch.ones(1), "cuda:7")
    assert dk.to_device(torch.ones(1), 0).device == target


def test_device_none_means_the_current_device(target: torch.device) -> None:
    with dk.DeviceManager(target):
        assert dk.to_device({"x": torch.ones(1)})["x"].device == target


def test_non_blocking_auto_on_host_targets_is_safe_to_read() -> None:
    data = {"x": torch.arange(6.0)}
    moved = dk.to_device(data, CPU, copy=True, non_blocking="auto")
    assert torch.equal(moved["x"], torch.arange(6.0))


class _Features(dict[str, Any]):
    """A dict subclass: rebuilt as its type, never taken for a plain dict."""


@pytest.mark.parametrize(
    "make",
    [
        lambda ts: dict(zip("abcdefgh", ts, strict=False)),
        list,
        tuple,
        lambda ts: OrderedDict(zip("abcdefgh", ts, strict=False)),
        lambda ts: defaultdict(list, zip("abcdefgh", ts, strict=False)),
        lambda ts: _Features(zip("abcdefgh", ts, strict=False)),
        lambda ts: Pair(*ts[:2]),
        UserList,
    ],
    ids=[
        "dict",
        "list",
        "tuple",
        "ordereddict",
        "defaultdict",
        "dict subclass",
        "namedtuple",
        "userlist",
    ],
)
@pytest.mark.parametrize("shared", [False, True], ids=["distinct", "one tensor twice"])
def test_a_flat_batch_of_tensors_keeps_its_type_and_aliases(
    make: Any, shared: bool, target: torch.device
) -> None:
    # Flat batches of plain tensors, which the host walk hands to the mover in one call.
    tensors = [torch.full((2,), float(i)) for i in range(8)]
    if shared:
        tensors[5] = tensors[1]
    data = make(tensors)
    before = snapshot(data)
    moved = dk.to_device(data, target)
    assert type(moved) is type(data)
    assert_arrived(moved, data, target)
    if isinstance(data, defaultdict):
        assert moved.default_factory is list
    leaves = list(tensor_leaves(moved))
    assert all(t.device == target for t in leaves)
    if shared and len(leaves) > 5:
        assert leaves[5] is leaves[1]
    assert len({id(t) for t in leaves}) == len({id(t) for t in tensor_leaves(data)})
    assert_unchanged(data, before)


def test_a_flat_batch_partly_on_the_target_keeps_what_is_there(target: torch.device) -> None:
    there = torch.ones(2, device=target)
    data = {"there": there, "here": torch.ones(2), "also": torch.zeros(3)}
    moved = dk.to_device(data, target)
    assert moved["there"] is there
    assert moved["here"].device == moved["also"].device == target
    assert_arrived([moved["here"], moved["also"]], [data["here"], data["also"]], target)
    assert moved is not data


@pytest.mark.parametrize("non_blocking", ["auto", True, False])
def test_a_flat_batch_takes_the_options_as_the_walk_does(
    non_blocking: Any, target: torch.device
) -> None:
    data = [torch.ones(2, 3, 4, 4), torch.arange(3), torch.ones(2, dtype=torch.float64)]
    moved = dk.to_device(data, target, non_blocking=non_blocking, dtype=torch.float16)
    assert [t.dtype for t in moved] == [torch.float16, torch.int64, torch.float16]
    assert_arrived(moved, [data[0].half(), data[1], data[2].half()], target)
    laid_out = dk.to_device(tuple(data), CPU, non_blocking=non_blocking, copy=True)
    assert all(a is not b and torch.equal(a, b) for a, b in zip(laid_out, data, strict=True))
    channels = dk.to_device(data, CPU, memory_format=torch.channels_last)
    assert channels[0].is_contiguous(memory_format=torch.channels_last)
    assert channels[1] is data[1]
    assert [t.device for t in dk.to_device(data, target, non_blocking=non_blocking)] == [target] * 3


def test_a_meta_tensor_in_a_flat_batch_is_named_by_its_path() -> None:
    data = {"image": torch.ones(2), "ghost": torch.ones(2, device=META)}
    for non_blocking in ("auto", True):
        with pytest.raises(dk.TransferError, match=re.escape("Cannot move data['ghost'] to cpu")):
            dk.to_device(data, CPU, non_blocking=non_blocking)
    with pytest.raises(dk.TransferError, match=re.escape("Cannot move data[1] to cpu")):
        dk.to_device([torch.ones(1), torch.ones(1, device=META)], CPU, non_blocking=True)


def test_a_flat_batch_with_other_leaves_is_walked_as_before(target: torch.device) -> None:
    weight = nn.Parameter(torch.ones(2))
    data = {"x": torch.ones(2), "w": weight, "n": 3, "name": "a"}
    moved = dk.to_device(data, target, strict=True)
    # A parameter on the stand-in is a stand-in tensor marked as one, as PyTorch marks a
    # tensor subclass: nn.Parameter by isinstance, not by type.
    assert (
        type(moved["w"]) is nn.Parameter if target == META else isinstance(moved["w"], nn.Parameter)
    )
    assert moved["w"].requires_grad
    assert moved["w"].device == moved["x"].device == target
    assert (moved["n"], moved["name"]) == (3, "a")
