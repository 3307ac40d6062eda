"""fit_batch on the CPU: a step that runs out of memory above a size stands in for a GPU's.

The stand-in step allocates a tensor whose size grows with the batch and raises
``torch.OutOfMemoryError`` above its capacity, as a CUDA step does; a stand-in
:data:`devicekit._memory._fit_batch.MEMORY` reports the peak and the device's memory where a test
needs them. Two gloo processes check that ranks with different capacities agree.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import json
import math
import random
import re
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit._base import _compat
from devicekit._commands import _demo
from devicekit._memory import _fit_batch as _memory
from devicekit._memory import _restore

from .helpers import CPU
from .programs import TwoRanks

MiB = 2**20


class Step:
    """A training step that runs out of memory above ``capacity`` (None: never).

    Each try holds a tensor in its frame, as a real step holds activations; a weak
    reference to each is kept, to see whether a failed try was freed before the next.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.sizes: list[int] = []
        self.held: list[weakref.ref[torch.Tensor]] = []
        self.alive_at_start: list[int] = []  # failed tries' tensors alive as each try starts

    def __call__(self, batch_size: int) -> None:
        self.alive_at_start.append(sum(ref() is not None for ref in self.held))
        self.sizes.append(batch_size)
        activations = torch.empty(min(batch_size, 4096))
        self.held.append(weakref.ref(activations))
        if self.capacity is not None and batch_size > self.capacity:
            msg = f"CUDA out of memory. Tried to allocate {batch_size} MiB"
            raise torch.OutOfMemoryError(msg)


class Memory:
    """A device of ``total_mib`` whose step's peak is ``per_sample_mib`` per sample."""

    def __init__(self, total_mib: int, per_sample_mib: float = 1.0, free_mib: int = 0) -> None:
        self.total, self.per_sample, self.free_bytes = total_mib * MiB, per_sample_mib, free_mib
        self.step: Step | None = None
        self.resets = self.releases = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak(self) -> int | None:
        assert self.step is not None
        return int(self.step.sizes[-1] * self.per_sample * MiB)

    def free(self) -> tuple[int, int] | None:
        return self.free_bytes * MiB, self.total

    def release(self) -> None:
        self.releases += 1


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Memory:
    """A stand-in for the CPU's memory, which devicekit cannot otherwise read."""
    stand_in = Memory(100)
    monkeypatch.setitem(_memory.MEMORY, "cpu", lambda device: stand_in)
    return stand_in


@pytest.mark.parametrize("capacity", [1, 7, 100, 8191])
@pytest.mark.parametrize("start", [1, 8, 64])
def test_the_size_found_is_at_least_nine_tenths_of_the_largest_that_fits(
    capacity: int, start: int
) -> None:
    limit = 8192
    step = Step(capacity)
    fit = dk.fit_batch(step, start=start, limit=limit, device="cpu")
    assert 0.9 * capacity <= fit.batch_size <= capacity
    assert max(step.sizes) <= limit  # never a step above the limit
    assert len(fit.tries) <= 2 * math.log2(limit / start) + 4  # about 2 log2(limit / start)
    assert [each.batch_size for each in fit.tries] == step.sizes
    assert all(each.fitted == (each.batch_size <= capacity) for each in fit.tries)
    assert fit.accumulation == 1
    assert fit.device == CPU


def test_the_limit_is_never_passed() -> None:
    step = Step(None)  # nothing runs out of memory, as on the CPU
    fit = dk.fit_batch(step, start=3, limit=40, device="cpu")
    assert step.sizes == [3, 6, 12, 24, 40]
    assert fit.batch_size == 40
    assert fit.explain().endswith("Chose 40: the limit (40) fit.")


def test_without_a_limit_the_search_stops_on_devices_that_never_run_out() -> None:
    fit = dk.fit_batch(Step(None), start=2**18, device="cpu")
    assert fit.batch_size == 2**20
    assert [each.batch_size for each in fit.tries] == [2**18, 2**19, 2**20]


def test_a_failed_try_is_freed_before_the_next_starts() -> None:
    step = Step(100)
    dk.fit_batch(step, start=8, limit=1024, device="cpu")
    assert any(size > 100 for size in step.sizes)  # some tries failed
    # The retry runs outside the except block: nothing of a failed step is alive.
    assert step.alive_at_start == [0] * len(step.sizes)


def test_the_peak_is_measured_afresh_for_each_try(memory: Memory) -> None:
    step = Step(100)
    memory.step = step
    fit = dk.fit_batch(step, start=8, limit=1024, device="cpu")
    assert memory.resets == len(fit.tries)
    # The allocator's cache goes back after each try that ran out of memory.
    assert memory.releases == sum(not each.fitted for each in fit.tries) > 0
    assert [each.peak_memory for each in fit.tries if each.fitted] == [
        each.batch_size * MiB for each in fit.tries if each.fitted
    ]
    assert all(each.peak_memory is None for each in fit.tries if not each.fitted)


def test_any_other_error_of_the_step_reaches_the_caller_unchanged_at_once() -> None:
    error = ValueError("labels and logits differ in shape")
    sizes: list[int] = []

    def step(batch_size: int) -> None:
        sizes.append(batch_size)
        if batch_size == 32:
            raise error

    with pytest.raises(ValueError, match="labels and logits") as info:
        dk.fit_batch(step, start=8, limit=1024, device="cpu")
    assert info.value is error
    assert sizes == [8, 16, 32]  # no try after it


def test_a_cpu_allocator_error_is_no_device_running_out_of_memory() -> None:
    def step(batch_size: int) -> None:
        msg = "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        raise RuntimeError(msg)

    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        dk.fit_batch(step, device="cpu")


def _chained(
    error: BaseException,
    *,
    cause: BaseException | None = None,
    context: BaseException | None = None,
    suppress: bool = False,
) -> BaseException:
    """``error`` as Python raises it from ``cause`` or while handling ``context``."""
    error.__cause__, error.__context__, error.__suppress_context__ = cause, context, suppress
    return error


def _loop() -> BaseException:
    """Two errors each the other's cause, neither a device out of memory."""
    first, second = ValueError("first"), ValueError("second")
    first.__cause__, second.__cause__ = second, first
    return first


def _long_chain(length: int) -> BaseException:
    error: BaseException = torch.OutOfMemoryError("CUDA out of memory")
    for _ in range(length):
        error = _chained(ValueError("wrapped"), cause=error)
    return error


OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(
    ("error", "caught"),
    [
        (OOM, True),
        # Extensions and older code paths raise a RuntimeError with the allocator's words.
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; ...)"), True),
        (RuntimeError("HIP out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"), True),
        (RuntimeError("HIPBLAS_STATUS_ALLOC_FAILED when calling `hipblasCreate(handle)`"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), True),
        (RuntimeError("XPU out of memory. Tried to allocate 1 GiB"), True),
        # Raised from one (`raise ... from error`): down the chain of causes.
        (_chained(ValueError("attention failed"), cause=OOM), True),
        (_chained(KeyError("batch"), cause=_chained(ValueError("x"), cause=OOM)), True),
        # Raised while one was handled (the context only): another error, shown as it is.
        (_chained(KeyError("missing_config_key"), context=OOM), False),
        (_chained(KeyError("batch"), context=_chained(ValueError("x"), cause=OOM)), False),
        (_chained(ValueError("x"), cause=_chained(ValueError("y"), context=OOM)), False),
        (_chained(ValueError("retried"), context=OOM, suppress=True), False),  # from None
        (_chained(ValueError("x"), cause=_loop(), context=OOM), False),
        (_loop(), False),  # a chain that loops ends the walk
        (_long_chain(8), True),
        (_long_chain(40), False),  # past 32 errors the walk stops
        # Not a device out of memory.
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("the step ran out of memory, or so it says"), False),
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate"),
            False,
        ),
        (ValueError("CUDA out of memory"), False),  # the words, but no RuntimeError
        (MemoryError(), False),  # the host's, not the device's
    ],
)
def test_only_a_device_running_out_of_memory_is_caught(error: BaseException, caught: bool) -> None:
    assert _compat.is_out_of_memory(error) is caught


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        _chained(ValueError("the fused kernel failed"), cause=OOM),
    ],
    ids=["cublas", "runtime-error", "wrapped"],
)
def test_out_of_memory_in_other_words_goes_on_with_the_search(error: BaseException) -> None:
    def step(batch_size: int) -> None:
        if batch_size > 100:
            raise error

    fit = dk.fit_batch(step, start=8, limit=1024, device="cpu")
    assert fit.batch_size == 96


def test_an_error_raised_while_handling_out_of_memory_reaches_the_caller_unchanged() -> None:
    # A mistake in the step's own except block is no device out of memory, although
    # Python chains the OutOfMemoryError it was handling to it as its __context__.
    sizes: list[int] = []
    ran_out: list[torch.OutOfMemoryError] = []
    config: dict[str, int] = {}

    def allocate(batch_size: int) -> None:
        if batch_size > 16:
            ran_out.append(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
            raise ran_out[-1]

    def step(batch_size: int) -> None:
        sizes.append(batch_size)
        try:
            allocate(batch_size)
        except torch.OutOfMemoryError:
            config["missing_config_key"]  # the handler's own mistake: a KeyError

    with pytest.raises(KeyError, match="missing_config_key") as info:
        dk.fit_batch(step, start=8, limit=1024, device="cpu")
    assert type(info.value) is KeyError
    assert info.value.__context__ is ran_out[0]
    assert info.value.__cause__ is None
    assert sizes == [8, 16, 32]  # no try after it


def test_when_nothing_fits_the_error_names_the_device_its_memory_and_the_tries(
    memory: Memory,
) -> None:
    memory.free_bytes = 3
    step = Step(0)
    memory.step = step
    with pytest.raises(dk.DeviceKitError) as info:
        dk.fit_batch(step, start=8, device="cpu")
    assert str(info.value).startswith(
        "Cannot fit a batch on cpu (3.0 MiB free of 100.0 MiB): every size tried ran out of "
        "memory, down to 1 (tried 8, 4, 2, 1)."
    )
    assert step.alive_at_start == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("target", "capacity", "batch_size", "accumulation"),
    [
        (1000, 100, 96, 11),  # 96 fits: 11 steps of 96 make at least 1000
        (50, 100, 50, 1),  # the target fits: no larger size is tried
        (96, 100, 96, 1),
        (97, 100, 97, 1),
        (256, 100, 96, 3),
    ],
)
def test_a_target_gives_the_steps_to_accumulate(
    target: int, capacity: int, batch_size: int, accumulation: int
) -> None:
    step = Step(capacity)
    fit = dk.fit_batch(step, start=8, target=target, device="cpu")
    assert (fit.batch_size, fit.accumulation) == (batch_size, accumulation)
    assert max(step.sizes) <= max(target, 8)
    assert fit.batch_size * fit.accumulation >= target
    assert fit.batch_size * (fit.accumulation - 1) < target
    if accumulation > 1:
        assert f"(accumulating {accumulation} steps)" in fit.explain()


def test_headroom_shrinks_the_size_until_its_peak_leaves_that_share_free(
    memory: Memory,
) -> None:
    step = Step(100)
    memory.step = step
    fit = dk.fit_batch(step, start=8, limit=1024, headroom=0.2, device="cpu")
    assert fit.batch_size == 80  # 1 MiB a sample: 80 MiB of the 100 MiB device
    assert fit.tries[-1] == dk.BatchFit.Try(80, True, 80 * MiB)  # the smaller size was run
    assert fit.reason.endswith("its peak fits under 80.0 MiB (20% headroom)")


def test_headroom_without_a_peak_takes_the_share_off_the_size() -> None:
    fit = dk.fit_batch(Step(100), start=8, limit=1024, headroom=0.25, device="cpu")
    assert fit.batch_size == math.floor(96 * 0.75)
    assert fit.reason.endswith("25% less for headroom (peak memory unknown)")


def test_explain_lists_every_try_and_the_choice(memory: Memory) -> None:
    step = Step(20)
    memory.step = step
    fit = dk.fit_batch(step, start=8, limit=64, device="cpu")
    assert fit.explain() == (
        "Batch size 20 on cpu.\n"
        "Tried: 8 fits (8.0 MiB peak), 16 fits (16.0 MiB peak), 32 out of memory, "
        "24 out of memory, 20 fits (20.0 MiB peak), 22 out of memory.\n"
        "Chose 20: the largest size that fit, within a tenth of 22, the first that did not."
    )


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"start": 0}, ValueError, "Expected start to be a whole number of 1 or more, got 0."),
        ({"limit": 2.5}, TypeError, "Expected limit to be a whole number of 1 or more, got 2.5."),
        (
            {"target": True},
            TypeError,
            "Expected target to be a whole number of 1 or more, got True.",
        ),
        ({"start": 16, "limit": 8}, ValueError, "Expected limit to be at least start (16), got 8."),
        (
            {"headroom": 1.0},
            ValueError,
            "Expected headroom to be a share between 0 and 1 (0.1: 10%), got",
        ),
    ],
)
def test_options_out_of_range_are_refused_before_any_step(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    step = Step(None)
    with pytest.raises(error, match=re.escape(message)):
        dk.fit_batch(step, device="cpu", **options)  # type: ignore[arg-type]
    assert step.sizes == []


def test_a_step_that_is_no_function_is_refused() -> None:
    with pytest.raises(TypeError, match=re.escape("Expected step to be a function of a batch")):
        dk.fit_batch(64, device="cpu")  # type: ignore[arg-type]


# restore=: the steps of the search train the user's own model; it is put back after.


class Net(nn.Module):
    """A small model with every kind of state: parameters, buffers, dropout, train/eval."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(16, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.head(self.body(inputs))
        return scores


class Training:
    """A model, its optimizer, LR scheduler and grad scaler, and a step that trains all four.

    The step runs out of memory above ``capacity``, once it has drawn its batch.
    """

    def __init__(self, capacity: int = 100) -> None:
        self.capacity = capacity
        self.model = Net()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        self.sizes: list[int] = []
        self.stop: tuple[int, BaseException] | None = None  # raise this at that size

    def restore(self) -> tuple[object, ...]:
        return (self.model, self.optimizer, self.scheduler, self.scaler)

    def __call__(self, batch_size: int) -> torch.Tensor:
        self.sizes.append(batch_size)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # The batch comes from the global generators, as a shuffling loader's does.
        inputs = torch.randn(batch_size, 8) + float(numpy.random.rand()) + random.random()
        labels = torch.randint(0, 3, (batch_size,))
        if batch_size > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = nn.functional.cross_entropy(self.model(inputs), labels)
        if self.stop is not None and batch_size == self.stop[0]:
            raise self.stop[1]
        self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss.detach()


def _state(training: Training) -> dict[str, object]:
    """Everything of ``training`` that a step can change, copied."""
    model = training.model
    return copy.deepcopy(
        {
            "values": [t.detach() for t in (*model.parameters(), *model.buffers())],
            "grads": [p.grad for p in model.parameters()],
            "training": [m.training for m in model.modules()],
            "optimizer": training.optimizer.state_dict(),
            "scheduler": training.scheduler.state_dict(),
            "scaler": training.scaler.state_dict(),
        }
    )


def _same(first: object, second: object) -> bool:
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, dict):
        return (
            isinstance(second, dict)
            and first.keys() == second.keys()
            and all(_same(first[key], second[key]) for key in first)
        )
    if isinstance(first, list | tuple):
        return (
            isinstance(second, list | tuple)
            and len(first) == len(second)
            and all(map(_same, first, second))
        )
    return first == second


def _trained_once(training: Training) -> None:
    """A state of every kind: optimizer state, gradients (one None), mixed train/eval."""
    training(16)
    training.model(torch.randn(4, 8)).sum().backward()  # gradients left from a step
    training.model.head.bias.grad = None
    training.model.eval()
    training.model.body[3].train()  # one submodule left in training mode


def test_restore_puts_the_model_and_its_optimizer_back_exactly() -> None:
    training = Training()
    _trained_once(training)
    before, parameters = _state(training), list(training.model.parameters())
    fit = dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=training.restore())
    assert fit.batch_size == 96
    assert len(training.sizes) > 5  # the search trained the model many times
    after = _state(training)
    for part in ("values", "grads", "training", "optimizer", "scheduler", "scaler"):
        assert _same(after[part], before[part]), part
    assert training.model.head.bias.grad is None
    # In place: the optimizer still holds the model's own parameters.
    assert list(training.model.parameters()) == parameters
    assert all(a is b for a, b in zip(training.model.parameters(), parameters, strict=True))
    assert all(
        a is b
        for a, b in zip(training.optimizer.param_groups[0]["params"], parameters, strict=True)
    )
    assert training.optimizer.param_groups[0]["lr"] == before["optimizer"]["param_groups"][0]["lr"]  # type: ignore[index]


def test_without_restore_the_search_trains_the_model() -> None:
    # What the issue measured: every parameter changed, the optimizer gained state.
    training = Training()
    parameters = [p.detach().clone() for p in training.model.parameters()]
    dk.fit_batch(training, start=8, limit=1024, device="cpu")
    changed = [
        not torch.equal(a, b) for a, b in zip(training.model.parameters(), parameters, strict=True)
    ]
    assert all(changed)
    assert training.optimizer.state


@pytest.mark.parametrize(
    ("stop", "raised"),
    [
        (ValueError("labels and logits differ in shape"), ValueError),
        (KeyboardInterrupt(), KeyboardInterrupt),
        (None, dk.DeviceKitError),  # nothing fits
    ],
    ids=["error", "ctrl-c", "nothing-fits"],
)
def test_restore_puts_everything_back_however_the_search_ends(
    stop: BaseException | None, raised: type[BaseException]
) -> None:
    training = Training()
    _trained_once(training)
    if stop is not None:
        training.stop = (32, stop)
    else:
        training.capacity = 0
    before = _state(training)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    with pytest.raises(raised) as info:
        dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=training.restore())
    if stop is not None:
        assert info.value is stop
    assert training.sizes[-1] == (32 if stop is not None else 1)
    assert _same(_state(training), before)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state


def _seeded_losses(search: bool) -> list[float]:
    """Five steps of a seeded training run, with or without a search before them."""
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    training = Training()
    if search:
        dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=training.restore())
    return [training(16).item() for _ in range(5)]


def test_a_seeded_run_trains_the_same_after_the_search_as_without_it() -> None:
    # The search drew batches and dropout masks from the global generators, ran the
    # model's batch norm and stepped the optimizer, the scheduler and the scaler.
    assert _seeded_losses(search=True) == _seeded_losses(search=False)


def test_the_host_copy_is_dropped_after_the_search() -> None:
    training = Training()
    training.stop = (32, ValueError("labels and logits differ in shape"))
    with pytest.raises(ValueError) as info:
        dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=training.restore())
    # The error's traceback keeps fit_batch's frame, and the copy's holder, alive...
    assert info.tb is not None
    gc.collect()
    # type(), not isinstance(): some objects of torch warn when asked their __class__.
    kept = [each for each in gc.get_objects() if type(each) is _restore.Kept]
    assert kept
    # ...but not the copy itself.
    assert not any(each.tensors or each.grads or each.states for each in kept)


def test_restore_puts_an_optimizer_back_into_the_same_objects() -> None:
    # A group the user or a scheduler holds must steer the optimizer after the search,
    # as it did before: load_state_dict would have put new dicts in param_groups.
    training = Training()
    _trained_once(training)
    optimizer, weight = training.optimizer, training.model.head.weight
    groups, group, state = optimizer.param_groups, optimizer.param_groups[0], optimizer.state
    group["note"] = "kept by the user"
    adam = state[weight]
    exp_avg, step_count = adam["exp_avg"], adam["step"]
    before = copy.deepcopy(
        ({k: v for k, v in group.items() if k != "params"}, dict(adam), len(state))
    )
    seen: list[float] = []

    def step(batch_size: int) -> torch.Tensor:
        seen.append(group["lr"])
        group["added_in_search"] = batch_size
        group.pop("note", None)
        return training(batch_size)

    fit = dk.fit_batch(step, start=8, limit=1024, device="cpu", restore=training.restore())
    assert fit.batch_size == 96
    assert len(set(seen)) > 5  # the scheduler changed lr at every try
    assert optimizer.param_groups is groups
    assert optimizer.param_groups[0] is group
    assert optimizer.state is state
    assert state[weight] is adam
    assert adam["exp_avg"] is exp_avg
    assert adam["step"] is step_count
    assert _same(
        ({k: v for k, v in group.items() if k != "params"}, dict(adam), len(state)), before
    )
    assert "added_in_search" not in group
    assert group["note"] == "kept by the user"
    # The group the user holds steers the optimizer: no learning rate, no change.
    parameters = [p.detach().clone() for p in training.model.parameters()]
    group["lr"] = 0.0
    training.model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    assert all(map(torch.equal, training.model.parameters(), parameters))


def test_a_param_group_added_during_the_search_is_taken_out_again() -> None:
    training = Training()
    _trained_once(training)
    optimizer = training.optimizer
    groups, before = optimizer.param_groups, copy.deepcopy(optimizer.state_dict())
    extra = nn.Parameter(torch.zeros(3))

    def step(batch_size: int) -> torch.Tensor:
        if len(groups) == 1:
            optimizer.add_param_group({"params": [extra]})
        extra.grad = torch.ones(3)  # the new group gains state too
        return training(batch_size)

    dk.fit_batch(step, start=8, limit=1024, device="cpu", restore=training.restore())
    assert optimizer.param_groups is groups
    assert len(groups) == 1
    assert extra not in optimizer.state
    assert _same(optimizer.state_dict(), before)


def test_a_tensor_learning_rate_is_put_back_in_place() -> None:
    # A scheduler fills a tensor lr in place; it goes back into the same tensor, on its
    # own device (load_state_dict would have given the group the host copy).
    model = nn.Linear(4, 2)
    lr = torch.tensor(0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    seen: list[float] = []

    def step(batch_size: int) -> None:
        seen.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(batch_size, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()

    dk.fit_batch(step, limit=64, device="cpu", restore=(model, optimizer, scheduler))
    assert seen[-1] < seen[0]
    assert optimizer.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(0.01)


def test_restore_puts_back_optimizer_state_held_in_lists() -> None:
    # L-BFGS keeps its history in lists it appends to in place.
    model = nn.Linear(4, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), history_size=4, max_iter=3)
    inputs = torch.randn(16, 4)

    def step(batch_size: int) -> None:
        def closure() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = model(inputs[: min(batch_size, 16)]).square().mean()
            loss.backward()
            return loss

        optimizer.step(closure)

    step(16)
    first = next(iter(optimizer.state.values()))
    directions, before = list(first["old_dirs"]), copy.deepcopy(dict(first))
    dk.fit_batch(step, limit=64, device="cpu", restore=(model, optimizer))
    assert next(iter(optimizer.state.values())) is first
    assert _same(dict(first), before)  # the search's appends undone
    # The lists come back as copies, holding the tensors that they held.
    assert all(a is b for a, b in zip(first["old_dirs"], directions, strict=True))


def test_an_optimizer_with_its_own_state_dict_is_put_back_through_it() -> None:
    class Counting(torch.optim.SGD):
        """An optimizer keeping state of its own beside its groups, in its state_dict."""

        steps = 0

        def step(self, closure: Any = None) -> Any:
            self.steps += 1
            return super().step(closure)

        def state_dict(self) -> dict[str, Any]:
            return {**super().state_dict(), "steps": self.steps}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.steps = state_dict["steps"]
            super().load_state_dict({k: v for k, v in state_dict.items() if k != "steps"})

    model = nn.Linear(4, 2)
    optimizer = Counting(model.parameters(), lr=0.1)
    optimizer.steps = 3

    def step(batch_size: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(batch_size, 4)).square().mean().backward()
        optimizer.step()

    dk.fit_batch(step, limit=64, device="cpu", restore=(model, optimizer))
    assert optimizer.steps == 3


def test_restore_takes_one_object_as_well_as_a_tuple() -> None:
    training = Training()
    parameters = [p.detach().clone() for p in training.model.parameters()]
    dk.fit_batch(training, start=8, limit=64, device="cpu", restore=training.model)
    assert all(map(torch.equal, training.model.parameters(), parameters))


@pytest.mark.parametrize(
    ("restore", "message"),
    [
        (
            (nn.Linear(2, 2), 3),
            (
                "Expected restore[1] to be a module, an optimizer or an object with state_dict() "
                "and load_state_dict(), got int: fit_batch could not put it back after the search."
            ),
        ),
        (
            "model",
            (
                "Expected restore to be a module, an optimizer, an object with state_dict() and "
                "load_state_dict(), or a tuple of them such as restore=(model, optimizer), got str."
            ),
        ),
        (
            (torch.zeros(3),),
            (
                "Expected restore[0] to be a module, an optimizer or an object with state_dict() "
                "and load_state_dict(), got Tensor"
            ),
        ),
    ],
)
def test_what_cannot_be_put_back_is_refused_before_any_step(restore: object, message: str) -> None:
    step = Step(None)
    with pytest.raises(TypeError, match=re.escape(message)):
        dk.fit_batch(step, device="cpu", restore=restore)
    assert step.sizes == []


def _lazy_buffer() -> nn.Module:
    module = nn.Linear(2, 2)
    module.register_buffer("stats", nn.parameter.UninitializedBuffer())
    return module


@pytest.mark.parametrize(
    ("restore", "name", "found"),
    [
        (
            (nn.Linear(2, 2), nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2))),
            "restore[1]",
            "the parameter '1.weight'",
        ),
        (nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2)), "restore", "the parameter '1.weight'"),
        ((_lazy_buffer(),), "restore[0]", "the buffer 'stats'"),
    ],
    ids=["in-a-tuple", "alone", "buffer"],
)
def test_a_lazy_module_not_yet_run_is_refused_before_any_step(
    restore: object, name: str, found: str
) -> None:
    step = Step(None)
    message = (
        f"Expected every parameter and buffer of {name} to be initialised, so that fit_batch "
        f"can keep a copy to put back, got {found} not initialised yet: a lazy module (such "
        "as torch.nn.LazyLinear) makes its parameters in its first forward. Run one forward "
        "first (model(batch)), or leave it out of restore= (the search then initialises and "
        "trains it)."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        dk.fit_batch(step, device="cpu", restore=restore)
    assert step.sizes == []


def test_a_lazy_module_after_its_first_forward_is_put_back() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    model(torch.randn(1, 8))  # the fix the refusal advises
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [t.detach().clone() for t in model.parameters()]

    def step(batch_size: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(batch_size, 8)).square().mean().backward()
        optimizer.step()

    dk.fit_batch(step, limit=64, device="cpu", restore=(model, optimizer))
    assert all(map(torch.equal, model.parameters(), before))
    assert not optimizer.state


class AmpTraining:
    """The usual mixed-precision step: scale, backward, unscale_, clip, step, update.

    Above ``capacity`` it runs out of memory where ``where`` says: after ``unscale_``, or
    inside the optimizer's own step (a fused optimizer's, where the scaler marks it).
    """

    def __init__(self, capacity: int = 100, *, where: str = "after-unscale") -> None:
        torch.manual_seed(0)
        self.capacity, self.where = capacity, where
        self.model = nn.Linear(8, 3)
        fused = where == "in-fused-step"
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2, fused=fused)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        self.stop: tuple[int, BaseException] | None = None  # raise this after unscale_
        self.optimizer.register_step_pre_hook(self._in_step)
        self.size = 0

    def _in_step(self, *_: object) -> None:
        if self.where == "in-fused-step" and self.size > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def restore(self) -> tuple[object, ...]:
        return (self.model, self.optimizer, self.scaler)

    def __call__(self, batch_size: int) -> None:
        self.size = batch_size
        self.optimizer.zero_grad(set_to_none=True)
        inputs = torch.ones(batch_size, 8) * torch.arange(batch_size).reshape(-1, 1) / batch_size
        loss = self.model(inputs).square().mean()
        self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        if self.where == "in-fused-step":
            self.scaler.step(self.optimizer)  # unscales inside the fused step
        else:
            self.scaler.unscale_(self.optimizer)
            if self.stop is not None and batch_size == self.stop[0]:
                raise self.stop[1]
            if batch_size > self.capacity:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
        self.scaler.update()


def test_a_grad_scaler_stopped_after_unscale_is_left_between_steps_for_the_next_try() -> None:
    training = AmpTraining()
    for _ in range(3):  # a scale and a growth tracker of its own to keep
        training(16)
    before = training.scaler.state_dict()
    assert (before["scale"], before["_growth_tracker"]) == (2048.0, 1)
    fit = dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=training.restore())
    assert fit.batch_size == 96
    assert [each.batch_size for each in fit.tries if not each.fitted] == [128, 112, 104]
    assert training.scaler.state_dict() == before
    training(16)  # the user's first real step runs
    assert training.scaler.get_scale() == 4096.0  # and grows on, from the tracker kept


@pytest.mark.parametrize(
    "stop",
    [ValueError("labels and logits differ in shape"), KeyboardInterrupt()],
    ids=["error", "ctrl-c"],
)
def test_a_grad_scaler_is_left_between_steps_however_the_search_ends(stop: BaseException) -> None:
    training = AmpTraining()
    training.stop = (32, stop)
    with pytest.raises(type(stop)) as info:
        dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=training.restore())
    assert info.value is stop
    training.stop = None
    training(16)  # the user's next step runs
    assert training.scaler.get_scale() == 1024.0


def test_a_fused_step_stopped_inside_leaves_no_scale_to_the_next() -> None:
    # The last try (104) runs out of memory inside the fused step, after the scaler set
    # its grad_scale on the optimizer; left there, the next step multiplies it in.
    searched, fresh = AmpTraining(where="in-fused-step"), AmpTraining(where="in-fused-step")
    fit = dk.fit_batch(searched, start=8, limit=1024, device="cpu", restore=searched.restore())
    assert fit.tries[-1] == dk.BatchFit.Try(104, False)
    assert not hasattr(searched.optimizer, "grad_scale")
    assert not hasattr(searched.optimizer, "found_inf")
    searched(16)
    fresh(16)
    assert all(map(torch.equal, searched.model.parameters(), fresh.model.parameters()))


# DistributedDataParallel, in a process group of one: what each forward synchronises is
# read as DDP decides it, and a step that would leave the ranks out of step is refused.


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A process group of this process alone, as torchrun makes on one GPU.

    No peer to wait for, so nothing to hang on: the tests need no watchdog (whose 10 s a
    search with a few collections of garbage can take on a loaded machine).
    """
    distributed = torch.distributed
    store = f"file://{tmp_path}/store"
    distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield
    finally:
        distributed.destroy_process_group()


def _wrapped(module: nn.Module, **options: Any) -> nn.parallel.DistributedDataParallel:
    return nn.parallel.DistributedDataParallel(module, **options)


@pytest.mark.usefixtures("one_rank")
def test_ddp_forward_syncs_reads_what_ddp_s_own_forward_decides() -> None:
    ddp = _wrapped(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert _compat.ddp_forward_syncs(ddp) == (True, True)
    with torch.no_grad():
        assert _compat.ddp_forward_syncs(ddp) == (False, True)
    with ddp.no_sync():
        assert _compat.ddp_forward_syncs(ddp) == (False, True)  # the first still broadcasts
        ddp(torch.randn(3, 4)).sum().backward()
        assert _compat.ddp_forward_syncs(ddp) == (False, False)  # the next does not
    assert _compat.ddp_forward_syncs(_wrapped(nn.Linear(4, 4))) == (True, False)  # no buffers
    # broadcast_buffers=False became forward_sync_buffers=False in later PyTorch.
    newer = (
        "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    )
    quiet = _wrapped(
        nn.BatchNorm1d(4), **{"forward_sync_buffers" if newer else "broadcast_buffers": False}
    )
    assert _compat.ddp_forward_syncs(quiet) == (True, False)


class DdpTraining:
    """A DDP model whose step runs out of memory above ``capacity``, in its forward."""

    def __init__(self, how: str, capacity: int = 100) -> None:
        self.capacity, self.how = capacity, how
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        self.model[1].register_forward_pre_hook(self._out_of_memory)
        self.ddp = _wrapped(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.initial = [each.detach().clone() for each in self.model.state_dict().values()]
        self.sizes: list[int] = []

    def _out_of_memory(self, module: nn.Module, args: tuple[torch.Tensor]) -> None:
        if len(args[0]) > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory")

    def restored(self) -> bool:
        return all(map(torch.equal, self.model.state_dict().values(), self.initial))

    def __call__(self, batch_size: int) -> None:
        self.sizes.append(batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        runs = self.ddp.module if self.how == "module" else self.ddp
        synced = self.ddp.no_sync() if self.how == "no_sync" else contextlib.nullcontext()
        with synced:
            runs(torch.randn(batch_size, 4)).square().mean().backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("how", ["no_sync", "module"])
def test_a_ddp_model_is_searched_under_no_sync_or_unwrapped(how: str) -> None:
    training = DdpTraining(how)
    restore = (training.ddp, training.optimizer)
    fit = dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=restore)
    assert fit.batch_size == 96
    assert training.restored()


@pytest.mark.usefixtures("one_rank")
def test_a_step_that_synchronises_ddp_gradients_is_refused_after_its_first_try() -> None:
    training = DdpTraining("synced")
    restore = (training.ddp, training.optimizer)
    with pytest.raises(dk.DeviceKitError) as info:
        dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=restore)
    assert str(info.value) == (
        "Cannot search with a step that synchronises the gradients of a "
        "DistributedDataParallel named in restore=: where one rank runs out of memory inside "
        "such a step and another does not, the other waits in its gradient all-reduce, and "
        "the process group hangs or aborts. Run the step on the wrapped module (ddp.module) "
        "or under ddp.no_sync(), keep restore=(ddp, optimizer), and train with the wrapper "
        "as usual."
    )
    assert training.sizes == [8]
    assert training.restored()


@pytest.mark.usefixtures("one_rank")
def test_out_of_memory_in_a_forward_that_broadcasts_buffers_stops_the_search() -> None:
    # Under no_sync() the first forward still broadcasts the batch norm's buffers; stopped
    # inside it, this rank would broadcast again at the next forward, and the others not.
    training = DdpTraining("no_sync", capacity=4)
    restore = (training.ddp, training.optimizer)
    message = (
        "Cannot go on fitting the batch: the step ran out of memory at batch size 8 inside "
        "the forward of a DistributedDataParallel that broadcasts its buffers, so this rank's "
        "next forward would broadcast them again and the other ranks' would not. Run the step "
        "on the wrapped module (ddp.module), or build the wrapper with "
        "forward_sync_buffers=False (broadcast_buffers=False in older PyTorch)."
    )
    with pytest.raises(dk.DeviceKitError, match=re.escape(message)):
        dk.fit_batch(training, start=8, limit=1024, device="cpu", restore=restore)
    assert training.sizes == [8]
    assert training.restored()


@pytest.mark.usefixtures("one_rank")
def test_under_a_group_the_options_take_one_all_reduce_and_each_try_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[int]] = []
    all_reduce = torch.distributed.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.tolist())
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", counted)
    fit = dk.fit_batch(Step(100), start=8, limit=1024, device="cpu")
    assert fit.batch_size == 96
    assert len(calls) == 1 + len(fit.tries)
    assert calls[0][:5] == [1, 8, -8, 1024, -1024]  # ready; start; limit; ...


# Two ranks of a gloo process group, each given its own capacity (as GPUs shared with other
# jobs have) and options. They agree on the options and on every try, so both end on the
# one size that fits on both, or refuse together, and neither waits for the other. The two
# processes run one scenario after another, as a user's program would call fit_batch
# again; after each, each rank all-reduces 7 with the other, as the user's training would
# next: 14 says the group is still in step. What each rank found goes to a file.
RANKS_SCRIPT = textwrap.dedent(
    """
    import contextlib, json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import devicekit as dk

    folder, rank, scenarios = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)


    def run(spec):
        capacity, failing, ddp_step = spec.get("capacity"), spec.get("failing"), spec.get("ddp")
        out_of_memory_in = spec.get("out_of_memory_in", "forward")
        sizes = []

        def out_of_memory(batch_size, where):
            if where == out_of_memory_in and capacity is not None and batch_size > capacity:
                raise torch.OutOfMemoryError("CUDA out of memory")

        class Activations(nn.Module):
            def forward(self, inputs):
                out_of_memory(len(inputs), "forward")
                return inputs

        class Backward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, scores):
                ctx.size = len(scores)
                return scores.clone()

            @staticmethod
            def backward(ctx, grad):
                out_of_memory(ctx.size, "backward")
                return grad

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), Activations(), nn.Linear(8, 2))
        ddp = nn.parallel.DistributedDataParallel(model) if ddp_step else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        initial = [tensor.detach().clone() for tensor in model.state_dict().values()]

        def step(batch_size):
            sizes.append(batch_size)
            if batch_size == failing:
                raise ValueError(f"rank {rank}'s own error")
            if ddp is None:
                out_of_memory(batch_size, "forward")
                return
            optimizer.zero_grad(set_to_none=True)
            runs = ddp.module if ddp_step == "module" else ddp
            synced = ddp.no_sync() if ddp_step == "no_sync" else contextlib.nullcontext()
            with synced:
                scores = Backward.apply(runs(torch.randn(batch_size, 4)))
                scores.square().mean().backward()
            optimizer.step()

        restore = () if ddp is None else (optimizer,)
        if ddp is not None and spec.get("name_ddp", True):
            restore = (ddp, optimizer)
        try:
            options = {**spec.get("options", {}), **({"restore": restore} if restore else {})}
            fit = dk.fit_batch(step, device="cpu", **options)
            found = {"batch_size": fit.batch_size, "accumulation": fit.accumulation}
        except Exception as error:
            found = {"error": f"{type(error).__name__}: {error}"}
        found["sizes"] = sizes
        found["restored"] = all(map(torch.equal, model.state_dict().values(), initial))
        return found


    results = {}
    for name, specs in scenarios.items():
        results[name] = run(specs[rank])
        if specs[rank].get("then", True):
            seven = torch.tensor([7])
            dist.all_reduce(seven)
            results[name]["then"] = seven.item()
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
            json.dump(results, out)
    sys.stdout.flush()
    os._exit(0)  # no teardown of the group: gloo's can wait on a peer that has left
    """
)

_SAME = {"start": 8, "limit": 1024, "target": 1000}
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "different memory": ({"capacity": 100, "options": _SAME}, {"capacity": 60, "options": _SAME}),
    "headroom": ({"options": {"headroom": 0.1}}, {"options": {"headroom": 0.2}}),
    "target": ({"options": {"target": 1000}}, {"options": {"target": None}}),
    "out of range": ({"options": {"start": 0}}, {"options": {"start": 8}}),
    "step fails": ({"capacity": 100, "failing": 32}, {"capacity": 100}),
    # Rank 1 runs out of memory in the backward, where DDP would all-reduce gradients.
    "no_sync": (
        {"ddp": "no_sync", "out_of_memory_in": "backward", "capacity": 100},
        {"ddp": "no_sync", "out_of_memory_in": "backward", "capacity": 60},
    ),
    "module": (
        {"ddp": "module", "out_of_memory_in": "backward", "capacity": 100},
        {"ddp": "module", "out_of_memory_in": "backward", "capacity": 60},
    ),
    "synced": ({"ddp": "synced", "capacity": 100}, {"ddp": "synced", "capacity": 100}),
    "restore": ({"ddp": "module"}, {"ddp": "module", "name_ddp": False}),
    # Last, as it ends the group: rank 0 runs out of memory in the backward while rank 1
    # waits in DDP's all-reduce, which no call of devicekit's could meet. Rank 0 says why
    # and leaves; rank 1's all-reduce then fails (gloo: the peer went away), no hang.
    "out of memory inside ddp": (
        {"ddp": "synced", "out_of_memory_in": "backward", "capacity": 4, "then": False},
        {"ddp": "synced", "out_of_memory_in": "backward", "capacity": 100, "then": False},
    ),
}


@pytest.fixture(scope="module")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory,
    start_two_ranks: TwoRanks,
) -> dict[str, list[dict[str, Any]]]:
    """What each of two ranks found in each of :data:`SCENARIOS`, run in order."""
    folder = tmp_path_factory.mktemp("ranks")
    script = folder / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    scenarios = json.dumps({name: list(specs) for name, specs in SCENARIOS.items()})
    result = start_two_ranks(script, folder, scenarios, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]
    return {name: [ranks[0][name], ranks[1][name]] for name in SCENARIOS}


def test_ranks_with_different_memory_agree_on_one_size(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    first, second = two_ranks["different memory"]
    assert first["sizes"] == second["sizes"]  # the same tries, in the same order
    assert first["batch_size"] == second["batch_size"]
    assert 54 <= first["batch_size"] <= 60  # what fits on both, within a tenth
    # Two ranks: 1000 over 2 * batch_size, rounded up.
    assert first["accumulation"] == second["accumulation"]
    assert first["accumulation"] == math.ceil(1000 / (2 * first["batch_size"]))
    assert first["then"] == second["then"] == 14


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("headroom", "headroom differs between ranks: 0.1 on some, 0.2 on others."),
        ("target", "target differs between ranks: None on some, 1000 on others."),
        (
            "restore",
            (
                "restore= names a different number of DistributedDataParallel modules on "
                "different ranks: 0 on some, 1 on others."
            ),
        ),
    ],
)
def test_ranks_given_different_options_refuse_together_and_stay_in_step(
    two_ranks: dict[str, list[dict[str, Any]]], option: str, message: str
) -> None:
    for found in two_ranks[option]:
        assert found["error"].startswith(f"DeviceKitError: {message} Pass the same start,")
        assert found["sizes"] == []  # refused before the first try
        assert found["then"] == 14  # the next all-reduce meets its own


def test_a_rank_whose_options_are_out_of_range_stops_the_others_before_any_try(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    first, second = two_ranks["out of range"]
    assert first["error"] == "ValueError: Expected start to be a whole number of 1 or more, got 0."
    assert second["error"] == (
        "DeviceKitError: Cannot fit the batch: another rank's fit_batch refused its arguments "
        "before the first try (its own error says why), so this rank stops too."
    )
    assert first["sizes"] == second["sizes"] == []
    assert first["then"] == second["then"] == 14


def test_a_rank_whose_step_fails_otherwise_stops_the_others_instead_of_hanging(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    first, second = two_ranks["step fails"]
    assert first["error"] == "ValueError: rank 0's own error"
    assert second["error"].startswith(
        "DeviceKitError: Cannot go on fitting the batch: another rank's step raised an error"
    )
    assert first["sizes"] == second["sizes"] == [8, 16, 32]
    assert first["then"] == second["then"] == 14


@pytest.mark.parametrize("how", ["no_sync", "module"])
def test_ranks_search_a_ddp_model_under_no_sync_or_unwrapped(
    two_ranks: dict[str, list[dict[str, Any]]], how: str
) -> None:
    first, second = two_ranks[how]
    assert first["sizes"] == second["sizes"]
    assert first["batch_size"] == second["batch_size"]
    assert 54 <= first["batch_size"] <= 60
    assert first["restored"]  # both ranks' models as they were
    assert second["restored"]
    assert first["then"] == second["then"] == 14


def test_ranks_refuse_together_a_step_that_synchronises_ddp_gradients(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    for found in two_ranks["synced"]:
        assert found["error"].startswith(
            "DeviceKitError: Cannot search with a step that synchronises the gradients of a "
            "DistributedDataParallel named in restore=:"
        )
        assert found["sizes"] == [8]  # the first try, on both
        assert found["restored"]
        assert found["then"] == 14


def test_a_rank_out_of_memory_inside_ddp_s_all_reduce_says_so_instead_of_aborting(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    first, second = two_ranks["out of memory inside ddp"]
    assert first["error"].startswith(
        "DeviceKitError: Cannot search with a step that synchronises the gradients"
    )
    assert first["error"].endswith(
        "This rank ran out of memory at batch size 8; the other ranks may wait in that "
        "all-reduce until this process ends."
    )
    assert first["restored"]
    assert "error" in second


def test_the_demo_s_search_leaves_its_model_and_optimizer_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]] = []
    make = _demo._model_and_optimizer

    def recorded(device: torch.device) -> tuple[Any, Any]:
        model, optimizer = make(device)
        made.append((model, optimizer, [each.detach().clone() for each in model.parameters()]))
        return model, optimizer

    monkeypatch.setattr(_demo, "_model_and_optimizer", recorded)
    monkeypatch.setattr(_demo, "FIT_LIMIT", 128)  # fewer, smaller tries
    fit = _demo.fit_demo_batch(CPU)
    assert fit.batch_size == 128
    [(model, optimizer, initial)] = made
    assert all(map(torch.equal, model.parameters(), initial))
    assert all(each.grad is None for each in model.parameters())
    assert not optimizer.state
