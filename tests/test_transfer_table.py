"""The table of per-type decisions that every walk reads, on its own.

Each type is decided once and looked up after; what the table keeps is bounded; and the
tables it keeps start over when the registry of transfer rules changes.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit._core import _kinds

from .helpers import CPU, META


def test_a_type_is_decided_once_then_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    class Fresh:
        pass

    made: list[type] = []
    decide_for_real = _kinds._decide

    def counting(cls: type) -> Any:
        made.append(cls)
        return decide_for_real(cls)

    monkeypatch.setattr(_kinds, "_decide", counting)
    decisions = _kinds._decisions
    first = _kinds.decide(Fresh)
    assert all(_kinds.decide(Fresh) is first for _ in range(5))
    assert made == [Fresh]
    assert _kinds._decisions is decisions  # looked up: no table rewritten


def test_caches_of_per_type_decisions_are_bounded() -> None:
    first: Any = None
    for index in range(3 * _kinds.TYPES_KEPT):
        kind = type(f"Made{index}", (), {"to": lambda self, device: self})
        if first is None:
            first = weakref.ref(kind)
        dk.to_device([kind()], META)
        del kind
    assert len(_kinds._decisions) <= _kinds.TYPES_KEPT
    gc.collect()
    assert first() is None  # the first type made is no longer held


def test_a_skip_set_s_table_is_made_once_and_starts_over_with_the_registry() -> None:
    skip = frozenset({"raw"})
    table = _kinds.skipping(skip)
    assert _kinds.skipping(skip) is table
    nodes = table[0]
    dk.to_device({"raw": torch.ones(1), "x": torch.ones(1)}, META, skip_keys="raw")

    @dataclasses.dataclass
    class Boxes:
        xyxy: torch.Tensor

    @dk.register_transfer(Boxes)
    def move_boxes(boxes: Boxes, device: torch.device, **options: Any) -> Boxes:
        return Boxes(boxes.xyxy.to(device) + 1)

    try:
        assert _kinds.skipping(skip)[0] is not nodes  # started over
        moved = dk.to_device({"raw": 1, "b": Boxes(torch.zeros(1))}, CPU, skip_keys="raw")
        assert torch.equal(moved["b"].xyxy, torch.ones(1))  # the new rule applies at once
    finally:
        dk.unregister_transfer(Boxes)
