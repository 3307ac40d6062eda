"""The benchmark compares like with like: its handwritten moves match to_device's."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch.utils.data import dataloader

import devicekit as dk
from devicekit import _loader, _packing
from devicekit.testing import assert_same_structure

from .helpers import tensor_leaves

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
    "## Real training loops",
    "## fit_batch",
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

    feed_init = _loader._BackgroundFeed.__init__
    monkeypatch.setattr(_loader._BackgroundFeed, "__init__", counting("feeds", feed_init))
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
