"""DeviceDataLoader against a plain loop calling to_device per batch, side by side.

Run ``python benchmarks/bench_loader.py``. It times epochs of the wrapper against
``for batch in loader: to_device(batch, device)`` on the CPU (target: at most 1.05x).
``--handover`` measures instead what the training process pays to get a batch from a
DataLoader worker, against reading it in the process: the figure behind
``devicekit._loader._stats.HANDOVER_S``, below which the loader's verdict advises no workers.
The loader's overlap and memory on a GPU, and real training loops through it, are in
``benchmarks/gpu_report.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk
from devicekit._loader._stats import HANDOVER_S


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


def handover(repeat: int, batches: int = 1500) -> list[str]:
    """The training thread's CPU time a batch, and the wall time, from workers or in process.

    Batches of 8 rows of 4 floats, in 1, 2 or 3 tensors, from a DataLoader whose
    persistent workers (started before the timing) keep 8 batches each in flight, so
    that the training thread's own work a batch is what is timed: taking the batch from
    the queue and rebuilding its tensors from shared memory (one file descriptor each).
    """
    rows = [
        (
            f"{os.cpu_count()} cores, {platform.machine()}, {platform.system()}; "
            f"HANDOVER_S = {HANDOVER_S * 1e6:.0f} us"
        ),
        f"{'batch':<10} {'num_workers':>11} {'thread CPU us':>14} {'wall us':>8}",
    ]
    for tensors in (1, 2, 3):
        dataset = TensorDataset(*(torch.zeros(batches * 8 + 800, 4) for _ in range(tensors)))
        for workers in (0, 1, 2):
            cpu, wall = [], []
            for _ in range(repeat):
                loader = DataLoader(
                    dataset,
                    batch_size=8,
                    num_workers=workers,
                    persistent_workers=workers > 0,
                    prefetch_factor=8 if workers else None,
                )
                batches_of = iter(loader)
                for _ in range(50):  # the workers started, their queues full
                    next(batches_of)
                started, thread_started = time.perf_counter(), time.thread_time()
                for _ in range(batches):
                    next(batches_of)
                cpu.append((time.thread_time() - thread_started) / batches)
                wall.append((time.perf_counter() - started) / batches)
                del batches_of, loader
            name = f"{tensors} tensor{'s' if tensors > 1 else ''}"
            rows.append(
                f"{name:<10} {workers:>11} {statistics.median(cpu) * 1e6:>14.0f} "
                f"{statistics.median(wall) * 1e6:>8.0f}"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--handover",
        action="store_true",
        help="what getting a batch from a DataLoader worker costs the training process",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, devicekit {dk.__version__}")
    if args.handover:
        print("\n".join(handover(1 if args.quick else 5, 300 if args.quick else 1500)))
        return
    print("\n".join(cpu_overhead(3 if args.quick else 21)))


if __name__ == "__main__":
    main()
