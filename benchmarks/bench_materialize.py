"""What dk.materialize costs over ``to_empty`` + ``reset_parameters`` by hand, on a meta model.

Run ``python benchmarks/bench_materialize.py``. The model has 1,000 modules (500 pairs
of a Linear and a LayerNorm, 64 wide, in one Sequential) built on the meta device, anew
for every round and outside the timing. By hand: ``model.to_empty(device=...)``, then each module's
``reset_parameters()``. materialize does the same and more: it fills each new tensor
with its filler first, reads every element for the filler after (a write counted on a
tensor need not have covered all of it), to name what nothing wrote, and walks the
modules' plain attributes for tensors left on meta. Rounds alternate
between the two, so drift in the machine's speed reaches both alike. Target: at most
1.2x the hand-written lines.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import devicekit as dk


def meta_model(blocks: int = 500, width: int = 64) -> nn.Module:
    """A model of ``2 * blocks`` modules (and its root), on the meta device."""
    with torch.device("meta"):
        layers = [(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(blocks)]
        return nn.Sequential(*[layer for pair in layers for layer in pair])


def by_hand(model: nn.Module, device: torch.device) -> None:
    """The lines materialize replaces."""
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def materialized(model: nn.Module, device: torch.device) -> None:
    dk.materialize(model, device)


def timed(
    how: Callable[[nn.Module, torch.device], None], device: torch.device, blocks: int
) -> float:
    """Seconds one call takes on a fresh meta model, the device's work included."""
    model = meta_model(blocks)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    how(model, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(device: torch.device, rounds: int = 11, blocks: int = 500) -> dict[str, float]:
    """Median milliseconds of each way, and their ratio."""
    timed(by_hand, device, blocks)  # warm-up: first calls of each kernel and allocator
    timed(materialized, device, blocks)
    hand, ours = [], []
    for _ in range(rounds):
        hand.append(timed(by_hand, device, blocks))
        ours.append(timed(materialized, device, blocks))
    hand_ms, ours_ms = statistics.median(hand) * 1e3, statistics.median(ours) * 1e3
    return {"by hand ms": hand_ms, "materialize ms": ours_ms, "ratio": ours_ms / hand_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found = measure(torch.device(args.device), args.rounds)
    print(f"1,000 modules on {args.device}:")
    print(f"  to_empty + reset_parameters  {found['by hand ms']:8.1f} ms")
    print(f"  dk.materialize               {found['materialize ms']:8.1f} ms")
    print(f"  ratio                        {found['ratio']:8.2f}x   (target <= 1.2x)")


if __name__ == "__main__":
    main()
