"""devicekit's own accelerator paths, run on the stand-in accelerator of devicekit.testing.

The stand-in (``devicekit.testing.stand_in``) computes on the CPU, bit for bit, under a
device of its own, and runs every asynchronous copy as late as CUDA's ordering allows:
what a copy writes reads as poison (NaN, 0x5A bytes) until something waits for it, and
a pinned source rewritten before its copy ran gives poison too. So a wait devicekit
forgets fails these tests on every run: the device-to-host wait of ``to_device``, the
consumer's wait for a prefetched batch, a staging slab reused before its copy ended.

Every test takes the ``stand_in_device`` fixture: tests/conftest.py runs them after all
the others, since the stand-in, once started, stays the process's accelerator. Each runs
under the watchdog, so a hang fails the test with the place it hung.
"""

from __future__ import annotations

import copy
import gc
import random
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.testing import assert_on_device, still_pinned
from devicekit.testing._stand_in import _memory

from .helpers import CPU, Pair, tensor_leaves
from .reference import rebuild

pytestmark = pytest.mark.usefixtures("watchdog")

MiB = 2**20
STANDIN_1 = "standin:1"  # a string: the device type exists once the stand-in starts
REGISTERED = "registered by host_register"


def _poison_note(host: torch.Tensor) -> str:
    """What a tensor that should have equalled its source holds instead, in words."""
    if host.dtype.is_floating_point:
        nan = int(torch.isnan(host).sum())
        return f"{nan} of {host.numel()} values are NaN (the stand-in's poison)"
    if host.dtype is torch.bool:
        return f"{int(host.sum())} of {host.numel()} values are True (the stand-in's poison)"
    filler = torch.full((), 0x5A, dtype=torch.uint8)
    poisoned = bool(host.numel()) and bool((host.contiguous().view(torch.uint8) == filler).all())
    return "every byte is 0x5A (the stand-in's poison)" if poisoned else "its values differ"


def assert_arrived(got: Any, want: Any, what: str) -> None:
    """Every tensor of ``got``, read back with a blocking ``.cpu()``, equals ``want``'s exactly."""
    got_tensors, want_tensors = list(tensor_leaves(got)), list(tensor_leaves(want))
    assert len(got_tensors) == len(want_tensors), what
    for index, (tensor, expected) in enumerate(zip(got_tensors, want_tensors, strict=True)):
        host = tensor.detach().cpu()  # on a stand-in tensor, a blocking read of its stream
        assert (host.dtype, host.shape) == (expected.dtype, expected.shape), what
        same = torch.equal(host, expected)
        assert same, (
            f"{what}: tensor {index} ({host.dtype}, {tuple(host.shape)}) is not the source's: "
            f"{_poison_note(host)}"
        )


def registered() -> list[str]:
    """The host memory registered with ``host_register`` and not yet unregistered."""
    return [line for line in still_pinned() if line.endswith(REGISTERED)]


def assert_all_given_back() -> None:
    """No slab is left registered, once every feed thread ended (see _feeds_end)."""
    _feeds_end()
    left = registered()
    assert not left, (
        f"close() left {len(left)} slab(s) registered with host_register, such as {left[0]}"
    )


def _feeds_end() -> None:
    """Every feed thread ends (within the watchdog): after close() it finishes its item.

    A feed staging a batch when close() is called gives its slab back as it drops it.
    """
    while any(thread.name == "devicekit-feed" for thread in threading.enumerate()):
        time.sleep(0.005)


def _batch(index: int, sizes: str) -> dict[str, Any]:
    """A nested batch of up to six dtypes, its values told apart by ``index``; never NaN.

    ``"staged"``: large tensors (above PACK_MAX_BYTES), which the loader stages in a slab
    of its pool, and small ones, copied from where they are (packed where that pays);
    ``"large"``: the large ones only, so the batch's last copy reads its slab;
    ``"packed"``: all small. Made from a generator of its own: reading the batch draws
    nothing from the global ones.
    """
    made = torch.Generator().manual_seed(index)
    rows = 4 if sizes == "packed" else 64
    batch = {
        "image": torch.rand(rows, 3, 8, 8, generator=made),  # 48 KiB at 64 rows
        "tokens": torch.randint(0, 30_000, (rows, 80), generator=made),  # 40 KiB
        "mask": torch.rand(rows, 640, generator=made) > 0.5,  # 40 KiB
        "small": [
            torch.rand(rows, 4, generator=made).half(),
            torch.arange(rows, dtype=torch.int32) + index,
            Pair(torch.tensor(index, dtype=torch.int64), torch.rand(2, generator=made).double()),
        ],
        "id": [f"sample-{index}-{row}" for row in range(rows)],
    }
    if sizes == "large":
        del batch["small"]
    return batch


# 1. to_device to the stand-in and back.


def _pinned(data: Any) -> Any:
    """``data`` with each tensor a pinned copy (the stand-in's ``tensor.pin_memory()``)."""
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    return rebuild(data, _pinned)


def test_a_pinned_batch_arrives_whole_non_blocking(stand_in_device: torch.device) -> None:
    source = _batch(0, "staged")
    pinned = _pinned(source)
    assert all(tensor.is_pinned() for tensor in tensor_leaves(pinned))
    moved = dk.to_device(pinned, stand_in_device, non_blocking=True)
    assert_on_device(moved, stand_in_device)
    # Read on the default stream, where the copies were issued: they run first.
    assert_arrived(moved, source, "a pinned batch moved with non_blocking=True")
    assert moved["id"] == source["id"]


@pytest.mark.parametrize("sizes", ["staged", "packed"])
def test_a_batch_comes_back_to_the_host_once_its_copies_are_waited_for(
    stand_in_device: torch.device, sizes: str
) -> None:
    # non_blocking="auto": to the device asynchronously; back to the host asynchronously
    # too, into pinned memory, and to_device waits once (Call.finish) before returning.
    source = _batch(1, sizes)
    moved = dk.to_device(source, stand_in_device)
    back = dk.to_device(moved, "cpu")
    for index, tensor in enumerate(tensor_leaves(back)):
        assert tensor.device == CPU, index
    # back is on the host already: read as it is, nothing runs a copy left behind.
    assert_arrived(back, source, f"a {sizes} batch to {stand_in_device} and back")
    assert back["small"][2].__class__ is Pair


def test_copies_from_two_devices_are_each_waited_for(stand_in_device: torch.device) -> None:
    source = [_batch(2, "staged"), _batch(3, "staged")]
    moved = [dk.to_device(source[0], stand_in_device), dk.to_device(source[1], STANDIN_1)]
    back = dk.to_device(moved, "cpu")
    assert_arrived(back, source, "a batch from standin:0 and standin:1 back to the host")


def test_non_blocking_true_to_the_host_leaves_the_wait_to_the_caller(
    stand_in_device: torch.device,
) -> None:
    # As Tensor.to(non_blocking=True): no wait; the values land once the caller waits.
    source = torch.linspace(-1.0, 1.0, 4096)
    moved = dk.to_device(source, stand_in_device)
    back = dk.to_device(moved, "cpu", non_blocking=True)
    assert torch.isnan(back).all(), "the copy ran before anything waited for it"
    torch.accelerator.synchronize(stand_in_device)
    assert torch.equal(back, source)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def test_a_module_moves_and_computes_as_on_the_host(stand_in_device: torch.device) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    inputs = torch.randn(32, 8, generator=torch.Generator().manual_seed(5))
    moved = dk.to_device(model, stand_in_device)
    assert moved is model  # in place, as Module.to
    assert_on_device(model, stand_in_device)
    output = model(dk.to_device(inputs, stand_in_device))  # training: batch statistics
    expected = reference(inputs)
    assert_arrived(output, expected, "a forward on the stand-in")
    back = dk.to_device(model, "cpu")
    assert_arrived(back.state_dict(), reference.state_dict(), "the module back on the host")
    # The running statistics the forward updated, num_batches_tracked (int64) among them.
    assert int(back[1].num_batches_tracked) == 1


def test_a_module_moved_to_the_stand_in_keeps_its_parameter_objects(
    stand_in_device: torch.device,
) -> None:
    model = nn.Linear(2, 2)
    weight = model.weight
    model.to(stand_in_device)
    assert model.weight is weight


def test_a_backward_runs_on_the_second_stand_in_device(stand_in_device: torch.device) -> None:
    weight = torch.ones(2, device=STANDIN_1, requires_grad=True)
    weight.sum().backward()
    assert weight.grad is not None


def _host_gradients(model: nn.Module, inputs: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of one step, computed on the host, where a run without the stand-in
    computes them: the optimizer's steps are then compared with that run's."""
    model.zero_grad(set_to_none=True)
    model(inputs).square().mean().backward()
    return [param.grad.clone() for param in model.parameters()]  # type: ignore[union-attr]


def test_an_optimizers_state_follows_its_parameters_onto_the_stand_in(
    stand_in_device: torch.device,
) -> None:
    # Its state on the host, its parameters on the stand-in (a checkpoint loaded there):
    # to_device moves the state to its parameters' device, the step kept on the host.
    # The moved copy gets an optimizer of its own, its state the host one's.
    inputs = torch.randn(32, 8, generator=torch.Generator().manual_seed(6))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for _ in range(2):
        _host_gradients(model, inputs)
        optimizer.step()
    on_device = dk.to_device(copy.deepcopy(model), stand_in_device)
    moved_optimizer = torch.optim.AdamW(on_device.parameters(), lr=1e-2, foreach=False)
    for theirs, mine in zip(model.parameters(), on_device.parameters(), strict=True):
        moved_optimizer.state[mine] = {
            key: value.clone() for key, value in optimizer.state[theirs].items()
        }
    assert dk.to_device(moved_optimizer, stand_in_device) is moved_optimizer
    for state in moved_optimizer.state.values():
        assert state["exp_avg"].device == stand_in_device
        assert state["exp_avg_sq"].device == stand_in_device
        assert state["step"].device == CPU  # PyTorch keeps it on the host, on purpose
    # One more step on each, with the same gradients: the same values, bit for bit.
    gradients = _host_gradients(model, inputs)
    for param, gradient in zip(on_device.parameters(), gradients, strict=True):
        param.grad = dk.to_device(gradient, stand_in_device)
    optimizer.step()
    moved_optimizer.step()
    assert_arrived(
        dk.to_device(moved_optimizer.state_dict(), "cpu"),
        optimizer.state_dict(),
        "the optimizer's state after a step on the stand-in",
    )
    assert_arrived(
        dk.to_device(dict(on_device.named_parameters()), "cpu"),
        dict(model.named_parameters()),
        "the parameters after that step",
    )


# 2. DeviceDataLoader on the stand-in: side stream, events, staging slabs.


class Batches:
    """A re-iterable source of ``batches``; each read draws from the global generators
    where ``draws`` (augmentation without workers).

    Then the loader reads it in the training thread, staging each batch there, after the
    loop came back for it and before its copy is issued: a slab freed before the copy
    out of it ran is filled again while that copy waits, on every run. Read ahead, the
    feed thread's staging races the loop's reads instead.
    """

    def __init__(self, batches: list[Any], *, draws: bool) -> None:
        self.batches, self.draws = batches, draws

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            if self.draws:
                random.random()
            yield batch


READS = ["read ahead", "read in the loop"]
BATCHES = 10  # more than the slabs of any prefetch here (prefetch + 1): slabs are reused
EPOCHS = 3


def _check_epoch(loader: dk.DeviceDataLoader[Any], reads: str, sizes: str) -> None:
    stats = loader.stats
    assert stats.finished
    assert stats.batches == BATCHES
    assert stats.read_ahead == (reads == "read ahead")
    assert stats.unpinned == 0
    if sizes != "packed":  # every batch in a slab, and slabs used again
        assert stats.pinned_batches == BATCHES
        assert stats.pinned_reused > 0


def _loading(
    device: str, prefetch: int, reads: str, sizes: str
) -> tuple[list[dict[str, Any]], dk.DeviceDataLoader]:
    """BATCHES batches of ``sizes``, and a loader of them onto ``device``."""
    source = [_batch(index, sizes) for index in range(BATCHES)]
    batches = Batches(source, draws=reads != "read ahead")
    return source, dk.DeviceDataLoader(batches, device, prefetch=prefetch)


@pytest.mark.parametrize("sizes", ["staged", "large", "packed"])
@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize("prefetch", [1, 2, 4])
@pytest.mark.parametrize("device", ["standin:1", "standin:0"])
def test_every_batch_is_handed_over_whole(
    stand_in_device: torch.device, device: str, prefetch: int, reads: str, sizes: str
) -> None:
    """Each batch is read on the default stream as it is handed over: the hand-over's wait."""
    source, loader = _loading(device, prefetch, reads, sizes)
    try:
        for epoch in range(EPOCHS):
            count = 0
            for index, batch in enumerate(loader):
                assert_on_device(batch, device)
                # Work on the default stream right after the hand-over: a clone of each
                # tensor, made now, keeps what the batch held at this point.
                now = [tensor.clone() for tensor in tensor_leaves(batch)]
                assert_arrived(
                    now, list(tensor_leaves(source[index])), f"epoch {epoch}, batch {index}"
                )
                assert batch["id"] == source[index]["id"]
                count += 1
            assert count == BATCHES
            _check_epoch(loader, reads, sizes)
    finally:
        loader.close()
    assert_all_given_back()


@pytest.mark.parametrize("sizes", ["staged", "large"])
@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize("prefetch", [1, 2, 4])
@pytest.mark.parametrize("device", ["standin:1", "standin:0"])
def test_batches_kept_and_read_after_the_epoch_are_whole(
    stand_in_device: torch.device, device: str, prefetch: int, reads: str, sizes: str
) -> None:
    """A loop may keep its batches (a list of them, a queue): a slab reused before its
    copy ran would leave them poisoned, however late they are read."""
    source, loader = _loading(device, prefetch, reads, sizes)
    try:
        for epoch in range(EPOCHS):
            kept = list(loader)
            _check_epoch(loader, reads, sizes)
            assert_arrived(kept, source, f"epoch {epoch}, read after it ended")
    finally:
        loader.close()
    assert_all_given_back()


@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_an_epoch_broken_off_then_closed_gives_every_slab_back(
    stand_in_device: torch.device, prefetch: int, reads: str
) -> None:
    source = [_batch(index, "staged") for index in range(BATCHES)]
    loader = dk.DeviceDataLoader(
        Batches(source, draws=reads != "read ahead"), STANDIN_1, prefetch=prefetch
    )
    try:
        kept = []
        for index, batch in enumerate(loader):
            kept.append(batch)
            if index == 3:
                break
        assert not loader.stats.finished
        assert registered() != []  # the slabs, while the loader lives
        assert_arrived(kept, source[:4], "the batches before the break")
        # The next epoch starts from the first batch again, whole.
        assert_arrived(list(loader), source, "the epoch after the one broken off")
        for index, _ in enumerate(loader):
            if index == 5:
                break
    finally:
        loader.close()
    assert_all_given_back()


# 3. fit_batch on the stand-in.


SMALL = 40 * MiB + MiB // 2  # room for 40 MiB of activations and what the model holds


@pytest.fixture
def small_devices(stand_in_device: torch.device, monkeypatch: pytest.MonkeyPatch) -> int:
    """Each stand-in device with SMALL bytes free, for the length of the test; SMALL.

    The stand-in takes one capacity for the process, at its start (``stand_in(memory=)``),
    and the stand_in_device fixture starts it with the host's memory. A limit set later
    (``set_per_process_memory_fraction``) is a share of the capacity, not of what is free
    now, so the test sets the private figure (monkeypatch puts it back).
    """
    gc.collect()
    torch.accelerator.empty_cache()  # reserved = allocated: free = capacity - allocated
    for index in range(torch.accelerator.device_count()):
        figures = _memory.memory(index)
        monkeypatch.setattr(figures, "capacity", figures.allocated + SMALL)
        assert torch.accelerator.get_memory_info(index)[0] == SMALL
    return SMALL


class Training:
    """A model and an optimizer on the stand-in, and a step whose activations take
    ``batch_size`` MiB of its memory: out of memory, the stand-in's own error.

    Its gradients are made by hand (see _host_gradients), the optimizer's step is real.
    """

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(1)
        self.device = device
        self.model = dk.to_device(nn.Linear(1024, 4), device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.sizes: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.sizes.append(batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        activations = torch.ones(batch_size, MiB // 4, device=self.device)  # batch_size MiB
        loss = self.model(activations[:, :1024]).square().mean().detach()
        for param in self.model.parameters():  # made here: no backward (_host_gradients)
            param.grad = torch.ones_like(param) * loss
        self.optimizer.step()


def test_fit_batch_finds_the_largest_batch_the_stand_in_holds(
    stand_in_device: torch.device, small_devices: int
) -> None:
    training = Training(stand_in_device)
    held = torch.accelerator.memory_allocated(stand_in_device)  # the model's
    weight = training.model.weight.detach().cpu()
    fit = dk.fit_batch(
        training, device=stand_in_device, restore=(training.model, training.optimizer)
    )
    assert [(each.batch_size, each.fitted) for each in fit.tries] == [
        (8, True), (16, True), (32, True), (64, False), (48, False), (40, True), (44, False),
    ]  # fmt: skip
    assert training.sizes == [each.batch_size for each in fit.tries]
    assert fit.batch_size == 40  # a step takes its batch's MiB, and a few KiB
    assert fit.device == stand_in_device
    # The peaks, read from torch.standin's figures: the step's activations and the model.
    for each in fit.tries:
        if each.fitted:
            assert each.peak_memory is not None
            assert each.batch_size * MiB <= each.peak_memory <= each.batch_size * MiB + MiB // 2
        else:
            assert each.peak_memory is None
    assert "standin:0" in fit.explain()
    # Put back: the weights, untouched by the tries, and no optimizer state.
    assert torch.equal(training.model.weight.cpu(), weight)
    assert training.optimizer.state_dict()["state"] == {}
    assert training.model.weight.grad is None
    # Every failed try was freed: the memory holds what it held before the search.
    assert torch.accelerator.memory_allocated(stand_in_device) == held


def test_fit_batch_leaves_headroom_by_the_measured_peak(
    stand_in_device: torch.device, small_devices: int
) -> None:
    training = Training(stand_in_device)
    fit = dk.fit_batch(
        training,
        device=stand_in_device,
        headroom=0.5,
        restore=(training.model, training.optimizer),
    )
    assert "peak memory unknown" not in fit.reason
    assert "headroom" in fit.reason
    last = fit.tries[-1]
    assert last.batch_size == fit.batch_size
    assert last.fitted
    assert last.peak_memory is not None
    assert last.peak_memory <= 0.5 * small_devices
    assert fit.batch_size == 20


def test_fit_batch_names_the_stand_in_where_nothing_fits(
    stand_in_device: torch.device, small_devices: int
) -> None:
    def step(batch_size: int) -> None:  # more than the device has, at every size
        torch.empty(batch_size + 2 * small_devices, dtype=torch.uint8, device=stand_in_device)

    said = (
        r"Cannot fit a batch on standin:0 \([\d.]+ MiB free of [\d.]+ MiB\): every size tried "
        r"ran out of memory, down to 1 \(tried 2, 1\)"
    )
    with pytest.raises(dk.DeviceKitError, match=said):
        dk.fit_batch(step, start=2, device=stand_in_device)


# 4. Checks: a model on the stand-in, a batch left on the host.


@pytest.fixture
def model_there_batch_here(stand_in_device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    model = dk.to_device(nn.Sequential(nn.Linear(3, 2)), stand_in_device)
    return model, {"x": torch.ones(4, 3)}


def test_pytorch_refuses_the_mix_in_cudas_words(
    model_there_batch_here: tuple[nn.Module, dict[str, Any]],
) -> None:
    model, batch = model_there_batch_here
    said = "Expected all tensors to be on the same device, but found at least two devices, "
    with pytest.raises(RuntimeError, match=re.escape(said + "standin:0 and cpu!")):
        model(batch["x"])


def test_check_same_device_names_both_devices(
    model_there_batch_here: tuple[nn.Module, dict[str, Any]],
) -> None:
    model, batch = model_there_batch_here
    with pytest.raises(dk.DeviceMismatchError) as raised:
        dk.check_same_device(model, batch)
    assert str(raised.value) == (
        "Expected every tensor on one device, but found 2: standin:0 has Sequential.0.weight "
        "and Sequential.0.bias; cpu has data[1]['x']."
    )
    assert raised.value.devices == {
        torch.device("standin:0"): ["Sequential.0.weight", "Sequential.0.bias"],
        CPU: ["data[1]['x']"],
    }
    assert dk.check_same_device(model, dk.to_device(batch, "standin:0")) == torch.device(
        "standin:0"
    )


def test_find_devices_names_both_devices(
    model_there_batch_here: tuple[nn.Module, dict[str, Any]],
) -> None:
    model, batch = model_there_batch_here
    assert dk.find_devices({"model": model, "batch": batch}) == {
        torch.device("standin:0"): ["['model'].0.weight", "['model'].0.bias"],
        CPU: ["['batch']['x']"],
    }


def test_guard_names_both_devices(
    model_there_batch_here: tuple[nn.Module, dict[str, Any]],
) -> None:
    model, batch = model_there_batch_here
    with pytest.raises(dk.DeviceMismatchError) as raised, dk.guard(model):
        model(batch["x"])
    said = str(raised.value)
    assert said.startswith(
        "input is on cpu but the parameters of Sequential (e.g. 0.weight, 0.bias) are on standin:0."
    )
    assert "devicekit.to_device(..., 'standin:0')" in said
    with dk.guard(model):
        output = model(dk.to_device(batch["x"], "standin:0"))
    assert output.device == torch.device("standin:0")


# 5. Selection: the stand-in device with the most free memory.


def test_the_manager_chooses_the_device_with_more_free_memory(
    stand_in_device: torch.device, small_devices: int
) -> None:
    held = torch.empty(small_devices // 4, dtype=torch.uint8, device="standin:0")
    free = [torch.accelerator.get_memory_info(index)[0] for index in range(2)]
    assert free == [small_devices - held.numel(), small_devices]
    manager = dk.DeviceManager()
    try:
        assert manager.device == torch.device(STANDIN_1)
        said = manager.explain()
        assert said.startswith(
            "Selected standin:1 (devicekit stand-in (CPU-backed)): it has the most free memory"
        )
        assert "standin:0 devicekit stand-in (CPU-backed)" in said
    finally:
        manager.close()
    del held
