"""find_devices, check_same_device and guard, with meta as the second device."""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import devicekit as dk
from devicekit._base import _compat
from devicekit._core import _tree, _unmoved
from devicekit.testing import batches, tensors

from .helpers import CPU, META


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, batch: dict[str, torch.Tensor], *, mask: torch.Tensor | None = None) -> Any:
        hidden = self.fc(batch["image"])
        if mask is not None:
            hidden = hidden * mask
        return self.head(hidden)


# find_devices.


def test_find_devices_names_keys_indices_and_fields() -> None:
    batch = {"image": torch.zeros(2, device="meta"), "targets": [torch.ones(1), 3, torch.ones(2)]}
    assert dk.find_devices(batch) == {
        META: ["['image']"],
        CPU: ["['targets'][0]", "['targets'][2]"],
    }


def test_find_devices_names_module_parameters_and_buffers() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    net[0].to("meta")
    assert dk.find_devices({"model": net}) == {
        META: ["['model'].0.weight", "['model'].0.bias"],
        CPU: [
            "['model'].1.weight",
            "['model'].1.bias",
            "['model'].1.running_mean",
            "['model'].1.running_var",
            "['model'].1.num_batches_tracked",
        ],
    }


def test_find_devices_names_optimizer_parameters_and_state() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    paths = dk.find_devices(optimizer)[CPU]
    # No "step": PyTorch keeps it on the host on purpose, and to_device leaves it there.
    assert paths[:4] == [
        "param_groups[0]['params'][0]",
        "state[param_groups[0]['params'][0]]['exp_avg']",
        "state[param_groups[0]['params'][0]]['exp_avg_sq']",
        "param_groups[0]['params'][1]",
    ]
    capturable = torch.optim.Adam(model.parameters(), capturable=True)
    capturable.state[model.weight] = dict(optimizer.state[model.weight])  # (no step on CPU)
    paths = dk.find_devices(capturable)[CPU]
    assert paths[1] == "state[param_groups[0]['params'][0]]['step']"  # on the device by design


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


def test_the_checks_see_inside_a_packed_sequence() -> None:
    packed = nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    on_meta = dk.to_device(packed, META)
    # batch_sizes stays on the host by PyTorch's design: the checks leave it out.
    assert dk.find_devices({"seq": packed}) == {CPU: ["['seq'].data"]}
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.check_same_device({"seq": on_meta, "mask": torch.ones(2)})
    assert info.value.devices[META] == ["data['seq'].data"]
    assert "data['mask']" in info.value.devices[CPU]


def test_the_checks_name_no_path_where_there_is_no_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Naming every one of a million ints took find_devices 0.7 s; to_device takes 28 ms.
    named: list[int] = []
    paths = _tree.paths
    monkeypatch.setattr(_unmoved, "paths", lambda flat: named.append(1) or paths(flat))
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


def _oracle(data: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Paths by plain recursion over the strategy's containers: an independent reference."""
    if isinstance(data, torch.Tensor):
        yield path, data
    elif isinstance(data, Mapping):
        for key, value in data.items():
            yield from _oracle(value, f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(data) and not isinstance(data, type):
        for field in dataclasses.fields(data):
            yield from _oracle(getattr(data, field.name), f"{path}.{field.name}")
    elif isinstance(data, tuple) and hasattr(data, "_fields"):
        for name, value in zip(data._fields, data, strict=True):
            yield from _oracle(value, f"{path}.{name}")
    elif isinstance(data, list | tuple):
        for index, value in enumerate(data):
            yield from _oracle(value, f"{path}[{index}]")


spread = tensors().flatmap(lambda t: st.sampled_from([t, t.to("meta")]))


@given(batches(leaves=spread | st.none() | st.integers()))
def test_find_devices_returns_exactly_the_planted_devices_and_paths(batch: Any) -> None:
    expected: dict[torch.device, list[str]] = {}
    for path, tensor in _oracle(batch):
        # A root's fields read as a root module's parameters do: "first", not ".first".
        expected.setdefault(tensor.device, []).append(path.removeprefix("."))
    assert dk.find_devices(batch) == expected


# check_same_device.


def test_one_device_is_returned() -> None:
    assert dk.check_same_device(nn.Linear(2, 2), {"x": torch.ones(2)}) == CPU
    assert dk.check_same_device(torch.ones(1), device="cpu") == CPU


def test_check_same_device_takes_the_device_by_keyword() -> None:
    msg = (
        "Expected tensors, modules, optimizers or containers of them as the data, and the "
        "device as device=..., got the device 'meta' as data[1]. Write "
        "check_same_device(..., device='meta')."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.check_same_device(torch.ones(1), "meta")


def test_a_mismatch_lists_every_device_with_paths_and_carries_the_mapping() -> None:
    model = nn.Linear(2, 2)
    batch = {"x": torch.ones(2, device="meta"), "y": torch.ones(1)}
    msg = (
        "Expected every tensor on one device, but found 2: cpu has Linear.weight, Linear.bias "
        "and data[1]['y']; meta has data[1]['x']."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info:
        dk.check_same_device(model, batch)
    assert info.value.devices == {
        CPU: ["Linear.weight", "Linear.bias", "data[1]['y']"],
        META: ["data[1]['x']"],
    }


def test_long_path_lists_are_shortened() -> None:
    batch = [torch.ones(1, device="meta")] * 6 + [torch.ones(1)]
    msg = "found 2: meta has data[0], data[1], data[2] and 3 more; cpu has data[6]."
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        dk.check_same_device(batch)


def test_an_expected_device_is_enforced() -> None:
    msg = "Expected every tensor on meta, but found 1 device(s): cpu has data['x']."
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        dk.check_same_device({"x": torch.ones(1)}, device="meta")


def test_nothing_to_check_is_refused() -> None:
    msg = "Expected tensors to check, but found none in 2 arguments."
    with pytest.raises(ValueError, match=re.escape(msg)):
        dk.check_same_device({"ids": [1, 2]}, None)


@pytest.mark.parametrize("check", [dk.find_devices, dk.check_same_device])
def test_a_cycle_is_named_from_the_root(check: Any) -> None:
    # The root has its name and one space around it (it read "[1] is the list  itself").
    looped: list[Any] = [torch.zeros(1)]
    looped.append(looped)
    msg = "Expected data without reference cycles, but data[1] is the list data itself,"
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        check(looped)
    cyclic: dict[str, Any] = {"x": torch.zeros(1)}
    cyclic["again"] = cyclic
    msg = "but data['again'] is the dict data itself, which contains it."
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        check(cyclic)


@pytest.mark.usefixtures("swap_module_params")
def test_the_resume_bug_is_caught_and_fixed() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    checkpoint = optimizer.state_dict()
    # Resume: a fresh optimizer loads its state while the model is on the host, then
    # the model moves; the state stays behind.
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(checkpoint)
    dk.to_device(model, META)
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.check_same_device(model, optimizer)
    assert info.value.devices[CPU][:2] == [
        "Adam.state[param_groups[0]['params'][0]]['exp_avg']",
        "Adam.state[param_groups[0]['params'][0]]['exp_avg_sq']",
    ]
    dk.to_device(optimizer, META)
    # Only "step" is left on the host, as PyTorch keeps it: the check agrees.
    assert dk.check_same_device(model, optimizer) == META
    assert optimizer.state[model.weight]["step"].device == CPU


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


# guard.


def test_guard_takes_a_module() -> None:
    msg = "Expected a torch.nn.Module to guard, got int 5."
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.guard(5)  # type: ignore[arg-type]


def test_an_input_on_the_wrong_device_is_named_with_the_module() -> None:
    net = Net().to("meta")
    msg = (
        "batch['image'] is on cpu but the parameters of Net (e.g. fc.weight, fc.bias) are on "
        "meta. Devices seen: meta has the parameters of Net; cpu has batch['image']."
    )
    with dk.guard(net), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info:
        net({"image": torch.ones(1, 4)})
    assert info.value.devices[CPU] == ["batch['image']"]


def test_keyword_and_nested_inputs_are_named() -> None:
    net = Net().to("meta")
    inputs = {"image": torch.ones(1, 4, device="meta")}
    msg = "mask is on cpu but the parameters of Net"
    with dk.guard(net), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        net(inputs, mask=torch.ones(4))


def test_a_layer_left_behind_is_named_by_recurse() -> None:
    net = Net()
    net.fc.to("meta")  # the model moved layer by layer, and head was forgotten
    msg = "input is on meta but the parameters of Net.head (Linear) (e.g. weight, bias) are on cpu."
    with dk.guard(net, recurse=True), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        net({"image": torch.ones(1, 4, device="meta")})


def test_a_layer_left_behind_advises_moving_the_model_not_the_inputs() -> None:
    # meta stands in for the GPU: most of the model is there, head was left on the host.
    net = Net()
    net.fc.to(META)
    msg = (
        "input is on meta but the parameters of Net.head (Linear) (e.g. weight, bias) are on "
        "cpu. Net is split: 20 of its 30 elements are on meta (Net.fc), 10 on cpu (Net.head). "
        "Move the model with devicekit.to_device(model, 'meta'), which moves all of it to one "
        "device."
    )
    with (
        dk.guard(net, recurse=True),
        pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info,
    ):
        net({"image": torch.ones(1, 4, device=META)})
    assert "Move the inputs" not in str(info.value)
    assert info.value.devices == {
        META: ["Net.fc.weight", "Net.fc.bias", "input"],
        CPU: ["Net.head.weight", "Net.head.bias"],
    }


def test_a_split_model_is_moved_to_where_most_of_it_is_when_the_inputs_are_elsewhere() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    net[1].to(META)
    net[2].to(META)  # its first layer left on the host, the inputs there too
    msg = (
        "input is on cpu but the parameters of Sequential.1 (Linear) (e.g. weight, bias) are "
        "on meta. Sequential is split: 30 of its 50 elements are on meta (Sequential.1 and "
        "Sequential.2), 20 on cpu (Sequential.0). Move the model with "
        "devicekit.to_device(model, 'meta'), which moves all of it to one device. Move the "
        "inputs there too."
    )
    with dk.guard(net, recurse=True), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        net(torch.ones(1, 4))
    said = "Sequential is split: 30 of its 50 elements are on meta"
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(said)) as info, dk.guard(net):
        net(torch.ones(1, 4))  # passes the check against layer 0, refused at layer 1
    # Sequential's forward is PyTorch's: no frame of the user's to name, nor inputs to read.
    assert "PyTorch refused to mix them in Sequential's call. Move the model" in str(info.value)


def test_a_split_model_refused_inside_forward_is_named_on_leaving_the_guard() -> None:
    # guard without recurse checks the inputs against fc, on meta as they are: PyTorch then
    # refuses head, on the host, inside the forward.
    net = Net()
    net.fc.to(META)
    msg = (
        "Net is split: 20 of its 30 elements are on meta (Net.fc), 10 on cpu (Net.head). "
        "PyTorch refused to mix them in Net.forward (test_checks.py:"
    )
    fix = "Move the model with devicekit.to_device(model, 'meta'), which moves all of it"
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(net):
        net({"image": torch.ones(1, 4, device=META)})
    assert fix in str(info.value)
    assert "Move the inputs" not in str(info.value)
    assert type(info.value.__cause__) is RuntimeError  # PyTorch's own error, kept


class Norms(nn.Module):
    """A layer's weight beside a norm: most elements in the one, two tensors in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(512, 512, bias=False)
        self.norm = nn.LayerNorm(512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Norms(), Norms(), Norms())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_a_split_model_goes_where_most_of_its_elements_are_not_most_of_its_tensors() -> None:
    # 3 weights of 262,144 elements on meta (the GPU), 6 norm tensors of 512 on the host:
    # counted by tensors, the model would be sent to the host.
    tower = Tower()
    for block in tower.blocks:
        block.linear.to(META)
    split = (
        "Tower is split: 786,432 of its 789,504 elements are on meta (Tower.blocks.0.linear, "
        "Tower.blocks.1.linear and Tower.blocks.2.linear), 3,072 on cpu (Tower.blocks.0.norm, "
        "Tower.blocks.1.norm and Tower.blocks.2.norm)."
    )
    fix = (
        "Move the model with devicekit.to_device(model, 'meta'), which moves all of it to one "
        "device."
    )
    with pytest.raises(dk.DeviceMismatchError) as info, dk.guard(tower):
        tower(torch.ones(2, 512, device=META))
    assert str(info.value).startswith(f"{split} PyTorch refused to mix them in Norms.forward")
    assert str(info.value).endswith(fix)
    assert info.value.devices == {
        META: [f"Tower.blocks.{i}.linear.weight" for i in range(3)],
        CPU: [f"Tower.blocks.{i}.norm.{name}" for i in range(3) for name in ("weight", "bias")],
    }
    said = (
        "input is on meta but the parameters of Tower.blocks.0.norm (LayerNorm) (e.g. weight, "
        f"bias) are on cpu. {split} {fix}"
    )
    with (
        pytest.raises(dk.DeviceMismatchError, match=f"^{re.escape(said)}$"),
        dk.guard(tower, recurse=True),
    ):
        tower(torch.ones(2, 512, device=META))


def test_a_part_of_a_split_model_on_meta_is_given_storage_before_the_move() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    net[1].to(META)  # most of it is on the host, a part has no data to move
    msg = (
        "Sequential is split: 72 of its 81 elements are on cpu (Sequential.0), 9 on meta "
        "(Sequential.1). PyTorch refused to mix them in Sequential's call. Tensors on the meta "
        "device have shapes but no data: give the model storage with "
        "devicekit.materialize(model, 'cpu'), which initialises it and names whatever no "
        "initialiser writes; then move the model with devicekit.to_device(model, 'cpu'), "
        "which moves all of it to one device."
    )
    with pytest.raises(dk.DeviceMismatchError, match=f"^{re.escape(msg)}$"), dk.guard(net):
        net(torch.ones(1, 8))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def test_a_buffer_left_on_another_device_is_named_on_leaving_the_guard() -> None:
    model = dk.to_device(Normed(), META)
    model.norm.running_mean = torch.zeros(4)  # still a registered buffer, now on the host
    msg = (
        "Normed is split: 33 of its 37 elements are on meta (Normed.fc, Normed.norm.weight, "
        "Normed.norm.bias and 2 more), 4 on cpu (Normed.norm.running_mean). PyTorch refused "
        "to mix them in Normed.forward (test_checks.py:"
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(model):
        model(torch.ones(2, 4, device=META))
    assert info.value.devices[CPU] == ["Normed.norm.running_mean"]


def test_only_a_module_on_meta_is_advised_materialize() -> None:
    # The batch on meta, the model on the host: the model needs no storage.
    model = nn.Linear(2, 2)
    msg = (
        "Expected every tensor on one device, but found 2: cpu has Linear.weight and "
        "Linear.bias; meta has data[1]['image']."
    )
    with pytest.raises(dk.DeviceMismatchError, match=f"^{re.escape(msg)}$"):
        dk.check_same_device(model, {"image": torch.zeros(2, device=META)})
    with pytest.raises(dk.DeviceMismatchError, match=r"materialize\(model, 'cpu'\)"):
        dk.check_same_device(model.to(META), {"image": torch.zeros(2)})


def test_a_guard_that_finds_nothing_changes_nothing() -> None:
    net = Net()
    expected = net({"image": torch.ones(1, 4)})
    with dk.guard(net, recurse=True):
        assert torch.equal(net({"image": torch.ones(1, 4)}), expected)


def test_removed_guards_leave_no_hooks() -> None:
    net = Net()
    handle = dk.guard(net, recurse=True)
    assert len(net.fc._forward_pre_hooks) == 1
    handle.remove()
    assert all(len(module._forward_pre_hooks) == 0 for module in net.modules())
    with dk.guard(net):
        assert len(net._forward_pre_hooks) == 1
    assert len(net._forward_pre_hooks) == 0


def test_a_packed_sequence_s_batch_sizes_kept_on_the_host_is_accepted() -> None:
    # PyTorch keeps batch_sizes on the host by design: PackedSequence.to leaves it there,
    # and the RNNs read it there.
    lstm = dk.to_device(torch.nn.LSTM(2, 3), META)
    sequences = [torch.ones(3, 2), torch.ones(2, 2)]
    packed = torch.nn.utils.rnn.pack_sequence(sequences, enforce_sorted=False)
    moved = dk.to_device(packed, META)
    assert moved.batch_sizes.is_cpu
    assert dk.check_same_device(lstm, moved) == META
    with dk.guard(lstm):
        lstm(moved)  # no mismatch raised before PyTorch runs it
    assert dk.find_devices(moved) == {META: ["data", "sorted_indices", "unsorted_indices"]}
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("cpu has data[1].data")):
        dk.check_same_device(lstm, packed)  # the data left behind is still named


def test_guard_names_a_packed_sequence_on_another_device() -> None:
    lstm = nn.LSTM(2, 4)
    packed = nn.utils.rnn.pack_sequence([torch.ones(3, 2, device=META)])
    msg = "input.data is on meta but the parameters of LSTM (e.g. weight_ih_l0, weight_hh_l0)"
    with dk.guard(lstm), pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        lstm(packed)


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


# guard: tensors a forward made on another device, named when PyTorch refuses them.


class Sequence(nn.Module):
    """PyTorch's time-sequence-prediction example: the states are made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 8)
        self.linear = nn.Linear(8, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        outputs = []
        h_t = torch.zeros(input.size(0), 8, dtype=torch.double)  # on the host
        c_t = torch.zeros(input.size(0), 8, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            outputs.append(self.linear(h_t))
        return torch.cat(outputs, dim=1)


def test_guard_names_the_states_a_forward_made_on_the_host() -> None:
    model = Sequence().double().to(META)
    msg = "h_t and c_t in Sequence.forward (test_checks.py:"  # the line of the failing call
    fix = (
        "are on cpu but the input and the parameters of Sequence are on meta. A tensor made "
        "inside forward is put on the host unless told otherwise. Make them on the input's "
        "device: torch.zeros(..., device=input.device), input.new_zeros(...) or "
        "torch.zeros_like(input)."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(model):
        model(torch.zeros(2, 3, dtype=torch.double, device=META))
    assert fix in str(info.value)
    assert info.value.devices == {META: ["input"], CPU: ["h_t", "c_t"]}
    # PyTorch's own error is kept as the cause, and the hooks are gone all the same.
    assert type(info.value.__cause__) is RuntimeError
    assert "is not on the expected device" in str(info.value.__cause__)
    assert not model._forward_pre_hooks


def test_an_input_on_the_wrong_device_keeps_its_advice_in_the_same_model() -> None:
    model = Sequence().double()
    msg = (
        "input is on meta but the parameters of Sequence (e.g. lstm1.weight_ih, lstm1.weight_hh) "
        "are on cpu. Devices seen: cpu has the parameters of Sequence; meta has input. Move "
        "the inputs with devicekit.to_device(..., 'cpu'), or the module to the inputs' device."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(model):
        model(torch.zeros(2, 3, dtype=torch.double, device=META))
    assert info.value.__cause__ is None  # raised before the forward ran


@pytest.mark.cuda
def test_guard_names_the_states_a_forward_made_on_the_host_of_a_cuda_model() -> None:
    # CUDA's own words for the mix differ from meta's (the RNN cell's or TensorIterator's).
    model = Sequence().double().cuda()
    msg = "h_t and c_t in Sequence.forward (test_checks.py:"
    fix = "are on cpu but the input and the parameters of Sequence are on cuda:"
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(model):
        model(torch.zeros(2, 3, dtype=torch.double, device="cuda"))
    assert fix in str(info.value)
    cause = info.value.__cause__
    assert cause is not None
    assert _compat.is_device_mismatch(cause)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(3, 3)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(0.5)  # a host scalar: PyTorch takes it next to any device
        return self.cell(x * scale, h)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h0 = torch.zeros(2, 3)
        return self.block(batch["x"], h0)


def test_a_tensor_passed_down_is_named_where_the_forward_made_it() -> None:
    model = Outer().to(META)
    msg = "h0 in Outer.forward (test_checks.py:"
    fix = (
        "is on cpu but the input and the parameters of Outer are on meta. A tensor made inside "
        "forward is put on the host unless told otherwise. Make it on the input's device: "
        "torch.zeros(..., device=batch['x'].device), batch['x'].new_zeros(...) or "
        "torch.zeros_like(batch['x'])."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(model):
        model({"x": torch.zeros(2, 3, device=META)})
    assert fix in str(info.value)
    assert info.value.devices == {META: ["batch['x']"], CPU: ["h0"]}


class Inline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(1, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x, (torch.zeros(1, x.size(0), 4), torch.zeros(1, x.size(0), 4)))
        return out


def test_a_factory_called_in_the_failing_call_without_device_is_named() -> None:
    model = Inline().to(META)
    msg = (
        "The call self.lstm(x, (torch.zeros(1, x.size(0), 4), torch.zeros(1, x.size(0), 4))) in "
        "Inline.forward (test_checks.py:"
    )
    fix = (
        "makes a tensor without device=, which puts it on cpu, but the input and the parameters "
        "of Inline are on meta. Make it on the input's device: torch.zeros(..., "
        "device=x.device), x.new_zeros(...) or torch.zeros_like(x)."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(model):
        model(torch.zeros(2, 5, 1, device=META))
    assert fix in str(info.value)
    assert "are not at the same device" in str(info.value.__cause__)  # the RNNs' own words


class Reshaping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor([3, 1])  # kept on the host on purpose, as pack_padded_sequence's
        return self.fc(x.view(-1, 3)) + lengths.sum()


def test_errors_other_than_mixed_devices_reach_the_user_unchanged() -> None:
    model = Reshaping().to(META)
    x = torch.zeros(2, 4, device=META)
    with pytest.raises(RuntimeError) as info, dk.guard(model):
        model(x)
    assert not isinstance(info.value, dk.DeviceKitError)
    assert "shape '[-1, 3]' is invalid" in str(info.value)
    # Mixed devices outside the guarded call are not the forward's either.
    with pytest.raises(RuntimeError) as info, dk.guard(model):
        model.fc(x) + torch.ones(2)
    assert not isinstance(info.value, dk.DeviceKitError)
    assert "is not on the expected device" in str(info.value)


def test_a_named_error_keeps_no_tensor_of_the_forward_alive() -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    class Keeping(Sequence):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            h_t = torch.zeros(input.size(0), 8, dtype=torch.double)
            made.append(weakref.ref(h_t))
            return self.lstm1(input, (h_t, h_t))[0]

    model = Keeping().double().to(META)
    msg = "h_t in Keeping.forward"
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)), dk.guard(model):
        model(torch.zeros(2, 1, dtype=torch.double, device=META))
    gc.collect()  # the error, its traceback and their frames form cycles
    assert made[0]() is None


MIXED_SAID = [
    (
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
        "and cpu!"
    ),
    (
        "Expected all tensors to be on the same device, but got mat1 is on cpu, different from "
        "other tensors on cuda:0 (when checking argument in method wrapper_CUDA_addmm)"
    ),
    "Tensor on device meta is not on the expected device cpu!",
    (
        "Input and hidden tensors are not at the same device, found input tensor at cuda:0 and "
        "hidden tensor at cpu"
    ),
    (
        "Expected tensor for argument #1 'input' to have the same device as tensor for argument "
        "#2 'weight'; but device 1 does not equal 0 (while checking arguments for "
        "cudnn_convolution)"
    ),
    "indices should be either on cpu or on the same device as the indexed tensor (cuda:0)",
    "Placeholder storage has not been allocated on MPS device!",
    (
        "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the "
        "same or input should be a MKLDNN tensor and weight is a dense tensor"
    ),
    "Input type (CUDAFloatType) and bias type (CPUFloatType) should be the same",
]
OTHER_SAID = [
    (
        "Input type (torch.cuda.DoubleTensor) and weight type (torch.cuda.FloatTensor) should be "
        "the same"
    ),
    "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x2)",
]


@pytest.mark.parametrize("said", MIXED_SAID + OTHER_SAID)
def test_pytorch_s_words_for_mixed_devices_are_recognised(said: str) -> None:
    assert _compat.is_device_mismatch(RuntimeError(said)) is (said in MIXED_SAID)
    assert _compat.is_device_mismatch(ValueError(said)) is False  # PyTorch raises RuntimeError


class Unprintable:
    """A key of the user's whose __repr__ raises."""

    def __repr__(self) -> str:
        msg = "no repr"
        raise ValueError(msg)


def test_a_key_whose_repr_raises_is_shown_in_the_paths_the_checks_name() -> None:
    # Issue 46: the repr's ValueError took the place of every answer.
    shown = "[<unprintable Unprintable: its __repr__ raised ValueError>]"
    batch = {Unprintable(): torch.zeros(1), "b": torch.zeros(1, device=META)}
    assert dk.find_devices(batch) == {CPU: [shown], META: ["['b']"]}
    msg = (
        f"Expected every tensor on one device, but found 2: cpu has data{shown}; meta has "
        "data['b']."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)):
        dk.check_same_device(batch)


# Issue 46: a host tensor made in a closure or a lambda that forward calls, whose frame
# is gone by the time the failing call runs.


class WithClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def bias() -> torch.Tensor:
            return torch.zeros(3)

        return self.fc(x) + bias()


class WithLambda(WithClosure):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = lambda: torch.randn(  # noqa: E731 - the lambda is what is tested
            3,
        )
        return self.fc(x) * noise()


class WithCell(WithClosure):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(3)
        state = lambda: h  # noqa: E731 - the lambda is what is tested
        return self.fc(x) + state()


class WithToldClosure(WithClosure):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def offset() -> torch.Tensor:
            return torch.zeros(3, device="cpu")  # on the host on purpose: not devicekit's to say

        return self.fc(x) + offset()


def _line_of(text: str) -> int:
    """The one line of this file that starts with ``text``, indenting aside."""
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    (found,) = (number for number, line in enumerate(lines, 1) if line.strip().startswith(text))
    return found


@pytest.mark.parametrize(
    ("model", "call", "runs", "factory", "made_in"),
    [
        (WithClosure, "self.fc(x) + bias()", "bias", "torch.zeros(3)", "return torch.zeros(3)"),
        (WithLambda, "self.fc(x) * noise()", "noise", "torch.randn(3,)", "noise = lambda:"),
    ],
    ids=["closure", "lambda"],
)
def test_guard_names_a_host_tensor_made_in_a_closure_forward_calls(
    model: type[nn.Module], call: str, runs: str, factory: str, made_in: str
) -> None:
    net = model().to(META)
    made_at = f"test_checks.py:{_line_of(made_in)}"
    msg = (
        f"The call {call} in {model.__name__}.forward "
        f"(test_checks.py:{_line_of('return ' + call)}) runs {runs}, whose {factory} "
        f"({made_at}) makes a tensor without device=, which puts it on cpu, but the input "
        f"and the parameters of {model.__name__} are on meta. Make it on the input's device: "
        "torch.zeros(..., device=x.device), x.new_zeros(...) or torch.zeros_like(x)."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)) as info, dk.guard(net):
        net(torch.zeros(2, 3, device=META))
    assert info.value.devices == {META: ["x"], CPU: [f"{runs} ({made_at})"]}
    assert _compat.is_device_mismatch(info.value.__cause__)  # PyTorch's own, as the cause


def test_guard_names_a_host_tensor_a_closure_holds_of_forwards() -> None:
    net = WithCell().to(META)
    msg = (
        f"h in WithCell.forward (test_checks.py:{_line_of('return self.fc(x) + state()')}) is "
        "on cpu but the input and the parameters of WithCell are on meta."
    )
    with pytest.raises(dk.DeviceMismatchError, match=re.escape(msg)), dk.guard(net):
        net(torch.zeros(2, 3, device=META))


def test_a_closure_that_names_its_device_is_not_said_to_lack_one() -> None:
    net = WithToldClosure().to(META)
    with pytest.raises(RuntimeError) as info, dk.guard(net):
        net(torch.zeros(2, 3, device=META))
    assert not isinstance(info.value, dk.DeviceKitError)
