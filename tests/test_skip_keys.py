"""skip_keys: values under the named keys stay where they are, at any depth, with any option.

Both of to_device's paths keep them; keys that are not keys are refused. meta is the
second device on CPU machines.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._transfer import as_accelerator

from .helpers import CPU, META


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


@pytest.mark.parametrize("options", [{"dtype": torch.float16}, {"copy": True}])
def test_skip_keys_combine_with_every_option(options: dict[str, Any]) -> None:
    raw = torch.ones(2)
    batch = {"raw": raw, "x": torch.ones(2), "nested": [{"raw": [raw]}]}
    moved = dk.to_device(batch, CPU, skip_keys="raw", **options)
    assert moved["raw"] is raw
    assert moved["nested"][0]["raw"][0] is raw
    assert moved["x"] is not batch["x"]
    if "dtype" in options:
        assert moved["x"].dtype == torch.float16
    with as_accelerator("meta"):
        packed = dk.to_device([{"raw": raw, "x": torch.ones(2)}] * 12, META, skip_keys="raw")
    assert packed[0]["raw"] is raw
    assert packed[0]["x"].device == META


def test_skipped_values_are_not_refused_by_strict() -> None:
    handle = object()  # not movable: strict would refuse it anywhere else
    moved = dk.to_device(
        {"handle": handle, "x": torch.ones(1)}, META, strict=True, skip_keys=["handle"]
    )
    assert moved["handle"] is handle
    with pytest.raises(dk.TransferError, match="Cannot move data"):
        dk.to_device({"handle": handle}, META, strict=True)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([["a"]], "hashable keys, got list [['a']]: each of its items must be a hashable key."),
        ([{}], "got list [{}]: each of its items must be a hashable key."),
    ],
)
def test_skip_keys_that_are_not_keys_are_refused(keys: Any, message: str) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        dk.to_device({"a": torch.ones(1)}, "meta", skip_keys=keys)


def test_one_key_that_is_not_a_string_may_be_alone() -> None:
    batch = {5: torch.ones(1), "x": torch.ones(1)}
    moved = dk.to_device(batch, "meta", skip_keys=5)
    assert moved[5] is batch[5]
    assert moved["x"].device == META
