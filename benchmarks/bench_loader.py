"""DeviceDataLoader against a plain loop calling to_device per batch, side by side.

Run ``python benchmarks/bench_loader.py``. It times epochs of the wrapper against
``for batch in loader: to_device(batch, device)`` on the CPU (target: at most 1.05x).
``--handover`` measures instead what the training process pays to get a batch from a
DataLoader worker, against reading it in the process: the figure behind
``devicekit._loader._stats.HANDOVER_S``, below which the loader's verdict advises no workers.
``--pinning`` times the feed thread's pinning stage on the host, on the GPU report's
loader batches: a fresh copy per large tensor on one thread (``pin_memory()``'s host
work, as a pinning DataLoader does it), against the loader's staging pool on one thread
and on its pinning threads (ordinary memory stands in for page-locked memory here; the
target: never slower than the one thread). CI runs it with ``--quick``. ``--slabs``
counts the slabs the staging pool page-locks over an epoch of growing and of varying
batch sizes (each a cost of milliseconds on a GPU host); ``--waits`` measures the CPU a
thread spends waiting for a copy through the prefetcher's timer, an event standing in.
The loader's overlap and memory on a GPU, and real training loops through it, are in
``benchmarks/gpu_report.py``.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk
from devicekit._core import PACK_MAX_BYTES, map_leaves
from devicekit._loader._cpus import machine_cpus
from devicekit._loader._pipeline import StreamPrefetcher
from devicekit._loader._staging import PAGEABLE, Stager, StagingPool, pin_threads
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


def pinning_batches(quick: bool) -> dict[str, Any]:
    """The GPU report's loader batches (tiny where ``quick``): what the feed thread pins."""
    scale = 8 if quick else 1
    return {
        "16 MiB tensor (overlap)": torch.randn((16 << 20) // 4 // scale),
        "ResNet-18, 256 x 224 px uint8": [
            torch.randint(0, 256, (256 // scale, 3, 224, 224), dtype=torch.uint8),
            torch.randint(0, 10, (256 // scale,)),
        ],
        "small CNN, 512 x 64 px float32": [
            torch.rand(512 // scale, 3, 64, 64),
            torch.randint(0, 10, (512 // scale,)),
        ],
        "64 per-image dicts": per_image_batches(64 // scale),
    }


def _fresh_copy(leaf: Any, state: object) -> Any:
    """What pinning each batch afresh did on the host: a new copy of each large tensor."""
    if isinstance(leaf, torch.Tensor) and leaf.nbytes > PACK_MAX_BYTES:
        return leaf.clone()
    return leaf


def pinning(repeat: int, quick: bool) -> list[str]:
    """The pinning stage's host time per batch, in a thread set up as the feed thread is."""
    threads = pin_threads(machine_cpus())
    never = threading.Event()
    rows = [
        f"pinning stage, ms a batch ({threads} pinning threads on {machine_cpus()} CPUs)",
        (
            f"{'batch':<32} {'fresh, 1 thread':>16} {'pool, 1 thread':>15} "
            f"{f'pool, {threads} threads':>17} {'ratio':>6}"
        ),
    ]

    def measure() -> None:
        torch.set_num_threads(1)  # as the feed thread runs
        for name, batch in pinning_batches(quick).items():
            one = Stager(StagingPool(None, 2, PAGEABLE.allocate), 1)
            many = Stager(StagingPool(None, 2, PAGEABLE.allocate), threads)

            def fresh(batch: Any = batch) -> None:
                map_leaves(_fresh_copy, batch)

            def pooled(stager: Stager, batch: Any = batch) -> None:
                stager.stage(batch, never).copy_issued(lambda wait: 0.0)

            timings: dict[str, list[float]] = {"fresh": [], "one": [], "many": []}
            contenders = {
                "fresh": fresh,
                "one": functools.partial(pooled, one),
                "many": functools.partial(pooled, many),
            }
            for contender in contenders.values():
                contender()  # warm: slabs made, threads started
            for _ in range(repeat):  # interleaved rounds
                for key, contender in contenders.items():
                    started = time.perf_counter()
                    contender()
                    timings[key].append(time.perf_counter() - started)
            many.close()
            fresh_ms, one_ms, many_ms = (min(timings[key]) * 1e3 for key in contenders)
            rows.append(
                f"{name:<32} {fresh_ms:>16.3f} {one_ms:>15.3f} {many_ms:>17.3f} "
                f"{many_ms / fresh_ms:>6.2f}"
            )

    feed = threading.Thread(target=measure, name="devicekit-feed")
    feed.start()
    feed.join()
    rows.append("ratio: the pool on its threads / a fresh copy on one (target <= 1.00)")
    return rows


class _Copy:
    """A copy's timer that ends when waited for, or when told."""

    def __init__(self) -> None:
        self.done = False

    def __call__(self, wait: bool) -> float | None:
        self.done = self.done or wait
        return 0.001 if self.done else None


def slabs() -> list[str]:
    """Slabs page-locked over 100 batches, each copy ending while the next is staged."""
    large = PACK_MAX_BYTES + 4
    growing = [int(4 * large * 1.01**step) // 4 * 4 for step in range(100)]
    shuffled = random.Random(0)  # noqa: S311 - batch sizes, not secrets
    varying = [shuffled.randrange(2 * large, 8 * large) // 4 * 4 for _ in range(100)]
    rows = [f"{'100 batches':<34} {'new slabs':>9} {'page-locked MiB':>16}"]
    for name, sizes in (("growing 1% a batch", growing), ("varying 2-8x at random", varying)):
        stager = Stager(StagingPool(None, 2, PAGEABLE.allocate), 1)
        running: list[_Copy] = []
        for step, size in enumerate(sizes):
            staged = stager.stage([torch.full((size // 4,), float(step))], threading.Event())
            running.append(_Copy())
            staged.copy_issued(running[-1])
            if len(running) > 1:
                running.pop(0).done = True
        figures = stager.pool.figures
        stager.close()
        rows.append(f"{name:<34} {figures.slabs:>9} {figures.peak_bytes / 2**20:>16.2f}")
    return rows


class _StandInEvent:
    """A CUDA event as a waiting thread sees it, on the host.

    query() says whether the copy ended; synchronize() spins until it has, as
    cudaEventSynchronize does on an event made without the blocking flag.
    """

    def __init__(self, ends: float) -> None:
        self.ends = ends

    def query(self) -> bool:
        return time.perf_counter() >= self.ends

    def synchronize(self) -> None:
        while time.perf_counter() < self.ends:
            pass

    def elapsed_time(self, end: _StandInEvent) -> float:
        return 0.0


def waits(repeat: int) -> list[str]:
    """The waiting thread's CPU while a 200 ms copy runs, through the prefetcher's timer."""
    copy_s = 0.2
    measured: list[tuple[float, float]] = []

    def wait_for_copies() -> None:
        for _ in range(repeat):
            ready = _StandInEvent(time.perf_counter() + copy_s)
            timer = StreamPrefetcher.timer(None, (None, _StandInEvent(0.0), ready))  # type: ignore[arg-type]
            cpu, wall = time.thread_time(), time.perf_counter()
            timer(True)
            measured.append((time.thread_time() - cpu, time.perf_counter() - wall))

    thread = threading.Thread(target=wait_for_copies, name="devicekit-feed")
    thread.start()
    thread.join()
    cpu = statistics.median(c for c, _ in measured)
    wall = statistics.median(w for _, w in measured)
    said = (
        f"a thread waiting for a {copy_s * 1e3:.0f} ms copy: {cpu * 1e3:.1f} ms of its CPU "
        f"({cpu / wall:.1%} of a core); it sees the end {1e3 * (wall - copy_s):.2f} ms late"
    )
    return [said]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--handover",
        action="store_true",
        help="what getting a batch from a DataLoader worker costs the training process",
    )
    parser.add_argument(
        "--pinning",
        action="store_true",
        help="the feed thread's pinning stage, threads against one",
    )
    parser.add_argument(
        "--slabs", action="store_true", help="slabs page-locked for growing and varying batches"
    )
    parser.add_argument(
        "--waits", action="store_true", help="the CPU a thread spends waiting for a copy"
    )
    args = parser.parse_args()
    if args.slabs:
        print("\n".join(slabs()))
        return
    if args.waits:
        print("\n".join(waits(2 if args.quick else 5)))
        return
    if args.pinning:
        print("\n".join(pinning(3 if args.quick else 15, args.quick)))
        return
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, devicekit {dk.__version__}")
    if args.handover:
        print("\n".join(handover(1 if args.quick else 5, 300 if args.quick else 1500)))
        return
    print("\n".join(cpu_overhead(3 if args.quick else 21)))


if __name__ == "__main__":
    main()
