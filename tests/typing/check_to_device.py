"""User code that mypy --strict must accept: to_device keeps the static type of its input."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import assert_type

import devicekit as dk

batch: dict[str, torch.Tensor] = {"x": torch.ones(1)}
assert_type(dk.to_device(batch, "meta"), dict[str, torch.Tensor])
assert_type(dk.to_device(torch.ones(1)), torch.Tensor)
model = dk.to_device(torch.nn.Linear(1, 1), torch.device("cpu"), dtype=torch.float64)
assert_type(model, torch.nn.Linear)
assert_type(dk.to_device([1, 2], 0, non_blocking=False, strict=True), list[int])


class Boxes:
    def __init__(self, xyxy: torch.Tensor) -> None:
        self.xyxy = xyxy


@dk.register_transfer(Boxes)
def move_boxes(boxes: Boxes, device: torch.device, **options: Any) -> Boxes:
    return Boxes(boxes.xyxy.to(device))


assert_type(dk.to_device(Boxes(torch.ones(1, 4)), "meta"), Boxes)
