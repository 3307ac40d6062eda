"""DeviceDataLoader on the CPU: meta as the device, faults, passthrough, and its feed thread."""

from __future__ import annotations

import re
import threading
import time
import traceback
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import devicekit as dk
from devicekit._loader._feed import BackgroundFeed as _BackgroundFeed
from devicekit.testing import assert_same_structure, batches

from .helpers import META, tensor_leaves
from .programs import run_program


def _dataset(n: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(n * 3, dtype=torch.float32).reshape(n, 3), torch.arange(n))


class Faulty(Dataset[tuple[torch.Tensor, int]]):
    """Raises at one index while `broken` is set."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad
        self.broken = True

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index == self.bad and self.broken:
            msg = f"item {index} is corrupt"
            raise ValueError(msg)
        return torch.full((2,), float(index)), index


def test_batches_arrive_on_the_device_in_order() -> None:
    loader = dk.DeviceDataLoader(DataLoader(_dataset(), batch_size=6), META)
    shapes = []
    for features, labels in loader:
        assert features.device == META
        assert labels.device == META
        shapes.append(features.shape[0])
    assert shapes == [6, 6, 6, 2]


def test_values_on_the_cpu_equal_the_plain_loader_s() -> None:
    plain = DataLoader(_dataset(), batch_size=6, shuffle=False)
    wrapped = dk.DeviceDataLoader(plain, "cpu")
    for (x, y), (wx, wy) in zip(plain, wrapped, strict=True):
        assert torch.equal(x, wx)
        assert torch.equal(y, wy)


def test_a_transform_runs_on_each_batch() -> None:
    loader = dk.DeviceDataLoader(
        [torch.ones(2), torch.zeros(2)], "cpu", transform=lambda batch: batch * 2 + 1
    )
    assert [batch.tolist() for batch in loader] == [[3.0, 3.0], [1.0, 1.0]]


def test_device_none_is_the_current_device_where_the_loader_is_made() -> None:
    # Issue 35: made inside `with manager:` and iterated after it, batches came on the
    # CPU (the device was read at each epoch's start). Bound where made, as to_device
    # binds it at its call and a model moved there keeps it.
    batches = [{"x": torch.ones(1)}] * 2
    with dk.DeviceManager("cpu"):  # the device outside the block (else the process's)
        with dk.DeviceManager("meta"):
            inside = dk.DeviceDataLoader(batches)
            model = dk.to_device(torch.nn.Linear(1, 1))
        assert [batch["x"].device for batch in inside] == [META, META]
    assert inside.device == model.weight.device == META
    with dk.DeviceManager("cpu"):
        outside = dk.DeviceDataLoader(batches)
        with dk.DeviceManager("meta"):
            assert [batch["x"].device for batch in outside] == [torch.device("cpu")] * 2


@given(st.lists(batches(), max_size=5))
def test_the_loader_yields_exactly_to_device_of_each_batch(items: list[Any]) -> None:
    moved = list(dk.DeviceDataLoader(items, META))
    assert len(moved) == len(items)
    for got, batch in zip(moved, items, strict=True):
        assert_same_structure(got, dk.to_device(batch, META))
        assert all(t.device == META for t in tensor_leaves(got))


def test_a_tensor_twice_in_a_batch_arrives_as_one() -> None:
    # In line, the loader moves through the plan it found at the epoch's start: the
    # repeat is still seen and the retry that keeps it one tensor still runs.
    shared = torch.zeros(3)
    (moved,) = dk.DeviceDataLoader([{"a": shared, "b": [shared, torch.ones(2)]}], META)
    assert moved["a"] is moved["b"][0]
    assert moved["a"].device == META


# What the wrapped loader knows.


def test_len_and_attributes_read_through() -> None:
    inner = DataLoader(_dataset(), batch_size=6, num_workers=0)
    loader = dk.DeviceDataLoader(inner, META)
    assert len(loader) == 4
    assert loader.dataset is inner.dataset
    assert loader.sampler is inner.sampler
    assert loader.batch_size == 6
    assert loader.num_workers == 0


def test_what_the_wrapped_loader_lacks_is_named() -> None:
    loader = dk.DeviceDataLoader(lambda: iter([1, 2]), META)
    with pytest.raises(TypeError, match=re.escape("The wrapped function has no len().")):
        len(loader)
    msg = "The wrapped list has no attribute 'batch_size'."
    with pytest.raises(AttributeError, match=re.escape(msg)):
        _ = dk.DeviceDataLoader([1], META).batch_size


def test_set_epoch_reaches_a_distributed_sampler() -> None:
    dataset = _dataset(16)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=7)
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=4, sampler=sampler), META)
    loader.set_epoch(0)
    first = list(sampler)
    loader.set_epoch(1)
    assert sampler.epoch == 1
    assert list(sampler) != first


def test_set_epoch_without_a_sampler_is_refused() -> None:
    msg = (
        "Expected the wrapped list, its sampler or its batch sampler to have set_epoch "
        "(a DistributedSampler does), but none has."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.DeviceDataLoader([1], META).set_epoch(1)


# Epochs.


def test_many_epochs_over_a_dataloader_and_a_generator_function() -> None:
    loader = dk.DeviceDataLoader(DataLoader(_dataset(), batch_size=5), META)
    assert [sum(1 for _ in loader) for _ in range(3)] == [4, 4, 4]
    factory = dk.DeviceDataLoader(lambda: (torch.ones(1) for _ in range(3)), META)
    assert [sum(1 for _ in factory) for _ in range(3)] == [3, 3, 3]


def test_a_used_up_iterator_is_refused_for_a_second_epoch() -> None:
    loader = dk.DeviceDataLoader(iter([torch.ones(1)]), META)
    assert len(list(loader)) == 1
    msg = (
        "Expected a re-iterable loader for another epoch, but the wrapped list_iterator is an "
        "iterator that is used up. Wrap a list, a DataLoader, or a function that returns a new "
        "iterable each epoch."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        list(loader)


def test_a_generator_left_early_is_not_called_used_up() -> None:
    loader = dk.DeviceDataLoader((torch.ones(1) for _ in range(5)), META)
    for _ in loader:
        break
    msg = (
        "Expected a re-iterable loader for another epoch, but the wrapped generator is an "
        "iterator that an earlier epoch already started and left early"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        list(loader)


# Faults.


def test_a_dataset_error_surfaces_unchanged_and_the_loader_recovers() -> None:
    dataset = Faulty(60, bad=37)
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=4), META)
    seen = 0
    with pytest.raises(ValueError, match=re.escape("item 37 is corrupt")) as info:
        for _ in loader:
            seen += 1
    assert seen == 9  # batches 0..8 hold items 0..35; item 37 is in batch 9
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "__getitem__" in frames
    dataset.broken = False
    assert sum(1 for _ in loader) == 15


# The program of the dead-worker test: a worker dies at index 5, then the same loader
# runs a whole epoch once the dataset is mended.
DEAD_WORKER = """
import multiprocessing, os, sys
import torch
from torch.utils.data import DataLoader, Dataset
import devicekit as dk

class Dying(Dataset):
    def __init__(self):
        self.dies = True
    def __len__(self):
        return 16
    def __getitem__(self, index):
        if index == 5 and self.dies:
            os._exit(3)  # a worker dies without a word
        return torch.full((2,), float(index))

dataset = Dying()
loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=2, num_workers=2), "meta")
try:
    list(loader)
except RuntimeError as error:
    print("error:", error)
print("workers left:", len(multiprocessing.active_children()))
dataset.dies = False
print("batches after:", sum(1 for _ in loader))
"""


def test_a_dead_worker_surfaces_and_the_loader_recovers(fresh_python: str) -> None:
    # In a process of its own: PyTorch reports a dead worker from a SIGCHLD handler
    # that raises in whatever the main thread runs when a signal comes, and in a shared
    # process that was, once in a while, pytest's own code after the test had ended.
    result = run_program([fresh_python, "-c", DEAD_WORKER], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"error: DataLoader worker .* exited unexpectedly.*", lines[0])
    assert lines[1:] == ["workers left: 0", "batches after: 8"]


def test_breaking_out_early_and_many_epochs_leave_no_threads() -> None:
    loader = dk.DeviceDataLoader(DataLoader(_dataset(), batch_size=2), META)
    before = threading.active_count()
    for _ in range(50):
        for index, _batch in enumerate(loader):
            if index == 2:
                break
        for _batch in loader:
            pass
    assert threading.active_count() <= before  # no growth (an earlier test's may end)


# The background feed that pins ahead on accelerators, tested on its own here.


def _ends(feed: _BackgroundFeed, timeout: float = 10.0) -> bool:
    """Whether the feed's thread ends in time: close() only nudges it, it does not wait long."""
    deadline = time.monotonic() + timeout
    while feed.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    return not feed.alive


def test_the_feed_yields_everything_in_order_then_stops() -> None:
    feed = _BackgroundFeed(range(100), lambda item: item * 2, depth=3)
    assert list(feed) == [item * 2 for item in range(100)]
    feed.close()
    assert _ends(feed)


def test_the_feed_carries_the_source_s_exception_unchanged() -> None:
    error = KeyError("missing")

    def source() -> Any:
        yield from range(37)
        raise error

    feed = _BackgroundFeed(source(), lambda item: item, depth=2)
    got = []
    with pytest.raises(KeyError) as info:
        for item in feed:
            got.append(item)  # noqa: PERF402 - collects up to the failure, which list() would lose
    assert info.value is error
    assert got == list(range(37))


def test_closing_the_feed_early_ends_its_thread_over_fifty_epochs() -> None:
    before = threading.active_count()
    for _ in range(50):
        feed = _BackgroundFeed(iter(range(1000)), lambda item: item, depth=2)
        assert next(feed) == 0
        feed.close()
        assert _ends(feed)
    assert threading.active_count() <= before  # no growth (an earlier test's may end)


# Bad arguments.


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (
            {"prefetch": -1},
            ValueError,
            "Expected prefetch to be a whole number of 0 or more, got -1.",
        ),
        (
            {"prefetch": 2.5},
            TypeError,
            "Expected prefetch to be a whole number of 0 or more, got 2.5.",
        ),
        (
            {"pin_memory": "yes"},
            TypeError,
            "Expected pin_memory to be 'auto', True or False, got 'yes'.",
        ),
        ({"device": "gpu"}, dk.DeviceUnavailableError, "got 'gpu'"),
        (
            {"transform": 5},
            TypeError,
            "Expected transform to be a function of a batch (or None), got int 5.",
        ),
        (
            {"non_blocking": "yes"},
            TypeError,
            "Expected non_blocking to be 'auto', True or False, got 'yes'.",
        ),
    ],
)
def test_bad_arguments_are_refused(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        dk.DeviceDataLoader([1], **arguments)


def test_something_that_yields_no_batches_is_refused() -> None:
    msg = "Expected a loader to wrap: a DataLoader, a list or another re-iterable, or a function"
    with pytest.raises(TypeError, match=re.escape(msg)):
        dk.DeviceDataLoader(42)  # type: ignore[arg-type]


# Each epoch tells the sampler its number, as Lightning and accelerate do: a DDP run never
# repeats one order, unless the user says which epoch it is.


def _epochs_seen(loader: dk.DeviceDataLoader[Any], sampler: DistributedSampler[Any]) -> int:
    for _batch in loader:
        pass
    return sampler.epoch


def test_each_epoch_tells_a_distributed_sampler_its_number() -> None:
    dataset = _dataset(16)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=7)
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=4, sampler=sampler), META)
    assert [_epochs_seen(loader, sampler) for _ in range(3)] == [0, 1, 2]


def test_the_epoch_the_user_sets_wins_and_the_count_goes_on_from_it() -> None:
    dataset = _dataset(16)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=7)
    loader = dk.DeviceDataLoader(DataLoader(dataset, batch_size=4, sampler=sampler), META)
    loader.set_epoch(5)  # resumed at epoch 5
    assert [_epochs_seen(loader, sampler) for _ in range(2)] == [5, 6]
    sampler.set_epoch(10)  # told the sampler itself, as a plain DDP loop does
    assert [_epochs_seen(loader, sampler) for _ in range(2)] == [10, 11]
    for epoch in range(3):  # a loop that tells it every epoch, the same way
        sampler.set_epoch(epoch)
        assert _epochs_seen(loader, sampler) == epoch


def test_a_sampler_without_set_epoch_is_left_alone() -> None:
    loader = dk.DeviceDataLoader(DataLoader(_dataset(8), batch_size=4, shuffle=True), META)
    for _ in range(2):
        assert len(list(loader)) == 2
