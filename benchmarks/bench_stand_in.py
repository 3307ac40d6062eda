"""What an operation costs on the stand-in accelerator against the same one on the CPU.

Run ``python benchmarks/bench_stand_in.py`` (``--quick`` for a smoke run). It starts the
stand-in (``devicekit.testing.stand_in``) in this process and times each workload on the
CPU and on ``standin:0``, side by side in one run:

- ``x * 2 + 1`` on 1,000 floats: two small elementwise operations;
- a 256 x 256 matmul;
- a small MLP (``Linear(64, 128)``, ReLU, ``Linear(128, 128)``, ReLU, ``Linear(128, 10)``)
  on a batch of 32: forward, a mean for the loss, backward;
- an AdamW step on two ``Linear`` layers, 98,688 parameters, their gradients set;
- a 1 MB host tensor copied with ``.to(device)``: on the CPU, ``.to("cpu", copy=True)``
  copies the same bytes, since ``.to("cpu")`` of a CPU tensor copies nothing.

The stand-in computes each value with the CPU's own kernels; what it adds is its own
Python around each operation (the device check, unwrapping, the streams' order,
wrapping, counting memory). So the ratio is what a test suite pays for running its loop
on the stand-in: the same loop on a GPU is no faster here. Each stand-in timing ends
with ``torch.accelerator.synchronize()``, as a GPU timing does, its cost spread over the
calls it ends. Rounds alternate between the CPU and the stand-in, so drift in the
machine's speed reaches both alike: compare ratios from one run, not times from two.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import devicekit as dk
from devicekit.testing import stand_in

CPU = torch.device("cpu")
clock = time.perf_counter


def elementwise(device: torch.device) -> Callable[[], Any]:
    x = torch.randn(1_000, generator=torch.Generator().manual_seed(0)).to(device)
    return lambda: x * 2 + 1


def matmul(device: torch.device) -> Callable[[], Any]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=generator).to(device)
    b = torch.randn(256, 256, generator=generator).to(device)
    return lambda: a @ b


def mlp_step(device: torch.device) -> Callable[[], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    ).to(device)
    batch = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(batch).mean().backward()

    return step


def adamw_step(device: torch.device) -> Callable[[], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128)).to(device)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return optimizer.step


def host_to_device(device: torch.device) -> Callable[[], Any]:
    host = torch.randn(262_144, generator=torch.Generator().manual_seed(0))  # 1 MB
    if device == CPU:
        return lambda: host.to(CPU, copy=True)
    return lambda: host.to(device)


WORKLOADS: dict[str, Callable[[torch.device], Callable[[], Any]]] = {
    "x * 2 + 1, 1,000 floats": elementwise,
    "matmul 256 x 256": matmul,
    "MLP forward + backward": mlp_step,
    "AdamW step, 98,688 params": adamw_step,
    "host -> device .to(), 1 MB": host_to_device,
}


def _synchronize(device: torch.device) -> None:
    if device != CPU:
        torch.accelerator.synchronize(device)


def _chunk_us(call: Callable[[], Any], device: torch.device, number: int) -> float:
    """Microseconds a call, over ``number`` calls and the synchronize that ends them."""
    start = clock()
    for _ in range(number):
        call()
    _synchronize(device)
    return (clock() - start) / number * 1e6


def race(
    contenders: dict[torch.device, Callable[[], Any]], repeat: int, budget_s: float
) -> dict[torch.device, float]:
    """Median microseconds a call of each contender, timed in alternating rounds."""
    numbers = {}
    for device, call in contenders.items():
        _chunk_us(call, device, 3)  # warm up: first calls build caches, import lazily
        once_s = _chunk_us(call, device, 5) / 1e6
        numbers[device] = max(1, int(budget_s / repeat / len(contenders) / max(once_s, 1e-7)))
    rounds: dict[torch.device, list[float]] = {device: [] for device in contenders}
    order = list(contenders)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for number in range(repeat):
            for device in order if number % 2 == 0 else order[::-1]:
                rounds[device].append(_chunk_us(contenders[device], device, numbers[device]))
    finally:
        if enabled:
            gc.enable()
    return {device: statistics.median(times) for device, times in rounds.items()}


def measure(repeat: int, budget_s: float) -> list[tuple[str, float, float]]:
    """Each workload's median microseconds a call: (name, on the CPU, on the stand-in)."""
    device = torch.device(stand_in(), 0)
    rows = []
    for name, make in WORKLOADS.items():
        medians = race({CPU: make(CPU), device: make(device)}, repeat, budget_s)
        rows.append((name, medians[CPU], medians[device]))
    return rows


def report(rows: list[tuple[str, float, float]], repeat: int) -> list[str]:
    lines = [
        f"torch {torch.__version__}, devicekit {dk.__version__}, 1 thread, {repeat} rounds",
        f"  {'workload':<28} {'CPU us':>9} {'stand-in us':>12} {'ratio':>7}",
    ]
    lines += [
        f"  {name:<28} {cpu:>9.1f} {ours:>12.1f} {ours / cpu:>6.1f}x" for name, cpu, ours in rows
    ]
    return lines


def main(argv: list[str] | None = None) -> list[tuple[str, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args(argv)
    repeat, budget = (3, 0.05) if args.quick else (21, 4.0)
    torch.set_num_threads(1)  # the operations' own cost, without thread-pool noise
    rows = measure(repeat, budget)
    print("\n".join(report(rows, repeat)))
    return rows


if __name__ == "__main__":
    main()
