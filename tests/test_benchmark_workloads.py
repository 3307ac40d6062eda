"""The benchmark compares like with like: its handwritten moves match to_device's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import devicekit as dk
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


def test_the_gpu_report_runs_every_section_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No GPU here: --smoke runs every section on the CPU with tiny sizes, so the script
    # that holds the GPU figures cannot break unnoticed between GPU runs.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    report_script = _load_benchmark("gpu_report")
    out = tmp_path / "report.md"
    report_script.main(["--smoke", "--out", str(out)])
    report = out.read_text()
    for section in (
        "## cuda-marked tests",
        "## Host -> device transfers",
        "## Packing",
        "## Bandwidth",
        "## Loader overlap",
        "## Real training loops",
    ):
        assert section in report
    assert "| dict of 8 x 16 KiB |" in report
    assert "| small CNN, 64 px float32, batch 512 |" in report
