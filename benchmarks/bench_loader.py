"""DeviceDataLoader against a plain loop calling to_device per batch, side by side.

Run ``python benchmarks/bench_loader.py``. On the CPU it times epochs of the wrapper
against ``for batch in loader: to_device(batch, device)`` (target: at most 1.05x). On a
CUDA machine it also runs a synthetic step whose compute time equals one batch's
copy time (target: an epoch with prefetching within 1.05x of max(compute, copy), the
plain loop near compute + copy) and records device and pinned memory over 50 epochs,
which must stay flat.
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


def gpu_overlap(epochs: int) -> list[str]:
    device = torch.device("cuda", torch.cuda.current_device())
    batches = [torch.randn(16 << 20 // 4) for _ in range(32)]  # 16 MiB pageable batches

    # The copy time of one (pinned) batch, and a sleep of the same length as the compute.
    pinned = batches[0].pin_memory()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        pinned.to(device, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = (time.perf_counter() - start) / 20
    cycles = int(copy_s * torch.cuda.clock_rate() * 1e6) if hasattr(torch.cuda, "clock_rate") else 0
    if cycles <= 0:
        cycles = int(copy_s * 1.5e9)

    def step(batch: torch.Tensor) -> None:
        torch.cuda._sleep(cycles)
        batch.mul_(1.0)

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(len(batches)):
        torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    compute_s = (time.perf_counter() - start) / len(batches)

    def plain_epoch() -> None:
        for batch in batches:
            step(dk.to_device(batch, device))
        torch.cuda.synchronize()

    loader = dk.DeviceDataLoader(batches, device, prefetch=2)

    def wrapped_epoch() -> None:
        for batch in loader:
            step(batch)
        torch.cuda.synchronize()

    plain_s = epoch_seconds(plain_epoch, 5) / len(batches)
    wrapped_s = epoch_seconds(wrapped_epoch, 5) / len(batches)
    bound = max(compute_s, copy_s)
    rows = [
        f"copy of one 16 MiB pinned batch   {copy_s * 1e3:8.3f} ms",
        f"compute (sleep) per step          {compute_s * 1e3:8.3f} ms",
        (
            f"plain loop per step               {plain_s * 1e3:8.3f} ms"
            f"   ({plain_s / (compute_s + copy_s):.2f} x (compute + copy))"
        ),
        (
            f"DeviceDataLoader per step         {wrapped_s * 1e3:8.3f} ms"
            f"   ({wrapped_s / bound:.2f} x max(compute, copy); target <= 1.05)"
        ),
    ]
    device_mib, pinned_mib = [], []
    for _ in range(epochs):
        wrapped_epoch()
        device_mib.append(torch.cuda.memory_allocated(device) / 2**20)
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        pinned_mib.append(stats.get("allocated_bytes.current", 0) / 2**20)
    device_range = f"{min(device_mib):.0f}..{max(device_mib):.0f} MiB"
    pinned_range = f"{min(pinned_mib):.0f}..{max(pinned_mib):.0f} MiB"
    rows.append(f"after each of {epochs} epochs: device {device_range}, pinned {pinned_range}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, devicekit {dk.__version__}")
    print("\n".join(cpu_overhead(3 if args.quick else 21)))
    if torch.cuda.is_available():
        print()
        print("\n".join(gpu_overlap(5 if args.quick else 50)))


if __name__ == "__main__":
    main()
