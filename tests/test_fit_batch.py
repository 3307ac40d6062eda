"""fit_batch on the CPU: a step that runs out of memory above a size stands in for a GPU's.

The stand-in step allocates a tensor whose size grows with the batch and raises
``torch.OutOfMemoryError`` above its capacity, as a CUDA step does; a stand-in
:data:`devicekit._memory.MEMORY` reports the peak and the device's memory where a test
needs them. Two gloo processes check that ranks with different capacities agree.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit import _memory

from .helpers import CPU
from .programs import run_program

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


@pytest.mark.parametrize(
    ("error", "caught"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), True),
        (RuntimeError("XPU out of memory. Tried to allocate 1 GiB"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("the step ran out of memory, or so it says"), False),
        (MemoryError(), False),  # the host's, not the device's
    ],
)
def test_only_a_device_running_out_of_memory_is_caught(error: Exception, caught: bool) -> None:
    assert _memory.out_of_memory(error) is caught


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
    ("options", "message"),
    [
        ({"start": 0}, "Expected start to be a whole number of 1 or more, got 0."),
        ({"limit": 2.5}, "Expected limit to be a whole number of 1 or more, got 2.5."),
        ({"target": True}, "Expected target to be a whole number of 1 or more, got True."),
        ({"start": 16, "limit": 8}, "Expected limit to be at least start (16), got 8."),
        ({"headroom": 1.0}, "Expected headroom to be a share between 0 and 1 (0.1: 10%), got"),
    ],
)
def test_options_out_of_range_are_refused_before_any_step(
    options: dict[str, object], message: str
) -> None:
    step = Step(None)
    with pytest.raises(ValueError, match=re.escape(message)):
        dk.fit_batch(step, device="cpu", **options)  # type: ignore[arg-type]
    assert step.sizes == []


def test_a_step_that_is_no_function_is_refused() -> None:
    with pytest.raises(TypeError, match=re.escape("Expected step to be a function of a batch")):
        dk.fit_batch(64, device="cpu")  # type: ignore[arg-type]


# Two ranks of a gloo process group, each with its own capacity (as GPUs shared with other
# jobs have), and its own limit: they agree on every try, so both end on the one size that
# fits on both, and neither waits for the other. Each writes what it found to a file.
RANKS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import devicekit as dk

    folder, rank, capacity, limit, failing = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:])
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    sizes = []

    def step(batch_size):
        sizes.append(batch_size)
        if batch_size == failing:
            raise ValueError(f"rank {rank}'s own error")
        if batch_size > capacity:
            raise torch.OutOfMemoryError("CUDA out of memory")

    try:
        fit = dk.fit_batch(step, start=8, limit=limit, target=1000, device="cpu")
        found = {"batch_size": fit.batch_size, "accumulation": fit.accumulation}
    except Exception as error:
        found = {"error": f"{type(error).__name__}: {error}"}
    found["sizes"] = sizes
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as out:
        json.dump(found, out)
    sys.stdout.flush()
    os._exit(0)  # no teardown of the group: gloo's can wait on a peer that has left
    """
)


def _two_ranks(tmp_path: Path, *ranks: tuple[int, int, int]) -> list[dict[str, object]]:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    code = (
        "import subprocess, sys\n"
        f"ranks = {list(ranks)!r}\n"
        "children = [subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2], str(rank),"
        " *map(str, args)]) for rank, args in enumerate(ranks)]\n"
        "sys.exit(max(child.wait() for child in children))\n"
    )
    here = str(Path(__file__).parent.parent)  # this checkout's devicekit, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    result = run_program(
        [sys.executable, "-c", code, str(script), str(tmp_path)], timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_ranks_with_different_memory_agree_on_one_size(tmp_path: Path) -> None:
    # Rank 0 fits 100, rank 1 only 60, and rank 1 was given a lower limit.
    first, second = _two_ranks(tmp_path, (100, 1024, 0), (60, 512, 0))
    assert first["sizes"] == second["sizes"]  # the same tries, in the same order
    assert first["batch_size"] == second["batch_size"]
    assert 54 <= first["batch_size"] <= 60  # what fits on both, within a tenth
    # Two ranks: 1000 over 2 * batch_size, rounded up.
    assert first["accumulation"] == math.ceil(1000 / (2 * first["batch_size"]))


def test_a_rank_whose_step_fails_otherwise_stops_the_others_instead_of_hanging(
    tmp_path: Path,
) -> None:
    first, second = _two_ranks(tmp_path, (100, 1024, 32), (100, 1024, 0))
    assert first["error"] == "ValueError: rank 0's own error"
    assert str(second["error"]).startswith(
        "DeviceKitError: Cannot go on fitting the batch: another rank's step raised"
    )
    assert first["sizes"] == second["sizes"] == [8, 16, 32]
