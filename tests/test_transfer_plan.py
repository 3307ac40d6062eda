"""How to_device carries out one call: its plan, one crossing into the engine, one wait.

The plan says which copies are asynchronous and is made once per resolved device. meta
is the second device on CPU machines; the stand-in accelerator of devicekit.testing is
the accelerator where a test asks for it.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit._core import _transfer

from .helpers import CPU, META, Pair


def test_one_call_crosses_into_the_engine_once(stand_in_device: torch.device) -> None:
    calls: list[str] = []

    def record(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        caller = frame.f_back
        if (
            frame.f_code.co_filename.endswith("devicekit/_core/_tree.py")
            and caller is not None
            and caller.f_code.co_filename.endswith("devicekit/_core/_transfer.py")
        ):
            calls.append(frame.f_code.co_name)

    batch = {"inputs": Pair(torch.ones(2), torch.ones(2)), "targets": [torch.ones(1)] * 3}
    shared = batch["targets"][0]
    batch["targets"] = [torch.ones(1) for _ in range(3)]
    for device, data in ((META, batch), (stand_in_device, [*[torch.ones(2)] * 12, batch])):
        calls.clear()
        sys.setprofile(record)
        try:
            dk.to_device(data, device)
        finally:
            sys.setprofile(None)
        assert calls == ["map_flat" if device == stand_in_device else "map_leaves"], calls
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
    init = _transfer.Call.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        init(self, *args, **kwargs)

    def needs_the_wait(self: Any, tensor: torch.Tensor, device: torch.device) -> bool:
        self.waits = (self.waits or set()) | {torch.device("cuda", 0)}
        return False

    monkeypatch.setattr(_transfer.Call, "__init__", counted)
    monkeypatch.setattr(_transfer.Call, "non_blocking", needs_the_wait)
    monkeypatch.setattr(_transfer.Call, "finish", lambda self: waits.append(set(self.waits)))
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
    plan = _transfer.Plan(_device(target), options)
    waited = asynchronous and plan.host and non_blocking == "auto"  # once, before the return
    assert plan.copy(_device(source).type, _device(target)) == (asynchronous, waited)
    traced = _transfer.Plan(_device(target), options, traced=True)
    in_a_graph = asynchronous and not (traced.host and non_blocking == "auto")
    assert traced.copy(_device(source).type, _device(target)) == (in_a_graph, False)


def test_a_device_without_an_index_is_resolved_on_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "cuda" means the current CUDA device, which set_device changes between calls; the
    # plans cached for resolved devices must not answer for it. Stand-in: a device
    # type whose current device is meta, then cpu.
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


def test_a_flat_batch_of_distinct_tensors_moves_in_one_call_of_the_mover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = _transfer._plan(META, _transfer._DEFAULTS)
    assert plan.kept is not None
    moved_one_by_one: list[object] = []
    move = plan.move

    def counted(obj: Any, call: Any) -> Any:
        moved_one_by_one.append(obj)
        return move(obj, call)

    monkeypatch.setattr(plan, "move", counted)
    tensors = [torch.ones(2) for _ in range(8)]
    for batch in (dict(zip("abcdefgh", tensors, strict=True)), tensors, tuple(tensors)):
        assert [t.device for t in tensor_values(dk.to_device(batch, META))] == [META] * 8
    assert moved_one_by_one == []
    # One tensor twice, a namedtuple, a plain value beside them: the walk, a leaf at a time.
    for batch in ([tensors[0], tensors[0]], Pair(*tensors[:2]), [tensors[0], 3]):
        moved_one_by_one.clear()
        dk.to_device(batch, META)
        walked = {id(t) for t in batch if isinstance(t, torch.Tensor)}
        assert {id(leaf) for leaf in moved_one_by_one} == walked  # twice over, for a repeat


def tensor_values(batch: Any) -> list[torch.Tensor]:
    return list(batch.values() if isinstance(batch, dict) else batch)


@pytest.mark.parametrize(
    ("device", "options", "in_one_call"),
    [
        (META, {}, True),
        (META, {"non_blocking": True}, True),
        (META, {"strict": True}, True),
        (CPU, {"non_blocking": False}, True),
        # To the host under "auto" a copy from an accelerator is waited for: a tensor at a time.
        (CPU, {}, False),
        (META, {"dtype": torch.float16}, None),
        (META, {"copy": True}, None),
        (META, {"memory_format": torch.channels_last}, None),
    ],
)
def test_a_flat_batch_moves_in_one_call_only_where_each_tensor_would_move_alone(
    device: torch.device,
    options: dict[str, Any],
    in_one_call: bool | None,
    stand_in_device: torch.device,
) -> None:
    plan = _transfer._plan(device, _transfer.Options(**options))
    if in_one_call is None:  # options: every tensor through the call
        assert plan.kept is None
    else:
        assert plan.kept is not None
        assert (plan.kept[2] is not None) is in_one_call
    assert _transfer._plan(stand_in_device, _transfer.Options(**options)).kept is None  # the walk
