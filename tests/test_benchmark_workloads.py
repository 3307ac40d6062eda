"""The benchmark compares like with like: its handwritten moves match to_device's."""

from __future__ import annotations

import collections.abc
import importlib.util
import math
import re
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn
from torch.utils.data import dataloader

import devicekit as dk
from devicekit._core import _packing, _transfer
from devicekit._loader import _feed, _loader
from devicekit.testing import assert_same_structure

from .helpers import CPU, META, Pair, tensor_leaves

if TYPE_CHECKING:
    from types import ModuleType


BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _load_benchmark(name: str = "bench_to_device") -> ModuleType:
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


@pytest.mark.parametrize("workload", list(bench.WORKLOADS))
def test_handwritten_baselines_do_what_to_device_does(workload: str) -> None:
    make, handwritten = bench.WORKLOADS[workload]
    batch = make()
    expected = dk.to_device(batch, "meta")
    actual = handwritten(batch, torch.device("meta"))
    assert_same_structure(actual, expected)
    assert all(t.device == torch.device("meta") for t in tensor_leaves(actual))


def _gpu_report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return _load_benchmark("gpu_report")


SECTION_TITLES = (
    "## cuda-marked tests",
    "## Host -> device transfers",
    "## Packing",
    "## Bandwidth",
    "## Loader overlap",
    "## An input-bound loop",
    "## Real training loops",
    "## fit_batch",
    "## materialize",
)


def test_the_gpu_report_runs_every_section_through_the_accelerator_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No GPU here: --smoke runs every section on the CPU with tiny sizes, through the
    # pipeline an accelerator takes, so the script cannot break unnoticed between GPU runs.
    report_script = _gpu_report(monkeypatch)
    seen: dict[str, int] = {"feeds": 0, "starts": 0, "packed": 0, "worker iterators": 0}

    def counting(name: str, original: Any, *, packed: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            seen[name] += bool(result) if packed else 1
            return result

        return wrapper

    feed_init = _feed.BackgroundFeed.__init__
    monkeypatch.setattr(_feed.BackgroundFeed, "__init__", counting("feeds", feed_init))
    start = report_script._HostPrefetcher.start
    monkeypatch.setattr(report_script._HostPrefetcher, "start", counting("starts", start))
    monkeypatch.setattr(_packing, "pack", counting("packed", _packing.pack, packed=True))
    workers = dataloader._MultiProcessingDataLoaderIter.__init__
    monkeypatch.setattr(
        dataloader._MultiProcessingDataLoaderIter,
        "__init__",
        counting("worker iterators", workers),
    )
    out = tmp_path / "report.md"
    report_script.main(["--smoke", "--out", str(out)])
    report = out.read_text()
    for title in SECTION_TITLES:
        assert title in report
    assert "FAILED" not in report
    assert "| dict of 8 x 16 KiB |" in report
    assert "| small CNN, 64 px float32, batch 512 |" in report
    # Each DeviceDataLoader variant's own figures and verdict follow the table.
    assert "small CNN, 64 px float32, batch 512, DeviceDataLoader: waited " in report
    assert "verdict: The loop waited for data " in report
    # The input-bound loop: each variant's rate against the pinning loop by hand, the
    # copies against copy_'s (no copy is timed on the CPU), and the targets it is held to.
    assert "| DataLoader(pin_memory=True) + .to(d, non_blocking=True) | " in report
    assert re.search(r"\| DeviceDataLoader, prefetch 2 \| [\d,]+ \| \d+\.\d\dx \|", report)
    assert "| DeviceDataLoader, prefetch 1 | not measured | - |" in report
    assert "Targets (issue 48): <= 1.10 at prefetch >= 1; the input-bound loop" in report
    assert "These loops are compute-bound: DeviceDataLoader must not make them slower." in report
    assert "- commit: " in report
    assert all(count > 0 for count in seen.values()), seen
    assert "meta" not in _loader.PREFETCHERS  # the stand-in is gone after the run


def test_a_failing_section_leaves_every_other_in_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report_script = _gpu_report(monkeypatch)

    def broken(setting: Any) -> list[str]:
        msg = "a broken section"
        raise RuntimeError(msg)

    def stuck(setting: Any) -> list[str]:
        time.sleep(60)
        return ["## never"]

    monkeypatch.setitem(report_script.SECTIONS, "packing", broken)
    monkeypatch.setitem(report_script.SECTIONS, "bandwidth", stuck)
    monkeypatch.setitem(report_script.BUDGET_S, "bandwidth", 1.0)  # halved in a smoke run
    out = tmp_path / "report.md"
    report_script.main(
        ["--smoke", "--out", str(out), "--only", "transfers", "packing", "bandwidth", "overlap"]
    )
    report = out.read_text()
    assert "## Host -> device transfers" in report
    assert "## Loader overlap" in report
    assert "## packing: FAILED" in report
    assert "RuntimeError: a broken section" in report
    assert "## bandwidth: FAILED" in report
    assert "ran past its 0.5 s budget" in report


checks_bench = _load_benchmark("bench_checks")


def test_the_checks_benchmark_times_what_it_names() -> None:
    model = checks_bench.thousand_modules()
    assert sum(1 for _ in model.modules()) >= 1000
    assert dk.find_unmoved(model) == {}  # a clean model: the walk is all that is timed
    batch = checks_bench.long_scalar_list(100)
    assert dk.find_devices(batch) == {torch.device("cpu"): ["['x']"]}  # the ints are no tensors


loader_bench = _load_benchmark("bench_loader")


def test_the_pinning_benchmark_times_every_loader_batch_three_ways() -> None:
    rows = loader_bench.pinning(repeat=1, quick=True)  # what CI runs, through the pool
    batches = loader_bench.pinning_batches(quick=True)
    assert len(rows) == 2 + len(batches) + 1
    for name, row in zip(batches, rows[2:-1], strict=True):
        fresh, one, many, ratio = (float(cell) for cell in row[len(name) :].split())
        assert min(fresh, one, many) > 0
        assert ratio == pytest.approx(many / fresh, rel=0.2)  # the cells are rounded


materialize_bench = _load_benchmark("bench_materialize")


def test_the_materialize_benchmark_does_the_same_work_both_ways() -> None:
    model = materialize_bench.meta_model(blocks=500)
    assert sum(1 for _ in model.modules()) == 1001
    small = [materialize_bench.meta_model(blocks=3) for _ in range(2)]
    materialize_bench.by_hand(small[0], torch.device("cpu"))
    materialize_bench.materialized(small[1], torch.device("cpu"))
    for each in small:  # both give storage and run the modules' own initialisers
        assert not any(tensor.is_meta for tensor in each.state_dict().values())
        assert torch.equal(each[1].weight.detach(), torch.ones(64))  # LayerNorm's reset
    found = materialize_bench.measure(torch.device("cpu"), rounds=1, blocks=3)
    assert found["ratio"] == found["materialize ms"] / found["by hand ms"]


# The loop of tiny steps (benchmarks/bench_tiny_steps.py), and what was cut from
# devicekit's share of each of its steps.

tiny_bench = _load_benchmark("bench_tiny_steps")


def test_the_tiny_steps_benchmark_reports_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    rows = tiny_bench.main(["--quick", "--calls"])
    out = capsys.readouterr().out
    assert [row.name for row in rows] == list(tiny_bench.VARIANTS)
    assert "The whole step (what a script sees):" in out
    assert "devicekit's own time, in the loop and alone:" in out
    assert "Each call right after a step and alone, us (medians of 20):" in out
    assert "    with a pre-hook doing nothing " in out
    assert "    under guard(model) " in out
    tables = out.split("Each call right after a step")[0]
    for name in tiny_bench.VARIANTS:  # in both tables, but the plain loop in the first only
        assert tables.count(f"  {name} ") == (1 if name == "plain loop" else 2), name
    # Like with like: each variant trains the same model on the same batches.
    assert len({row.loss for row in rows}) == 1, rows
    # Timed directly, a call costs something; the loader's rows and the sum are differences
    # from the plain loop, which a quick run on a busy machine can take below 0.
    timed = ("to_device(batch, device)", "with manager:", "current_device() per step")
    assert all(row.alone_us > 0 for row in rows if row.name in timed)
    assert all(math.isfinite(row.alone_us) for row in rows if row.name != "plain loop")


PIECES = {
    "plain loop": set(),
    "to_device(batch, device)": {"to_device"},
    "DeviceDataLoader(prefetch=1)": {"DeviceDataLoader"},
    "DeviceDataLoader(prefetch=0)": {"DeviceDataLoader"},
    "guard(model)": {"guard"},
    "with manager:": {"with manager"},
    "current_device() per step": {"current_device"},
    "all together, as the docs teach": {
        "with manager",
        "to_device",
        "guard",
        "DeviceDataLoader",
        "current_device",
    },
}


@pytest.mark.parametrize("variant", list(tiny_bench.VARIANTS))
def test_each_tiny_steps_variant_adds_the_pieces_it_names(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []

    def counted(name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            used.append(name)
            return original(*args, **kwargs)

        return wrapper

    for name in ("to_device", "guard", "current_device"):
        monkeypatch.setattr(dk, name, counted(name, getattr(dk, name)))
    iterate = dk.DeviceDataLoader.__iter__
    monkeypatch.setattr(dk.DeviceDataLoader, "__iter__", counted("DeviceDataLoader", iterate))
    enter = dk.DeviceManager.__enter__
    monkeypatch.setattr(dk.DeviceManager, "__enter__", counted("with manager", enter))
    steps = 3
    with warnings.catch_warnings():  # current_device() makes the process's manager: the CPU
        warnings.filterwarnings("ignore", "devicekit uses the CPU", RuntimeWarning)
        tiny_bench.VARIANTS[variant](nn.Linear(4, 1), dk.DeviceManager("cpu"), steps)
    assert set(used) == PIECES[variant]
    if "current_device" in PIECES[variant]:
        assert used.count("current_device") == steps  # once a step, where the batch is made


def _devicekit_calls(
    call: Any, modules: tuple[str, ...] = ("_core/_transfer", "_core/_tree")
) -> tuple[Any, list[str]]:
    """What ``call()`` returns, and the functions of those devicekit modules it entered."""
    calls: list[str] = []
    files = tuple(f"devicekit/{module}.py" for module in modules)

    def record(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith(files):
            calls.append(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return result, calls


FLAT_BATCHES = {
    "tuple": lambda x, y: (x, y),
    "list": lambda x, y: [x, y],
    "dict": lambda x, y: {"x": x, "y": y},
}


@pytest.mark.parametrize("kind", list(FLAT_BATCHES))
def test_a_flat_batch_already_on_the_cpu_is_copied_without_a_call_per_tensor(kind: str) -> None:
    # In a loop of tiny steps a Python call costs several times what it costs alone,
    # PyTorch's step leaving nothing of devicekit in the CPU's caches.
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    batch = FLAT_BATCHES[kind](x, y)
    dk.to_device(batch, CPU)  # the plan is made, the container's type learnt
    moved, calls = _devicekit_calls(lambda: dk.to_device(batch, CPU))
    assert "move" not in calls  # the mover, once per tensor before
    assert calls.count("map_leaves") == 1
    assert type(moved) is type(batch)
    assert moved is not batch  # a new container, as the walk makes
    assert list(tensor_leaves(moved)) == [x, y] or list(moved.values()) == [x, y]
    assert all(a is b for a, b in zip(tensor_leaves(moved), tensor_leaves(batch), strict=True))
    # The loader's move in line, the same way (after the epoch's first batch, which the
    # loader's stats look into to count its samples).
    epoch = iter(dk.DeviceDataLoader([batch] * 3, CPU))
    next(epoch)
    _, calls = _devicekit_calls(lambda: next(epoch))
    assert "move" not in calls
    assert calls.count("map_leaves") == 1


def _on_meta(x: torch.Tensor) -> torch.Tensor:
    return x.to("meta")


class _Sub(torch.Tensor):
    pass


BATCHES_WALKED = {
    "one tensor elsewhere": lambda: (torch.ones(2), _on_meta(torch.ones(2))),
    "a parameter": lambda: [torch.ones(2), nn.Parameter(torch.ones(2))],
    "a tensor subclass": lambda: (torch.ones(2), torch.ones(2).as_subclass(_Sub)),
    "a plain value": lambda: {"x": torch.ones(2), "id": 3},
    "nested": lambda: ([torch.ones(2)], torch.ones(2)),
    "a namedtuple": lambda: Pair(torch.ones(2), torch.ones(2)),
    "one tensor twice": lambda: (torch.ones(2),) * 2,
    "empty": lambda: (),
    "64 tensors": lambda: [torch.ones(1)] * 64,
}


@pytest.mark.parametrize("name", list(BATCHES_WALKED))
@pytest.mark.parametrize("device", [CPU, META])
def test_batches_the_shortcut_leaves_to_the_walk_move_as_before(
    name: str, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = BATCHES_WALKED[name]()
    if name == "one tensor elsewhere" and device == CPU:  # a meta tensor cannot come back
        with pytest.raises(dk.TransferError, match=re.escape("Cannot move data[1] to cpu")):
            dk.to_device(batch, device)
        return
    expected = dk.to_device(batch, device)
    plan = _transfer._plan(device, _transfer._DEFAULTS)
    assert plan.kept is not None
    monkeypatch.setattr(plan, "kept", None)  # the walk alone, as before the shortcut
    walked = dk.to_device(batch, device)
    assert_same_structure(expected, walked)
    assert [(t.device, type(t)) for t in tensor_leaves(expected)] == [
        (t.device, type(t)) for t in tensor_leaves(walked)
    ]
    given = list(tensor_leaves(batch))
    kept = [a is b for a, b in zip(given, tensor_leaves(expected), strict=True)]
    assert kept == [a is b for a, b in zip(given, tensor_leaves(walked), strict=True)]


def test_a_rule_for_sequences_still_takes_a_flat_list_of_tensors_on_the_cpu() -> None:
    seen: list[Any] = []

    @dk.register_transfer(collections.abc.Sequence)
    def move_sequence(sequence: Any, device: Any, **options: Any) -> Any:
        seen.append(sequence)
        return sequence

    try:
        batch = [torch.ones(1), torch.ones(1)]
        assert dk.to_device(batch, CPU) is batch
        assert seen == [batch]
    finally:
        dk.unregister_transfer(collections.abc.Sequence)
