"""Results that were silently wrong: each case found by a review or a bad-input probe.

Every test here failed before its fix. meta is the second device on CPU machines.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import re
import shelve
from collections import ChainMap, UserDict, UserList, deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import devicekit as dk

META = torch.device("meta")
CPU = torch.device("cpu")


# The input is changed, or values land under the wrong key.


def test_a_shelf_is_refused_and_its_file_keeps_its_data(tmp_path: Path) -> None:
    with shelve.open(str(tmp_path / "db")) as shelf:
        shelf["w"] = torch.arange(3.0)
        msg = (
            "Cannot rebuild data: it is a shelve.DbfilenameShelf, a mutable mapping whose copy "
            "could share its contents with the original. Register how to move it with "
            "@devicekit.register_transfer(DbfilenameShelf)."
        )
        with pytest.raises(dk.TransferError, match=re.escape(msg)):
            dk.to_device(shelf, META)
    with shelve.open(str(tmp_path / "db")) as shelf:
        assert torch.equal(shelf["w"], torch.arange(3.0))


def test_a_chain_map_is_refused_and_left_as_it_was() -> None:
    first, second = {"a": torch.ones(1)}, {"b": torch.zeros(1)}
    chain = ChainMap(first, second)
    with pytest.raises(dk.TransferError, match=re.escape("Cannot rebuild data['x']: it is a")):
        dk.to_device({"x": chain}, META)
    assert chain.maps == [first, second]
    assert first["a"].device == CPU
    assert second["b"].device == CPU
    assert list(first) == ["a"]


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


class Encoding(UserDict[str, Any]):
    def keys(self) -> Any:  # out of order with .data, as a careless subclass might be
        return reversed(list(self.data))


def test_a_user_dict_keeps_its_pairs_and_shares_nothing() -> None:
    batch = Encoding({"ids": torch.arange(3), "mask": torch.ones(3, dtype=torch.bool)})
    batch.extra = "kept"  # type: ignore[attr-defined]
    moved = dk.to_device(batch, META)
    assert moved.data is not batch.data
    assert moved["ids"].dtype == torch.int64
    assert moved["mask"].dtype == torch.bool
    assert moved.extra == "kept"  # type: ignore[attr-defined]
    assert batch["ids"].device == CPU


# Frozen dataclasses were rebuilt with dataclasses.replace, which runs __init__ and
# __post_init__ again; the others were copied and had their fields replaced. Each kind
# has a rule here that a second __post_init__, or a rebuild that needs the InitVar
# again, would break.
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


def test_dataclass_attributes_move_and_cached_values_do_not_stay_stale() -> None:
    data = WithCache(torch.ones(2))
    assert data.total.device == CPU  # cached on the input
    moved = dk.to_device(data, META)
    assert moved.x.device == META
    assert moved.norm.device == META  # set in __post_init__: moved too
    assert "total" not in vars(moved)
    assert moved.total.device == META  # computed afresh from the moved field
    assert data.x.device == CPU


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
def test_an_optimizer_whose_state_is_a_dataclass_moves() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = FooOptimizer(model.parameters())
    optimizer.step()
    dk.to_device(model, META)
    dk.to_device(optimizer, META)
    state = optimizer.state[model.weight]
    assert isinstance(state, FooState)
    assert state.exp_avg.device == META
    assert state.step == 1


def test_loading_a_checkpoint_of_meta_tensors_onto_a_real_device_says_so() -> None:
    buffer = io.BytesIO()
    torch.save({"fc.weight": torch.ones(2, device="meta"), "step": 3}, buffer)
    buffer.seek(0)
    msg = (
        "Expected a checkpoint with data to load onto cpu, but it holds tensors on the meta "
        "device, which have a shape and no data: ['fc.weight']."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.load(buffer, "cpu")
    buffer.seek(0)
    assert dk.load(buffer, "meta")["fc.weight"].is_meta  # onto meta it is what was asked


@pytest.mark.parametrize("value", [0, 1, "yes", None, 0.0])
def test_weights_only_takes_true_or_false_only(value: object) -> None:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(1)}, buffer)
    buffer.seek(0)
    msg = f"Expected weights_only to be True or False, got {value!r}: False runs the code"
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.load(buffer, "cpu", weights_only=value)  # type: ignore[arg-type]


# Silently not moved, or invisible to the checks.


def test_deques_and_user_lists_are_rebuilt_and_seen() -> None:
    window: deque[torch.Tensor] = deque([torch.ones(1), torch.zeros(1)], maxlen=5)
    users = UserList([torch.ones(2)])
    moved = dk.to_device({"window": window, "users": users}, META)
    assert type(moved["window"]) is deque
    assert moved["window"].maxlen == 5
    assert all(t.device == META for t in moved["window"])
    assert type(moved["users"]) is UserList
    assert moved["users"][0].device == META
    assert users[0].device == CPU
    found = dk.find_devices({"window": window, "users": users})
    assert found == {CPU: ["['window'][0]", "['window'][1]", "['users'][0]"]}
    msg = "cpu has data['window'][0], data['window'][1]."
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        dk.check_same_device({"window": window}, device="meta")


class Ring(Sequence[Any]):
    """A Sequence devicekit has no rule for."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


def test_sequences_and_object_arrays_it_cannot_rebuild_are_refused() -> None:
    msg = (
        "Cannot rebuild data['ring']: it is a tests.test_nothing_silently_wrong.Ring, a "
        "Sequence that devicekit cannot rebuild as the same type. Register how to move it "
        "with @devicekit.register_transfer(Ring)."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"ring": Ring([torch.ones(1)])}, META)
    holder = np.empty(2, dtype=object)
    holder[0], holder[1] = torch.ones(1), "label"
    msg = (
        "Cannot move data['boxes']: it is a numpy array of objects holding tensors, which "
        "devicekit cannot move inside it. Make it a list (array.tolist()), or register how "
        "to move it with @devicekit.register_transfer(numpy.ndarray)."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"boxes": holder}, META)
    numbers = np.arange(3)
    assert dk.to_device({"n": numbers}, META)["n"] is numbers  # plain arrays stay leaves
    assert dk.to_device([range(3)], META, strict=True) == [range(3)]


class Boxes:
    """A user type that moves with its own .to()."""

    def __init__(self, xyxy: torch.Tensor) -> None:
        self.xyxy = xyxy

    def to(self, device: Any, *, non_blocking: bool = False) -> Boxes:
        return Boxes(self.xyxy.to(device, non_blocking=non_blocking))


def test_the_checks_see_tensors_inside_objects_that_move_themselves() -> None:
    batch = {"boxes": Boxes(torch.ones(1, 4))}
    assert dk.find_devices(batch) == {CPU: ["['boxes'].xyxy"]}
    assert dk.to_device(batch, META)["boxes"].xyxy.device == META


def test_a_parameter_comes_back_a_parameter() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    moved = dk.to_device({"w": weight, "frozen": torch.nn.Parameter(torch.ones(1), False)}, META)
    assert type(moved["w"]) is torch.nn.Parameter
    assert moved["w"].requires_grad
    assert type(moved["frozen"]) is torch.nn.Parameter
    assert not moved["frozen"].requires_grad


def test_a_packed_sequence_takes_every_option_and_keeps_its_token_ids() -> None:
    tokens = torch.nn.utils.rnn.pack_sequence([torch.tensor([50257, 1]), torch.tensor([7])])
    features = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    images = torch.ones(2, 3, 4, 4)
    moved = dk.to_device(
        {"seq": features, "images": images}, META, memory_format=torch.channels_last
    )
    assert moved["seq"].data.device == META
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


def test_numbers_count_for_registered_rules_and_lookup_is_documented() -> None:
    calls: list[int] = []

    @dk.register_transfer(int)
    def move_int(value: int, device: torch.device, **options: Any) -> int:
        calls.append(value)
        return value + 1

    try:
        assert dk.to_device([5, {"n": 6}], META) == [6, {"n": 7}]
        assert dk.to_device(5, META) == 6
        assert calls == [5, 6, 5]
    finally:
        dk.unregister_transfer(int)
    assert dk.to_device([5], META) == [5]


def test_registering_object_or_a_non_callable_or_twice_is_refused() -> None:
    msg = "Expected a type narrower than object: a rule for object would take every leaf"
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.register_transfer(object)
    msg = "Expected a function fn(obj, device, **options) to register for Boxes, got int 5."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.register_transfer(Boxes)(5)  # type: ignore[type-var]

    @dk.register_transfer(Boxes)
    def first(obj: Boxes, device: torch.device, **options: Any) -> Boxes:
        return obj

    try:
        msg = (
            "Boxes already has a transfer rule (tests.test_nothing_silently_wrong.test_registering"
            "_object_or_a_non_callable_or_twice_is_refused.<locals>.first); "
            "call devicekit.unregister_transfer(Boxes) first to replace it."
        )
        with pytest.raises(ValueError, match=re.escape(msg)):
            dk.register_transfer(Boxes)(first)
    finally:
        dk.unregister_transfer(Boxes)
    msg = "Boxes has no transfer rule to unregister."
    with pytest.raises(KeyError, match=re.escape(msg)):
        dk.unregister_transfer(Boxes)


def test_a_rule_for_an_abc_applies_to_the_builtins_it_covers() -> None:
    seen: list[type] = []

    @dk.register_transfer(collections.abc.Sequence)
    def move_sequence(obj: Any, device: torch.device, **options: Any) -> Any:
        seen.append(type(obj))
        return obj

    try:
        dk.to_device({"a": [torch.ones(1)], "b": UserList([1])}, META)
    finally:
        dk.unregister_transfer(collections.abc.Sequence)
    assert seen == [list, UserList]


# Side effects once, state that depends on nothing but the call.


class Counted:
    """Moves itself with .to(), counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def to(self, device: Any, *, non_blocking: bool = False) -> Counted:
        self.calls += 1
        return self


@pytest.mark.parametrize("accelerator", [False, True], ids=["host path", "accelerator path"])
def test_a_to_method_or_rule_runs_once_per_object(accelerator: bool) -> None:
    from devicekit._transfer import as_accelerator  # noqa: PLC0415 - a private seam

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
        if accelerator:
            with as_accelerator("meta"):
                moved = dk.to_device(batch, META)
        else:
            moved = dk.to_device(batch, META)
    finally:
        dk.unregister_transfer(Boxes)
    # .to() ran once, on a copy: the input's own count is untouched.
    assert counted.calls == 0
    assert moved["a"][1].calls == 1
    assert moved["a"][1] is moved["b"][1]
    assert rule_calls == [1]
    assert moved["a"][0] is moved["b"][0]
    assert moved["a"][2] is moved["b"][2]


def test_the_device_of_a_spec_does_not_depend_on_what_was_asked_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit import _devices  # noqa: PLC0415 - its cache is what is tested

    monkeypatch.setattr(_devices, "_resolved", {})
    monkeypatch.setattr(_devices, "_default_family", lambda: "meta")  # 0 names a device
    assert _devices.resolve_device(0) == META
    for spec in (False, 0.0, np.float64(0)):
        with pytest.raises(TypeError, match=re.escape("Expected a device as a torch.device")):
            _devices.resolve_device(spec)  # type: ignore[arg-type]
    assert _devices.resolve_device(np.int64(0)) == META  # an integer index is one


def test_a_device_without_an_index_is_resolved_on_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "cuda" means the current CUDA device, which set_device changes between calls; the
    # plans cached for resolved devices must not answer for it. Stand-in: a device
    # type whose current device is meta, then cpu.
    from devicekit import _transfer  # noqa: PLC0415 - its resolution is what is stood in for

    current = [META, CPU]
    monkeypatch.setattr(_transfer, "_plans", {})  # no plan yet, for any device
    monkeypatch.setattr(
        _transfer,
        "resolve_device",
        lambda spec: current.pop(0) if spec == torch.device("xpu") else spec,
    )
    tensor = torch.ones(1)
    assert dk.to_device(tensor, torch.device("xpu")).device == META  # meta's plan made
    assert dk.to_device(tensor, torch.device("xpu")).device == CPU
    assert dk.to_device(tensor, torch.device("meta")).device == META  # found as planned
    assert current == []


@pytest.mark.parametrize(("name", "value"), [("copy", "False"), ("strict", "no"), ("copy", 0)])
def test_yes_no_options_take_booleans_only(name: str, value: object) -> None:
    msg = f"Expected {name} to be True or False, got {value!r}."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.to_device([torch.ones(1)], META, **{name: value})  # type: ignore[arg-type]


def test_a_manager_leaving_out_of_order_takes_only_its_own_device_away() -> None:
    outer, inner = dk.DeviceManager("cpu"), dk.DeviceManager("meta")
    with dk.DeviceManager("meta"):
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)  # out of order: the inner block is still open
        assert dk.current_device() == META  # inner's, not outer's
        inner.__exit__(None, None, None)
        outer.__exit__(None, None, None)  # left already: nothing more to take away
        assert dk.current_device() == META


def test_registering_while_other_threads_move_data_raises_nothing() -> None:
    import threading  # noqa: PLC0415 - this test alone starts threads

    errors: list[BaseException] = []
    stop = threading.Event()

    def move() -> None:
        batch = {"a": [torch.ones(1), (torch.zeros(1), "x")], "b": deque([1])}
        try:
            while not stop.is_set():
                dk.to_device(batch, META)
        except BaseException as error:
            errors.append(error)

    class Marker:
        pass

    movers = [threading.Thread(target=move) for _ in range(2)]
    for thread in movers:
        thread.start()
    try:
        for _ in range(300):
            dk.register_transfer(Marker)(lambda obj, device, **options: obj)
            dk.unregister_transfer(Marker)
    finally:
        stop.set()
        for thread in movers:
            thread.join()
    assert errors == []


def test_caches_of_per_type_decisions_are_bounded() -> None:
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    from devicekit import _kinds  # noqa: PLC0415 - the one table is what is tested

    first: Any = None
    for index in range(3 * _kinds.TYPES_KEPT):
        kind = type(f"Made{index}", (), {"to": lambda self, device: self})
        if first is None:
            first = weakref.ref(kind)
        dk.to_device([kind()], META)
        del kind
    for number in (_kinds.MOVE, _kinds.CAST, _kinds.READ):
        assert len(_kinds.view(number)) <= _kinds.TYPES_KEPT
    assert len(_kinds._leaves) <= _kinds.TYPES_KEPT
    gc.collect()
    assert first() is None  # the first type made is no longer held


# Speed where no tensor is. (The figures are in benchmarks/; these tests hold the
# structure that gives them, or fail instead of hanging.)


def test_a_long_list_of_scalars_is_taken_whole_not_element_by_element() -> None:
    from devicekit._tree import flatten  # noqa: PLC0415 - the structure is the point

    ids = list(range(100_000))
    flat = flatten({"ids": ids, "t": torch.ones(1)})
    assert flat.active == [len(ids)]  # only the tensor is looked at again
    assert len(flat.spec) == 2  # the list closed in one step, then the dict
    moved = dk.to_device({"ids": ids, "more": [*ids[:100], torch.ones(1)]}, META)
    assert moved["ids"] == ids
    assert moved["ids"] is not ids
    assert moved["more"][-1].device == META  # a tensor at the end is still found


def test_parse_bytes_fails_at_once_on_a_long_run_of_spaces() -> None:
    import signal  # noqa: PLC0415

    from devicekit._units import parse_bytes  # noqa: PLC0415

    def hang(signum: int, frame: object) -> None:
        msg = "parse_bytes backtracks: a long run of spaces takes minutes"
        raise TimeoutError(msg)

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, 10)  # quadratic takes minutes on 200,000 spaces
    try:
        with pytest.raises(ValueError, match="Expected min_free_memory"):
            parse_bytes("1" + " " * 200_000 + "!")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert parse_bytes(" 8 GiB ") == 8 * 2**30


def test_a_guarded_forward_does_not_list_the_parameters_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Listing a module's parameters per call was most of guard's cost per forward.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    calls: list[int] = []
    original = torch.nn.Module.named_parameters

    def counting(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    with dk.guard(model), dk.guard(model[0], recurse=True):
        monkeypatch.setattr(torch.nn.Module, "named_parameters", counting)
        for _ in range(5):
            model(torch.ones(1, 4))
        assert calls == []
        monkeypatch.undo()
        model.to("meta")  # new Parameter objects, between cpu and meta
        msg = "input is on cpu but the parameters of Sequential (e.g. 0.weight"
        with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
            model(torch.ones(1, 4))


def test_track_transfers_watches_its_own_thread_as_documented() -> None:
    import threading  # noqa: PLC0415

    assert "Only the calling thread is watched" in (dk.track_transfers.__doc__ or "")
    with dk.track_transfers() as log:
        worker = threading.Thread(target=lambda: torch.ones(2).to("meta"))
        worker.start()
        worker.join()
        torch.ones(3).to("meta")
    assert log.count == 1  # this thread's copy, not the worker's


def test_registering_typing_any_is_refused() -> None:
    import typing  # noqa: PLC0415 - this test alone needs it

    refusal = re.escape("got typing.Any, which no object is an instance of")
    with pytest.raises(TypeError, match=refusal):
        dk.register_transfer(typing.Any)


# A user's first day, moving data: every mistake named with its type, its path and
# what to do; what is right passes.


@dataclasses.dataclass
class Later:
    x: torch.Tensor
    y: torch.Tensor = dataclasses.field(init=False)  # set later, or never


def test_a_dataclass_field_never_set_stays_unset() -> None:
    moved = dk.to_device({"sample": Later(torch.ones(1))}, META)["sample"]
    assert moved.x.device == META
    assert not hasattr(moved, "y")
    assert dk.find_devices({"sample": Later(torch.ones(1))}) == {CPU: ["['sample'].x"]}


class NeedsArgDict(collections.OrderedDict[str, Any]):
    def __init__(self, name: str, **items: Any) -> None:
        super().__init__(**items)
        self.name = name


class NeedsArgDefaultDict(collections.defaultdict[str, Any]):
    def __init__(self, name: str) -> None:
        super().__init__(list)
        self.name = name


class Pair(tuple[Any, ...]):
    def __new__(cls, first: Any, second: Any) -> Pair:
        return super().__new__(cls, (first, second))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: NeedsArgDict("n", x=torch.ones(1)), "which copy.copy cannot copy ("),
        (lambda: NeedsArgDefaultDict("n"), "which copy.copy cannot copy ("),
        (lambda: Pair(torch.ones(1), 2), "which cannot be built from a list of its items ("),
    ],
    ids=["OrderedDict", "defaultdict", "tuple"],
)
def test_a_subclass_whose_constructor_needs_arguments_is_named(make: Any, why: str) -> None:
    container = make()
    if isinstance(container, dict):
        container["x"] = torch.ones(1)
    name = type(container).__name__
    with pytest.raises(dk.TransferError) as caught:
        dk.to_device({"k": container}, META)
    message = str(caught.value)
    assert message.startswith(f"Cannot rebuild data['k']: it is a {__name__}.{name}, {why}")
    assert message.endswith(f"Register how to move it with @devicekit.register_transfer({name}).")


class Bag:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SmallBag(Bag):
    pass


def test_a_rule_must_return_an_instance_of_the_class_it_was_registered_for() -> None:
    @dk.register_transfer(Bag)
    def move_bag(bag: Bag, device: torch.device, **options: Any) -> Any:
        return 42 if bag.tensor.numel() == 2 else Bag(bag.tensor.to(device))

    try:
        msg = (
            "Cannot move data['b']: the rule registered for Bag returned a int for the Bag "
            "there, not a Bag, so it is not the moved object."
        )
        with pytest.raises(dk.TransferError, match=re.escape(msg)):
            dk.to_device({"b": Bag(torch.ones(2))}, META)
        # A Bag for a SmallBag is what a rule for Bag may well return.
        moved = dk.to_device({"b": SmallBag(torch.ones(1))}, META)["b"]
        assert type(moved) is Bag
        assert moved.tensor.device == META
    finally:
        dk.unregister_transfer(Bag)


class Distance:
    def __init__(self, metres: float) -> None:
        self.metres = metres

    def to(self, unit: str) -> str:  # a .to() that converts units, not devices
        return f"{self.metres} {unit}"


def test_a_to_method_that_means_something_else_is_not_trusted() -> None:
    msg = (
        "Cannot move data['d']: Distance.to() returned a str for the Distance there, not a "
        "Distance, so it is not the moved object. Register how to move it with "
        "@devicekit.register_transfer(Distance), returning a Distance."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device({"d": Distance(3.0)}, META)


def test_options_of_the_wrong_kind_are_named() -> None:
    with pytest.raises(ValueError, match=re.escape("got array([ True]).")):
        dk.to_device(torch.ones(1), META, non_blocking=np.array([True]))  # type: ignore[arg-type]


def test_strict_keeps_numpy_scalars_as_it_keeps_python_numbers() -> None:
    batch = [np.float32(1.0), np.int64(3), np.bool_(True), torch.ones(1)]
    moved = dk.to_device(batch, META, strict=True)
    assert moved[:3] == batch[:3]
    assert moved[3].device == META


def test_the_checks_name_no_path_where_there_is_no_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Naming every one of a million ints took find_devices 0.7 s; to_device takes 28 ms.
    from devicekit import _tree  # noqa: PLC0415 - the engine's paths are what is watched

    named: list[int] = []
    paths = _tree.paths
    monkeypatch.setattr(_tree, "paths", lambda flat: named.append(1) or paths(flat))
    ints = list(range(100_000))
    assert dk.find_devices(ints) == {}
    assert named == []
    dk.check_same_device(torch.nn.Linear(2, 2), {"ids": ints})
    assert named == [1]  # for the model's parameters: never for the ints

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
            return self.linear(x)

    model = Embed()
    with dk.guard(model):
        named.clear()
        model(torch.ones(1, 2), ids=ints)  # a guarded forward with a long keyword argument
    assert named == []  # x is a tensor, named by the forward's own parameter name
    assert dk.find_devices([*ints, torch.ones(1)]) == {CPU: ["[100000]"]}
