"""DeviceDataLoader against a plain loop calling to_device per batch, side by side.

Run ``python benchmarks/bench_loader.py``. It times epochs of the wrapper against
``for batch in loader: to_device(batch, device)`` on the CPU (target: at most 1.05x).
The loader's overlap and memory on a GPU, and real training loops through it, are in
``benchmarks/gpu_report.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk


def per_image_batches(count: int) -> list[dict[str, Any]]:
    return [
        {"image": torch.randn(8, 3, 16, 16), "label": torch.randint(0, 10, (8,)), "id": i}
        for i in range(count)
    ]


def epoch_seconds(run_epoch: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run_epoch()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_overhead(repeat: int) -> list[str]:
    rows = [f"{'workload':<34} {'plain loop ms':>14} {'wrapper ms':>11} {'ratio':>6}"]
    workloads: dict[str, tuple[Iterable[Any], torch.device]] = {
        "list of 200 batches -> meta": (per_image_batches(200), torch.device("meta")),
        "list of 200 batches -> cpu": (per_image_batches(200), torch.device("cpu")),
        "DataLoader, 4096 x 64 -> meta": (
            DataLoader(TensorDataset(torch.randn(4096, 64), torch.arange(4096)), batch_size=64),
            torch.device("meta"),
        ),
    }
    for name, (source, device) in workloads.items():
        wrapped = dk.DeviceDataLoader(source, device)

        def plain(source: Iterable[Any] = source, device: torch.device = device) -> None:
            for batch in source:
                dk.to_device(batch, device)

        def wrapper(wrapped: dk.DeviceDataLoader[Any] = wrapped) -> None:
            for _batch in wrapped:
                pass

        # Interleaved, so drift in the machine's speed reaches both alike.
        plain_times, wrapper_times = [], []
        for _ in range(repeat):  # each round: the median of 10 epochs of each
            plain_times.append(epoch_seconds(plain, 10))
            wrapper_times.append(epoch_seconds(wrapper, 10))
        a, b = statistics.median(plain_times) * 1e3, statistics.median(wrapper_times) * 1e3
        rows.append(f"{name:<34} {a:>14.2f} {b:>11.2f} {b / a:>6.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, devicekit {dk.__version__}")
    print("\n".join(cpu_overhead(3 if args.quick else 21)))


if __name__ == "__main__":
    main()
