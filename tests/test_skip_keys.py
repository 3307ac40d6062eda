"""skip_keys: values under the named keys stay where they are, at any depth, with any option.

Both of to_device's paths keep them (to meta, the second device on CPU machines, and to
the stand-in accelerator of devicekit.testing); keys that are not keys are refused.
"""

from __future__ import annotations

import contextlib
import re
import sys
import traceback
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import devicekit as dk

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
def test_skip_keys_combine_with_every_option(
    options: dict[str, Any], stand_in_device: torch.device
) -> None:
    raw = torch.ones(2)
    batch = {"raw": raw, "x": torch.ones(2), "nested": [{"raw": [raw]}]}
    moved = dk.to_device(batch, CPU, skip_keys="raw", **options)
    assert moved["raw"] is raw
    assert moved["nested"][0]["raw"][0] is raw
    assert moved["x"] is not batch["x"]
    if "dtype" in options:
        assert moved["x"].dtype == torch.float16
    # The accelerator's walk keeps them too, with every option.
    moved = dk.to_device(
        [{"raw": raw, "x": torch.ones(2)}] * 12, stand_in_device, skip_keys="raw", **options
    )
    assert moved[0]["raw"] is raw
    assert moved[0]["x"].device == stand_in_device
    assert moved[0]["x"].tolist() == [1.0, 1.0]
    if "dtype" in options:
        assert moved[0]["x"].dtype == torch.float16


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


class Store(Mapping[str, Any]):
    """A mapping with a .to() of its own that returns a new one, as a TensorDict's does.

    ``moves_what_is_set``: a value set in it moves to meta, as in a TensorDict with a device
    that cannot give it up.
    """

    def __init__(self, data: dict[str, Any], *, moves_what_is_set: bool = False) -> None:
        self.data, self.moves_what_is_set = data, moves_what_is_set

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value.to(META) if self.moves_what_is_set else value

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def to(self, device: torch.device) -> Store:
        return Store(dk.to_device(self.data, device), moves_what_is_set=self.moves_what_is_set)


@contextlib.contextmanager
def _low_recursion_limit(frames: int = 60) -> Iterator[None]:
    """Python's recursion limit ``frames`` above the current stack: any recursion fails."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(len(traceback.extract_stack()) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def test_skipped_keys_are_kept_3000_deep_in_a_mapping_that_moves_itself() -> None:
    raws = [torch.zeros(1) for _ in range(3_000)]
    deep: dict[str, Any] = {"raw": raws[-1], "x": torch.ones(1)}
    for raw in reversed(raws[:-1]):
        deep = {"raw": raw, "x": torch.ones(1), "down": deep}
    with _low_recursion_limit():  # a walk that recursed once a level would fail
        moved = dk.to_device({"store": Store(deep)}, META, skip_keys="raw")["store"]
    level: Any = moved
    for raw in raws:
        assert level["raw"] is raw
        assert level["x"].device == META
        level = level.get("down")
    assert deep["x"].device == CPU  # the input is unchanged


def test_a_skipped_value_that_cannot_be_kept_is_named_by_its_whole_path() -> None:
    inner = Store({"raw": torch.ones(1)}, moves_what_is_set=True)
    batch = {"batch": Store({"inner": inner}, moves_what_is_set=True)}
    msg = (
        "Cannot keep data['batch']['inner']['raw'] as it is: the Store moves every value set "
        "in it to its device. Move it out of the batch before to_device instead of naming "
        "it in skip_keys."
    )
    with pytest.raises(dk.TransferError, match=re.escape(msg)):
        dk.to_device(batch, META, skip_keys="raw")
