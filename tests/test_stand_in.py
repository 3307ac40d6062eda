"""The stand-in accelerator itself: values, CUDA's rules, asynchrony, memory, the ledger.

Every test takes the ``stand_in_device`` fixture, which starts it once; tests/conftest.py
runs them after every test that expects this machine without it.
"""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import _devicekit_cli
import devicekit as dk
from devicekit.testing import stand_in, still_pinned

NAME = "standin"


@pytest.fixture
def on0(stand_in_device: torch.device) -> torch.device:
    return stand_in_device


@pytest.fixture
def on1(stand_in_device: torch.device) -> torch.device:
    return torch.device(stand_in_device.type, 1)


# Starting


def test_asked_again_alike_it_answers_alike_and_otherwise_refuses(on0: torch.device) -> None:
    assert stand_in() == stand_in(2) == NAME
    with pytest.raises(dk.DeviceKitError, match=re.escape("cannot start again with devices=3")):
        stand_in(3)
    with pytest.raises(dk.DeviceKitError, match="memory=1024"):
        stand_in(memory=1024)
    with pytest.raises(ValueError, match="devices to be a whole number of 1 or more, got 0"):
        stand_in(0)


def test_it_refuses_a_pytorch_without_python_backends_or_with_another_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.utils import backend_registration  # noqa: PLC0415 - the module patched

    from devicekit.testing._stand_in import _start  # noqa: PLC0415 - the check itself

    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    with pytest.raises(dk.DeviceKitError, match="PrivateUse1 device is taken by the 'npu'"):
        _start._refuse_where_unfit()
    monkeypatch.delattr(backend_registration, "_setup_privateuseone_for_python_backend")
    said = f"needs PyTorch 2.9 or later (Python backends); this is PyTorch {torch.__version__}."
    with pytest.raises(dk.DeviceKitError, match=re.escape(said)):
        _start._refuse_where_unfit()


def test_torch_accelerator_reports_it(on0: torch.device) -> None:
    found = torch.accelerator.current_accelerator()
    assert found is not None
    assert found.type == NAME
    assert torch.accelerator.device_count() == 2
    assert isinstance(torch.accelerator.current_stream(), torch.Stream)
    assert dk.DeviceManager().device == on0


def test_a_launcher_s_local_rank_selects_its_device_and_makes_it_current(
    on1: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        manager = dk.DeviceManager()
        assert manager.device == on1
        assert manager.explain().startswith(
            "Selected standin:1 (devicekit stand-in (CPU-backed)): LOCAL_RANK=1"
        )
        assert torch.accelerator.current_device_index() == 1  # as set_device is on a GPU
        assert torch.ones(1, device=NAME).device == on1  # "standin" is the current one
        manager.close()
    finally:
        torch.accelerator.set_device_index(0)


def test_devicekit_info_and_doctor_show_it(
    on0: torch.device, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _devicekit_cli.main(["info"]) == 0
    said = capsys.readouterr().out
    assert re.search(
        r"^\*  standin:0 +standin +devicekit stand-in \(CPU-backed\)", said, re.MULTILINE
    )
    assert "selected: standin:0" in said
    assert _devicekit_cli.main(["doctor"]) == 0
    assert "  standin:1 devicekit stand-in (CPU-backed)" in capsys.readouterr().out


# Values


def test_tensors_hold_the_values_the_cpu_computes(on0: torch.device, on1: torch.device) -> None:
    source = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    moved = source.to(on1)
    assert moved.device == on1
    assert torch.equal((moved @ moved.T).relu().cpu(), (source @ source.T).relu())
    assert torch.equal(torch.zeros(3, device=on0).cpu(), torch.zeros(3))
    assert torch.arange(4, device=on1).tolist() == [0, 1, 2, 3]
    assert torch.full((2,), 7, device=on0).sum().item() == 14


def test_tensors_made_from_python_data_go_to_the_device(on1: torch.device) -> None:
    made = torch.tensor([[1, 2], [3, 4]], device=on1)
    assert (made.device, made.tolist()) == (on1, [[1, 2], [3, 4]])
    leaf = torch.tensor(2.0, device=on1, requires_grad=True)
    assert leaf.is_leaf
    assert leaf.requires_grad
    assert leaf.device == on1
    assert torch.as_tensor([1, 2], device=on1, dtype=torch.float16).dtype == torch.float16
    assert torch.asarray([1.0], device=on1).device == on1
    assert made.new_tensor([5]).device == on1  # new_tensor: its tensor's device and dtype
    with torch.device(on1):
        assert torch.tensor([1.0]).device == on1


def test_a_view_writes_through_to_its_base(on0: torch.device) -> None:
    base = torch.zeros(4, device=on0)
    base[1:3].add_(5)
    view = base.view(2, 2)
    view[1, 1] = 9
    assert base.tolist() == [0.0, 5.0, 5.0, 9.0]


def test_an_in_place_operation_returns_the_same_tensor(on0: torch.device) -> None:
    tensor = torch.ones(2, device=on0)
    assert tensor.mul_(3) is tensor
    assert tensor.tolist() == [3.0, 3.0]


def test_it_prints_as_a_gpu_tensor_does(on1: torch.device) -> None:
    assert repr(torch.tensor([1.5, 2.0]).to(on1)) == "tensor([1.5000, 2.0000], device='standin:1')"
    assert f"{torch.tensor(2.5).to(on1):.1f}" == "2.5"


def test_a_deep_copy_is_a_tensor_of_its_own_and_counted(on1: torch.device) -> None:
    source = torch.arange(4.0).to(on1).requires_grad_()
    source.grad = torch.ones(4).to(on1)
    before = torch.accelerator.memory_allocated(on1)
    copied = copy.deepcopy(source)
    assert torch.accelerator.memory_allocated(on1) == before + 2 * 16  # values and gradient
    copied.data.add_(1)
    assert source.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert copied.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert copied.requires_grad
    assert copied.grad is not None
    assert copied.grad.tolist() == [1.0] * 4


def test_numpy_is_refused_as_on_cuda(on0: torch.device) -> None:
    said = "can't convert standin:0 device type tensor to numpy. Use Tensor.cpu() to copy"
    with pytest.raises(TypeError, match=re.escape(said)):
        torch.ones(2, device=on0).numpy()


def test_a_module_and_its_optimizer_train_as_on_the_cpu(on0: torch.device) -> None:
    def run(device: torch.device | str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        data = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            loss = model(data.to(device)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert {state["exp_avg"].device.type for state in optimizer.state.values()} == {
            torch.device(device).type
        }
        return [parameter.detach().cpu() for parameter in model.parameters()]

    for mine, cpus in zip(run(on0), run("cpu"), strict=True):
        assert torch.equal(mine, cpus)


def test_an_optimizer_made_before_the_move_trains_the_moved_parameters(on1: torch.device) -> None:
    model = torch.nn.Linear(2, 1)
    weight = model.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.to(on1)  # as on CUDA, the Parameter objects stay: the optimizer holds them
    assert model.weight is weight
    assert isinstance(weight, torch.nn.Parameter)
    assert weight.device == on1
    before = weight.detach().cpu()
    model(torch.ones(1, 2, device=on1)).sum().backward()
    optimizer.step()
    assert torch.equal(weight.detach().cpu(), before - 1.0)


def test_a_pinning_data_loader_pins(on0: torch.device) -> None:
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, pin_memory=True)
    batches = [batch for (batch,) in loader]
    assert all(batch.is_pinned() for batch in batches)
    assert not torch.arange(2.0).is_pinned()


@pytest.mark.parametrize(
    ("map_location", "expected"),
    [
        (None, "standin:1"),
        ("cpu", "cpu"),
        ("standin:0", "standin:0"),
        ({"standin:1": "cpu"}, "cpu"),
    ],
)
def test_torch_load_honours_map_location(
    on1: torch.device, map_location: object, expected: str
) -> None:
    weight = torch.arange(6.0).reshape(2, 3).to(on1)
    saved = io.BytesIO()
    torch.save({"weight": weight, "row": weight[1]}, saved)
    loaded = torch.load(io.BytesIO(saved.getvalue()), map_location=map_location)  # weights_only
    assert str(loaded["weight"].device) == expected
    assert loaded["weight"].cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    loaded["weight"][1, 0] = 30.0  # the row was saved as a view: it stays one
    assert loaded["row"].cpu().tolist() == [30.0, 4.0, 5.0]


def test_a_load_is_not_misled_by_an_earlier_load_at_the_same_address(on0: torch.device) -> None:
    saved = io.BytesIO()
    torch.save(torch.arange(4.0).to(on0), saved)
    for map_location in ["standin:1", "cpu"] * 20:  # freed storages' addresses come back
        loaded = torch.load(io.BytesIO(saved.getvalue()), map_location=map_location)
        assert str(loaded.device) == map_location
        del loaded
    cpu_saved = io.BytesIO()
    torch.save(torch.arange(4.0), cpu_saved)
    assert torch.load(io.BytesIO(cpu_saved.getvalue())).device.type == "cpu"


def test_devicekit_saves_and_loads_onto_it(on0: torch.device, on1: torch.device, tmp_path) -> None:
    path = tmp_path / "state.pt"
    dk.save({"weight": torch.ones(2, device=on0)}, path)
    assert dk.load(path, on1)["weight"].device == on1
    assert dk.load(path, "cpu")["weight"].tolist() == [1.0, 1.0]


def test_autocast_and_grad_scaler_are_accepted(on0: torch.device) -> None:
    model = torch.nn.Linear(2, 1).to(on0)
    scaler = torch.amp.GradScaler(NAME)
    with torch.autocast(NAME, dtype=torch.bfloat16):
        loss = model(torch.ones(1, 2, device=on0)).sum()
    scaler.scale(loss).backward()
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler.update()
    assert model.weight.grad is not None
    assert model.weight.grad.device == on0


def test_torch_compile_gives_the_eager_values(on0: torch.device) -> None:
    model = torch.nn.Linear(3, 2).to(on0)
    data = torch.randn(4, 3).to(on0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's note that it cannot trace the wrapper
        compiled = torch.compile(lambda x: torch.relu(model(x)) * 2, backend="aot_eager")(data)
    assert compiled.device == on0
    assert torch.equal(compiled.cpu(), (torch.relu(model(data)) * 2).cpu())


# CUDA's rules on mixing devices (the table in devicekit/testing/_stand_in/_tensor.py)


def _vector(device: torch.device | str) -> torch.Tensor:
    return torch.arange(4.0).to(device)


MIXES_REFUSED = [
    ("a CPU vector", lambda d, _: _vector(d) + _vector("cpu"), "standin:0 and cpu"),
    ("a CPU vector first", lambda d, _: _vector("cpu") * _vector(d), "cpu and standin:0"),
    ("another index", lambda d, e: _vector(d) + _vector(e), "standin:0 and standin:1"),
    ("a CPU matrix", lambda d, _: _vector(d).reshape(2, 2) @ torch.eye(2), "standin:0 and cpu"),
    ("cat", lambda d, _: torch.cat([_vector(d), _vector("cpu")]), "standin:0 and cpu"),
    (
        "a foreach list",
        lambda d, _: torch._foreach_add_([_vector(d)], [_vector("cpu")]),
        "standin:0 and cpu",
    ),
]
MIXES_TAKEN = [
    ("a 0-dim CPU tensor", lambda d, _: _vector(d) * torch.tensor(2.0), [0.0, 2.0, 4.0, 6.0]),
    ("CPU indices", lambda d, _: _vector(d)[torch.tensor([3, 0])], [3.0, 0.0]),
    (
        "CPU indices, written",
        lambda d, _: _vector(d).index_put_((torch.tensor([1]),), torch.tensor(9.0)),
        [0.0, 9.0, 2.0, 3.0],
    ),
    ("a copy across", lambda d, e: _vector(e).copy_(_vector("cpu")).to(d), [0.0, 1.0, 2.0, 3.0]),
    (
        "foreach, one device a position",
        lambda d, _: torch._foreach_add([_vector(d)], [_vector(d)])[0],
        [0.0, 2.0, 4.0, 6.0],
    ),
]


@pytest.mark.parametrize(
    ("case", "run", "devices"), MIXES_REFUSED, ids=[m[0] for m in MIXES_REFUSED]
)
def test_a_mix_cuda_refuses_is_refused_in_its_words(
    on0: torch.device, on1: torch.device, case: str, run, devices: str
) -> None:
    said = (
        f"Expected all tensors to be on the same device, but found at least two devices, {devices}!"
    )
    with pytest.raises(RuntimeError, match=re.escape(said)):
        run(on0, on1)


@pytest.mark.parametrize(("case", "run", "values"), MIXES_TAKEN, ids=[m[0] for m in MIXES_TAKEN])
def test_a_mix_cuda_takes_is_taken(
    on0: torch.device, on1: torch.device, case: str, run, values: list[float]
) -> None:
    result = run(on0, on1)
    assert result.device.type == NAME
    assert result.tolist() == values


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("case", "run", "devices"), MIXES_REFUSED, ids=[m[0] for m in MIXES_REFUSED]
)
def test_cuda_refuses_the_mixes_the_stand_in_refuses(case: str, run, devices: str) -> None:
    if case == "another index" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    with pytest.raises(RuntimeError, match="device"):
        run(torch.device("cuda", 0), torch.device("cuda", 1 % torch.cuda.device_count()))


@pytest.mark.cuda
@pytest.mark.parametrize(("case", "run", "values"), MIXES_TAKEN, ids=[m[0] for m in MIXES_TAKEN])
def test_cuda_takes_the_mixes_the_stand_in_takes(case: str, run, values: list[float]) -> None:
    other = torch.device("cuda", 1 % torch.cuda.device_count())
    assert run(torch.device("cuda", 0), other).tolist() == values


def test_devicekit_reads_its_mismatch_as_one(on0: torch.device) -> None:
    with pytest.raises(RuntimeError) as raised:
        _vector(on0) + _vector("cpu")
    assert dk._base.is_device_mismatch(raised.value)


# CUDA's asynchrony, at its worst


def test_a_copy_on_a_side_stream_reads_as_nan_until_waited_for(on0: torch.device) -> None:
    side = torch.standin.Stream(on0)
    pinned = torch.arange(4.0).pin_memory()
    with side:
        moved = pinned.to(on0, non_blocking=True)
    assert moved.isnan().all().item()  # no wait_event: the default stream reads too soon
    torch.accelerator.current_stream(on0).wait_stream(side)
    assert moved.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_copy_waited_for_by_event_is_never_poison(on0: torch.device) -> None:
    side = torch.standin.Stream(on0)
    for step in range(5):
        pinned = torch.full((3,), float(step)).pin_memory()
        with side:
            moved = pinned.to(on0, non_blocking=True)
            ready = side.record_event()
        torch.accelerator.current_stream(on0).wait_event(ready)
        assert (moved * 1).tolist() == [float(step)] * 3


def test_a_pinned_buffer_reused_before_its_copy_ran_gives_poison(on0: torch.device) -> None:
    buffer = torch.zeros(3).pin_memory()
    buffer.fill_(1.0)
    first = buffer.to(on0, non_blocking=True)
    buffer.fill_(2.0)  # the next batch, written before the first copy ran
    assert first.isnan().all().item()
    buffer.fill_(3.0)
    second = buffer.to(on0, non_blocking=True)
    torch.accelerator.synchronize(on0)  # the copy ran before the buffer was touched again
    buffer.fill_(4.0)
    assert second.tolist() == [3.0, 3.0, 3.0]


def test_a_pageable_source_is_read_at_once(on0: torch.device) -> None:
    buffer = torch.ones(3)
    moved = buffer.to(on0, non_blocking=True)  # CUDA stages pageable memory before returning
    buffer.fill_(5.0)
    assert moved.tolist() == [1.0, 1.0, 1.0]


def test_a_host_result_read_before_synchronizing_is_poison(on0: torch.device) -> None:
    scores = torch.arange(3, device=on0)
    early = scores.to("cpu", non_blocking=True)
    assert early.is_pinned()
    assert early.tolist() == [0x5A5A5A5A5A5A5A5A] * 3  # integers: 0x5A in every byte
    done = torch.standin.Event()
    done.record()
    done.synchronize()
    assert early.tolist() == [0, 1, 2]


def test_a_query_says_not_yet_once_then_done(on0: torch.device) -> None:
    side = torch.standin.Stream(on0)
    with side:
        moved = torch.ones(2).pin_memory().to(on0, non_blocking=True)
        ready = side.record_event()
    assert ready.query() is False
    assert ready.query() is True
    assert moved.tolist() == [1.0, 1.0]


def test_work_on_a_side_stream_reads_its_inputs_when_it_runs(on0: torch.device) -> None:
    source = torch.ones(2, device=on0)
    side = torch.standin.Stream(on0)
    with side:
        doubled = source * 2  # queued: it runs when waited for
    assert doubled.isnan().all().item()
    source.fill_(5.0)  # the default stream writes it first, since nothing ordered them
    side.synchronize()
    assert doubled.tolist() == [10.0, 10.0]


def test_a_side_stream_as_in_cuda_s_docs_gives_the_values(on0: torch.device) -> None:
    source = torch.arange(4.0, device=on0)
    side = torch.standin.Stream(on0)
    side.wait_stream(torch.accelerator.current_stream(on0))
    with side:
        doubled = source * 2
    torch.accelerator.current_stream(on0).wait_stream(side)
    doubled.record_stream(side)  # the allocator's note: accepted, as on CUDA
    assert (doubled + 0).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_a_read_to_the_host_on_a_side_stream_waits_for_its_work(on0: torch.device) -> None:
    source = torch.tensor([0.0, 1.0, 2.0], device=on0)
    side = torch.standin.Stream(on0)
    side.wait_stream(torch.accelerator.current_stream(on0))
    with side:  # CUDA synchronizes the current stream for these
        assert (source * 2).sum().item() == 6.0
        assert source[source > 0].tolist() == [1.0, 2.0]
        assert source.nonzero().tolist() == [[1], [2]]


def test_an_allocation_reads_as_poison_and_waits_for_no_work(on0: torch.device) -> None:
    assert torch.empty(3, device=on0).isnan().all().item()  # never written: what it held
    side = torch.standin.Stream(on0)
    pinned = torch.arange(3.0).pin_memory()
    with side:
        moved = pinned.to(on0, non_blocking=True)
        torch.empty(1, device=on0)  # an allocation runs nothing queued before it
        filled = torch.full((2,), 7.0, device=on0)
    pinned.fill_(-1.0)  # so the copy, still queued, reads a rewritten buffer
    assert filled.isnan().all().item()
    side.synchronize()
    assert moved.isnan().all().item()
    assert filled.tolist() == [7.0, 7.0]


def test_each_device_keeps_its_own_queue(on0: torch.device, on1: torch.device) -> None:
    early = torch.ones(2, device=on1).to("cpu", non_blocking=True)
    torch.accelerator.synchronize(on0)  # the other device: not this copy's
    assert early.isnan().all().item()
    torch.accelerator.synchronize(on1)
    assert early.tolist() == [1.0, 1.0]


# Memory


def test_memory_is_counted_per_storage_and_freed_with_it(on1: torch.device) -> None:
    before = torch.accelerator.memory_allocated(on1)
    block = torch.empty(1024, device=on1)
    view = block[:10]
    assert torch.accelerator.memory_allocated(on1) == before + 4096
    del block
    assert torch.accelerator.memory_allocated(on1) == before + 4096  # the view holds it
    del view
    assert torch.accelerator.memory_allocated(on1) == before
    assert torch.accelerator.max_memory_allocated(on1) >= before + 4096
    free, total = torch.accelerator.get_memory_info(on1)
    assert free == total - torch.accelerator.memory_reserved(on1)
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_reserved(on1) == torch.accelerator.memory_allocated(on1)


def test_past_the_limit_an_allocation_is_cuda_s_out_of_memory(on1: torch.device) -> None:
    torch.standin.set_per_process_memory_fraction(0.0, on1)
    try:
        with pytest.raises(
            torch.OutOfMemoryError,
            match=re.escape("standin out of memory. Tried to allocate 4.0 KiB"),
        ):
            torch.empty(1024, device=on1)
    finally:
        torch.standin.set_per_process_memory_fraction(1.0, on1)
    assert torch.empty(1024, device=on1).numel() == 1024


# The ledger of pinned memory


def test_the_ledger_names_what_is_pinned_or_registered(on0: torch.device) -> None:
    slab = torch.empty(4096, dtype=torch.uint8)
    torch.standin.host_register(slab)
    assert slab.is_pinned()
    assert any(
        "4.0 KiB" in line and "registered by host_register" in line for line in still_pinned()
    )
    with pytest.raises(RuntimeError, match="registered already"):
        torch.standin.host_register(slab)
    torch.standin.host_unregister(slab)
    assert not any("registered" in line for line in still_pinned())
    with pytest.raises(RuntimeError, match="not registered"):
        torch.standin.host_unregister(slab)
