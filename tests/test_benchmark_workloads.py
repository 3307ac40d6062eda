"""The benchmark compares like with like: its handwritten moves match to_device's."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import devicekit as dk
from devicekit.testing import assert_same_structure

from .helpers import tensor_leaves

if TYPE_CHECKING:
    from types import ModuleType


def _load_benchmark() -> ModuleType:
    path = Path(__file__).parent.parent / "benchmarks" / "bench_to_device.py"
    spec = importlib.util.spec_from_file_location("bench_to_device", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
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
