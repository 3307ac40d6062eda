"""What users of accelerate and Lightning rely on: skip_keys, and to_device compiled."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

import devicekit as dk

META = torch.device("meta")
Pair = namedtuple("Pair", ["x", "y"])


def test_values_under_skipped_keys_stay_where_they_are_at_any_depth() -> None:
    raw = torch.zeros(3)
    deep = torch.ones(2)
    batch = {
        "x": torch.ones(1),
        "raw": raw,
        "nested": [OrderedDict(raw=deep, y=torch.ones(2))],
        "text": ["a"],
    }
    moved = dk.to_device(batch, META, skip_keys={"raw"})
    assert moved["x"].device == META
    assert moved["raw"] is raw
    assert type(moved["nested"][0]) is OrderedDict
    assert moved["nested"][0]["raw"] is deep
    assert moved["nested"][0]["y"].device == META
    assert moved["text"] == ["a"]
    # One key alone, as accelerate takes it: not the letters of a string.
    assert dk.to_device({"raw": raw, "r": raw}, META, skip_keys="raw")["r"].device == META


def test_skipped_values_are_not_refused_by_strict() -> None:
    handle = object()  # not movable: strict would refuse it anywhere else
    moved = dk.to_device(
        {"handle": handle, "x": torch.ones(1)}, META, strict=True, skip_keys=["handle"]
    )
    assert moved["handle"] is handle
    with pytest.raises(dk.TransferError, match="Cannot move data"):
        dk.to_device({"handle": handle}, META, strict=True)


def _compiled(fn: Any) -> Any:
    return torch.compile(fn, fullgraph=True, backend="eager")


def test_to_device_compiles_with_fullgraph_on_the_common_containers() -> None:
    shared = torch.ones(2)
    batch = {"a": shared, "b": [shared, (torch.arange(3), Pair(torch.ones(1), 7))], "s": "x"}
    moved = _compiled(lambda b: dk.to_device(b, "meta", dtype=torch.float16))(batch)
    eager = dk.to_device(batch, "meta", dtype=torch.float16)
    assert moved["a"] is moved["b"][0]  # aliases kept
    assert type(moved["b"][1][1]) is Pair
    assert moved["b"][1][1].y == 7
    assert moved["s"] == "x"
    for got, want in ((moved["a"], eager["a"]), (moved["b"][1][0], eager["b"][1][0])):
        assert (got.device, got.dtype, got.shape) == (want.device, want.dtype, want.shape)
