"""One table of per-type decisions, read by every walk; one crossing into the engine per call.

Each test here stands for a way the walks used to disagree: a decision cached by one
walk and not another, a path with its own rules, a race with register_transfer.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
import time
from collections import OrderedDict, deque, namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit import _compat, _kinds, _transfer
from devicekit._transfer import as_accelerator

META = torch.device("meta")
CPU = torch.device("cpu")
Pair = namedtuple("Pair", ["x", "y"])


class Bag:
    """A user type holding a tensor, with no rule until a test registers one."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@pytest.fixture
def bag_rule() -> Any:
    def register() -> None:
        @dk.register_transfer(Bag)
        def move_bag(bag: Bag, device: torch.device, **options: Any) -> Bag:
            return Bag(bag.tensor.to(device))

    yield register
    dk.unregister_transfer(Bag)


def test_a_rule_registered_after_first_use_reaches_every_walk(bag_rule: Any) -> None:
    batch = {"bag": Bag(torch.ones(1)), "raw": Bag(torch.ones(1))}
    # First use: every walk decides that a Bag is a leaf that stays where it is.
    assert dk.find_devices(batch) == {}
    assert dk.to_device(batch, META, skip_keys={"raw"})["bag"] is batch["bag"]
    bag_rule()
    assert dk.find_devices(batch) == {CPU: ["['bag'].tensor", "['raw'].tensor"]}
    moved = dk.to_device(batch, META, skip_keys={"raw"})
    assert moved["bag"].tensor.device == META
    assert moved["raw"] is batch["raw"]
    with as_accelerator("meta"):
        assert dk.to_device([batch["bag"]] * 12, META)[0].tensor.device == META


def test_a_rule_registered_while_other_threads_move_data_applies_at_once() -> None:
    # The table's decisions are made under the registry's lock: one made from the
    # registry as it was before a change can no longer be stored after it.
    stop = threading.Event()
    errors: list[BaseException] = []
    current: list[type] = [Bag]

    def move() -> None:
        try:
            while not stop.is_set():
                dk.to_device([current[0](torch.ones(1)), {"k": current[0](torch.ones(1))}], META)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=move) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: the race has its chances
    for thread in threads:
        thread.start()
    ignored = 0
    try:
        for trial in range(1000):
            kind = type(f"Bag{trial}", (Bag,), {})
            current[0] = kind
            time.sleep(0)  # the movers meet the new type, and decide it, meanwhile
            marker = kind(torch.zeros(0))  # what the rule returns: no move makes it
            dk.register_transfer(kind)(lambda obj, device, marker=marker, **options: marker)
            ignored += dk.to_device([kind(torch.ones(1))], META)[0] is not marker
            dk.unregister_transfer(kind)
            ignored += dk.to_device([kind(torch.ones(1))], META)[0] is marker
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert ignored == 0


def test_the_checks_see_inside_a_packed_sequence() -> None:
    packed = nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    on_meta = dk.to_device(packed, META)
    # batch_sizes stays on the host by PyTorch's design: the checks leave it out.
    assert dk.find_devices({"seq": packed}) == {CPU: ["['seq'].data"]}
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.check_same_device({"seq": on_meta, "mask": torch.ones(2)})
    assert info.value.devices[META] == ["data['seq'].data"]
    assert "data['mask']" in info.value.devices[CPU]


def test_guard_names_a_packed_sequence_on_another_device() -> None:
    lstm = nn.LSTM(2, 4)
    packed = nn.utils.rnn.pack_sequence([torch.ones(3, 2, device=META)])
    msg = "input.data is on meta but the parameters of LSTM (e.g. weight_ih_l0, weight_hh_l0)"
    with dk.guard(lstm), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        lstm(packed)


def test_the_checks_accept_the_step_pytorch_keeps_on_the_host_and_nothing_else() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = optimizer.state[model.weight]
    assert state["step"].device == CPU
    assert dk.check_same_device(model, optimizer) == CPU
    state["exp_avg"] = state["exp_avg"].to(META)  # a real mismatch, in the same optimizer
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.check_same_device(model, optimizer)
    assert info.value.devices[META] == ["AdamW.state[param_groups[0]['params'][0]]['exp_avg']"]


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


@pytest.mark.parametrize("options", [{"dtype": torch.float16}, {"copy": True}])
def test_skip_keys_combine_with_every_option(options: dict[str, Any]) -> None:
    raw = torch.ones(2)
    batch = {"raw": raw, "x": torch.ones(2), "nested": [{"raw": [raw]}]}
    moved = dk.to_device(batch, CPU, skip_keys="raw", **options)
    assert moved["raw"] is raw
    assert moved["nested"][0]["raw"][0] is raw
    assert moved["x"] is not batch["x"]
    if "dtype" in options:
        assert moved["x"].dtype == torch.float16
    with as_accelerator("meta"):
        packed = dk.to_device([{"raw": raw, "x": torch.ones(2)}] * 12, META, skip_keys="raw")
    assert packed[0]["raw"] is raw
    assert packed[0]["x"].device == META


def test_one_call_crosses_into_the_engine_once() -> None:
    calls: list[str] = []

    def record(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        caller = frame.f_back
        if (
            frame.f_code.co_filename.endswith("devicekit/_tree.py")
            and caller is not None
            and caller.f_code.co_filename.endswith("devicekit/_transfer.py")
        ):
            calls.append(frame.f_code.co_name)

    batch = {"inputs": Pair(torch.ones(2), torch.ones(2)), "targets": [torch.ones(1)] * 3}
    shared = batch["targets"][0]
    batch["targets"] = [torch.ones(1) for _ in range(3)]
    for accelerator in (False, True):
        calls.clear()
        if accelerator:
            with as_accelerator("meta"):
                sys.setprofile(record)
                try:
                    dk.to_device([*[torch.ones(2)] * 12, batch], META)
                finally:
                    sys.setprofile(None)
        else:
            sys.setprofile(record)
            try:
                dk.to_device(batch, META)
            finally:
                sys.setprofile(None)
        assert calls == ["map_flat" if accelerator else "map_leaves"], calls
    # The one exception: on the host path a batch that holds one tensor twice is only
    # known to do so once walked, and is walked again through the memo (see _Call).
    calls.clear()
    sys.setprofile(record)
    try:
        moved = dk.to_device([shared, shared], META)
    finally:
        sys.setprofile(None)
    assert calls == ["map_leaves", "map_leaves"]
    assert moved[0] is moved[1]


# Under torch.compile: the eager result, or a devicekit error at trace time.


def _compiled(fn: Any, *, fullgraph: bool = True) -> Any:
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")


@pytest.mark.parametrize(
    "options",
    [
        {"copy": True},
        {"memory_format": torch.channels_last},
        {"skip_keys": "raw", "device": META},
        {"dtype": torch.float16},
        {"non_blocking": False},
    ],
)
def test_the_compiled_to_device_takes_every_option_as_eagerly(options: dict[str, Any]) -> None:
    torch._dynamo.reset()
    shared = torch.ones(2)
    batch = {
        "x": shared,
        "again": shared,
        "image": torch.ones(1, 3, 2, 2),
        "raw": torch.ones(1),
        "ordered": OrderedDict(a=torch.ones(1)),
        "pair": Pair(torch.ones(1), 3),
        "ids": torch.tensor([70001]),
    }
    options = dict(options)
    device = options.pop("device", CPU)
    eager = dk.to_device(batch, device, **options)
    compiled = _compiled(lambda b: dk.to_device(b, device, **options))(batch)
    assert type(compiled["ordered"]) is OrderedDict
    assert type(compiled["pair"]) is Pair
    assert compiled["x"] is compiled["again"]
    for key in ("x", "image", "raw", "ids"):
        mine, theirs = compiled[key], eager[key]
        assert (mine.dtype, mine.shape, mine.is_contiguous(memory_format=torch.channels_last)) == (
            theirs.dtype,
            theirs.shape,
            theirs.is_contiguous(memory_format=torch.channels_last),
        )
        assert (mine is batch[key]) == (theirs is batch[key]), key
    assert compiled["ordered"]["a"].dtype == eager["ordered"]["a"].dtype
    assert compiled["ids"].dtype == torch.int64


def test_the_compiled_to_device_refuses_options_as_eagerly() -> None:
    torch._dynamo.reset()
    msg = "Expected dtype to be None or a floating-point dtype"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.int64))({"x": torch.ones(1)})


def test_what_the_compiler_cannot_repeat_is_refused_at_trace_time_with_a_devicekit_error() -> None:
    torch._dynamo.reset()
    module = nn.Linear(1, 1)
    msg = "Cannot move data['model'] inside torch.compile: a Linear moves in place, as"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(lambda b: dk.to_device(b, CPU))({"model": module})
    # Without fullgraph, the compiler leaves that call to Python: the eager result.
    torch._dynamo.reset()
    assert _compiled(lambda b: dk.to_device(b, CPU), fullgraph=False)({"model": module}) == {
        "model": module
    }
    torch._dynamo.reset()
    msg = "Cannot move data inside torch.compile to the current device"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(dk.to_device)({"x": torch.ones(1)})


def test_a_dataclass_first_met_inside_a_compiled_region_is_refused_then_traced() -> None:
    @dataclasses.dataclass
    class Fresh:
        x: torch.Tensor

    torch._dynamo.reset()
    msg = "devicekit meets the type"
    with pytest.raises(Exception, match=re.escape(msg)):
        _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.float16))([Fresh(torch.ones(1))])
    dk.to_device(Fresh(torch.ones(1)), CPU)  # met once, outside
    torch._dynamo.reset()
    moved = _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.float16))([Fresh(torch.ones(1))])
    assert type(moved[0]) is Fresh
    assert moved[0].x.dtype == torch.float16


class CountingBackend:
    """A torch.compile backend that runs the graph as it is and counts the compilations."""

    def __init__(self) -> None:
        self.compiled = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.compiled += 1
        return graph.forward


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dtype": torch.float16},
        {"copy": True},
        {"memory_format": torch.channels_last},
        {"non_blocking": True},
        {"non_blocking": False},
        {"strict": True},
        {"skip_keys": "raw"},
        {"device": META, "dtype": torch.bfloat16},
    ],
    ids=repr,
)
def test_fresh_batches_of_one_structure_compile_once_with_every_option(
    options: dict[str, Any],
) -> None:
    torch._dynamo.reset()
    options = dict(options)
    device = options.pop("device", CPU)
    backend = CountingBackend()
    step = torch.compile(
        lambda b: dk.to_device(b, device, **options), fullgraph=True, backend=backend
    )
    for _ in range(12):  # each batch fresh, as a DataLoader makes them
        shared = torch.randn(2)
        batch = {
            "x": shared,
            "again": shared,
            "image": torch.randn(1, 3, 2, 2),
            "raw": torch.randn(1),
            "ids": torch.arange(3),
            "pair": Pair(torch.randn(1), 3),
        }
        moved = step(batch)
        eager = dk.to_device(batch, device, **options)
        assert moved["x"] is moved["again"]
        for key in ("x", "image", "raw", "ids"):
            assert (moved[key].device, moved[key].dtype) == (eager[key].device, eager[key].dtype)
            if not moved[key].is_meta:
                assert torch.equal(moved[key], eager[key])
    assert backend.compiled == 1


class Handle:
    """An object that neither moves nor is a plain scalar: strict=True refuses it."""


@pytest.mark.parametrize(
    ("call", "data", "error", "said"),
    [
        (
            lambda b: dk.to_device(b, CPU, non_blocking="yes"),
            torch.ones(1),
            ValueError,
            "Expected non_blocking to be 'auto', True or False, got 'yes'.",
        ),
        (
            lambda b: dk.to_device(b, CPU),
            {"model": nn.Linear(1, 1)},
            dk.TransferError,
            "Cannot move data['model'] inside torch.compile: a Linear moves in place",
        ),
        (
            lambda b: dk.to_device(b, CPU),
            [nn.utils.rnn.pack_sequence([torch.ones(2, 1)])],
            dk.TransferError,
            "Cannot move data[0] inside torch.compile: a PackedSequence moves with its .to()",
        ),
        (
            lambda b: dk.to_device(b, CPU, strict=True),
            {"x": torch.ones(1), "handle": Handle()},
            dk.TransferError,
            "Cannot move data['handle']: it is a tests.test_one_table.Handle",
        ),
        (
            lambda b: dk.to_device(b, "gpu"),
            torch.ones(1),
            dk.DeviceUnavailableError,
            "Expected a device such as 'cpu'",
        ),
        (
            lambda b: dk.to_device(b, 7),
            torch.ones(1),
            dk.DeviceUnavailableError,
            "Expected an accelerator for the device index 7",
        ),
    ],
    ids=["bad-option", "module", "packed-sequence", "strict", "gpu", "index"],
)
def test_devicekit_s_refusals_reach_the_user_as_its_own_errors_under_fullgraph(
    call: Any, data: Any, error: type[Exception], said: str
) -> None:
    torch._dynamo.reset()
    with pytest.raises(error) as raised:
        torch.compile(call, fullgraph=True, backend="eager")(data)
    assert str(raised.value).startswith(said)


def test_a_deque_is_refused_in_a_compiled_region_with_devicekit_s_reason() -> None:
    # The compiler reads an input deque's maxlen as None (PyTorch 2.13): its copy would
    # not be the same deque.
    torch._dynamo.reset()
    batch = deque([torch.ones(1), torch.zeros(1)], maxlen=3)
    with pytest.raises(
        dk.TransferError, match=re.escape("Cannot move data inside torch.compile: it is a deque")
    ):
        _compiled(lambda b: dk.to_device(b, CPU, dtype=torch.float16))(batch)
    assert dk.to_device(batch, CPU).maxlen == 3


def test_data_too_deep_for_the_compiler_is_a_devicekit_error_and_fine_eagerly() -> None:
    deep: Any = torch.ones(1)
    for _ in range(200):
        deep = [deep]
    torch._dynamo.reset()
    with pytest.raises(dk.TransferError, match="it nests more than 64 containers deep"):
        _compiled(lambda b: dk.to_device(b, CPU))(deep)
    assert dk.to_device(deep, META) is not deep


def test_run_while_tracing_marks_a_function_as_torch_s_assume_constant_result_does() -> None:
    # devicekit sets the mark itself (torch.compiler's helper imports dynamo, about a
    # second): a PyTorch that marks constants otherwise fails here, not in a user's graph.
    def mine() -> int:
        return 1

    def theirs() -> int:
        return 1

    _compat.run_while_tracing(mine)
    torch.compiler.assume_constant_result(theirs)  # type: ignore[no-untyped-call]
    marks = {name for name in vars(theirs) if "dynamo" in name}
    assert marks
    assert {name: vars(mine).get(name) for name in marks} == {
        name: vars(theirs)[name] for name in marks
    }


def test_without_fullgraph_a_refusal_breaks_the_graph_and_the_call_runs_eagerly() -> None:
    torch._dynamo.reset()
    packed = nn.utils.rnn.pack_sequence([torch.ones(2, 1)])
    moved = _compiled(lambda b: dk.to_device(b, META), fullgraph=False)([packed])
    assert moved[0].data.is_meta
    assert moved[0].batch_sizes.is_cpu


def test_a_type_is_decided_once_then_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    class Fresh:
        pass

    made: list[type] = []
    decide_for_real = _kinds._decide

    def counting(cls: type) -> Any:
        made.append(cls)
        return decide_for_real(cls)

    monkeypatch.setattr(_kinds, "_decide", counting)
    views = _kinds._views
    first = _kinds.decide(Fresh)
    assert all(_kinds.decide(Fresh) is first for _ in range(5))
    assert made == [Fresh]
    assert _kinds._views is views  # looked up: no view rewritten


def test_a_skip_set_s_view_is_made_once_and_starts_over_with_the_registry() -> None:
    skip = frozenset({"raw"})
    view = _kinds.skipping_view(_kinds.MOVE, skip)
    assert _kinds.skipping_view(_kinds.MOVE, skip) is view
    dk.to_device({"raw": torch.ones(1), "x": torch.ones(1)}, META, skip_keys="raw")

    @dataclasses.dataclass
    class Boxes:
        xyxy: torch.Tensor

    @dk.register_transfer(Boxes)
    def move_boxes(boxes: Boxes, device: torch.device, **options: Any) -> Boxes:
        return Boxes(boxes.xyxy.to(device) + 1)

    try:
        assert _kinds.skipping_view(_kinds.MOVE, skip) is not view  # started over
        moved = dk.to_device({"raw": 1, "b": Boxes(torch.zeros(1))}, CPU, skip_keys="raw")
        assert torch.equal(moved["b"].xyxy, torch.ones(1))  # the new rule applies at once
    finally:
        dk.unregister_transfer(Boxes)


@pytest.mark.usefixtures("swap_module_params")
def test_a_model_and_its_optimizer_move_in_one_call_that_waits_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Followed call by call: each copy of the optimizer's state is made to need the one
    # wait, as a copy from an accelerator to the host does under "auto".
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    calls: list[object] = []
    waits: list[set[torch.device]] = []
    init = _transfer._Call.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        init(self, *args, **kwargs)

    def needs_the_wait(self: Any, tensor: torch.Tensor, device: torch.device) -> bool:
        self.waits = (self.waits or set()) | {torch.device("cuda", 0)}
        return False

    monkeypatch.setattr(_transfer._Call, "__init__", counted)
    monkeypatch.setattr(_transfer._Call, "non_blocking", needs_the_wait)
    monkeypatch.setattr(_transfer._Call, "finish", lambda self: waits.append(set(self.waits)))
    model, optimizer = dk.to_device([model, optimizer], META)
    state = optimizer.state[model.weight]
    assert state["exp_avg"].is_meta
    assert state["step"].is_cpu  # kept on the host by its key, as the table says
    assert len(calls) == 1  # one call: one memo for the model, the optimizer, its state
    assert waits == [{torch.device("cuda", 0)}]  # and one wait


def _device(name: str) -> torch.device:
    return torch.device(name)


@pytest.mark.parametrize(
    ("source", "target", "non_blocking", "asynchronous"),
    [
        ("cpu", "cuda:0", "auto", True),  # to an accelerator: overlapped
        ("cuda:0", "cpu", "auto", True),  # to the host: asynchronous, then one wait
        ("cpu", "cpu", "auto", False),  # host to host: nothing to overlap
        ("cpu", "meta", "auto", False),
        ("mps", "cpu", "auto", False),  # MPS copies can corrupt data asynchronously
        ("cpu", "mps", "auto", False),
        ("cpu", "mps", True, False),  # whatever is asked
        ("cuda:0", "cpu", False, False),  # as asked
        ("cpu", "cuda:0", False, False),
        ("cuda:0", "cpu", True, True),
    ],
)
def test_one_rule_says_whether_a_copy_is_asynchronous(
    source: str, target: str, non_blocking: Any, asynchronous: bool
) -> None:
    options = _transfer.Options(non_blocking=non_blocking)
    plan = _transfer._Plan(_device(target), options)
    assert plan.asynchronous(_device(source), _device(target)) is asynchronous
    traced = _transfer._Plan(_device(target), options, traced=True)
    in_a_graph = asynchronous and not (traced.host and non_blocking == "auto")
    assert traced.asynchronous(_device(source), _device(target)) is in_a_graph
