"""What guard() costs per forward call of a small model, enabled vs no guard.

Run ``python benchmarks/bench_guard.py``. Rounds alternate between the cases, so drift
in the machine's speed reaches all alike. Target: at most 10 us per call on the CPU.
The last case enters and leaves a ``with guard(model):`` block around every call: what
the block does on leaving (reading an error, if one ended it) is in its figure.
"""

from __future__ import annotations

import statistics
import timeit

import torch
from torch import nn

import devicekit as dk


def main() -> None:
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    batch = torch.randn(8, 32)
    number, rounds = 2000, 21

    def block() -> None:
        with dk.guard(model):
            model(batch)

    plain, guarded, guarded_all, blocks = [], [], [], []
    with torch.no_grad():
        for _ in range(rounds):
            plain.append(timeit.timeit(lambda: model(batch), number=number) / number)
            with dk.guard(model):
                guarded.append(timeit.timeit(lambda: model(batch), number=number) / number)
            with dk.guard(model, recurse=True):
                guarded_all.append(timeit.timeit(lambda: model(batch), number=number) / number)
            blocks.append(timeit.timeit(block, number=number) / number)
    base = statistics.median(plain) * 1e6
    one = statistics.median(guarded) * 1e6
    every = statistics.median(guarded_all) * 1e6
    each = statistics.median(blocks) * 1e6
    print(f"forward, no guard                 {base:7.2f} us")
    print(f"forward, guard(model)             {one:7.2f} us   (+{one - base:.2f} us; target <= 10)")
    print(f"forward, guard(model, recurse)    {every:7.2f} us   (+{every - base:.2f} us, 2 layers)")
    print(f"with guard(model): forward        {each:7.2f} us   (+{each - base:.2f} us)")


if __name__ == "__main__":
    main()
