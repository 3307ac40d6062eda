"""Every GPU figure in one command: tests, transfers against peers, bandwidth, the loader.

Run on a machine with one CUDA GPU, from the repository root::

    PYTHONPATH=. python benchmarks/gpu_report.py --out gpu-report.md

It writes a markdown report, section by section as each ends (printed too): a header
with the date, commit, CPU model, GPU, driver, PyTorch and peer versions, then

1. the cuda-marked tests (``pytest -m cuda``), and the loader's under PyTorch's CUDA
   sanitizer, each in a subprocess with its own time limit;
2. host->device transfers, each call followed by a synchronize, rounds interleaved:
   ``.to(d)`` and ``.to(d, non_blocking=True)`` per tensor, accelerate's
   ``send_to_device``, Lightning's ``move_data_to_device`` and devicekit, on the
   workloads of the targets, pageable and pinned;
3. packing: the chunk size swept (interleaved), and a profile of one call's host work;
4. bulk bandwidth, interleaved: host->device against ``copy_`` from pinned memory, and
   device->host as ``.to("cpu")``, ``.to("cpu", non_blocking=True)`` + synchronize and
   ``copy_`` into pinned memory (the limit);
5. the loader's overlap: per step against max(compute, copy, pin), by hand (pageable,
   and a pinning DataLoader + non_blocking) and through DeviceDataLoader at prefetch
   1-4; memory over many epochs: device peak, pinned host memory, host RSS, threads;
6. an input-bound loop (large 224 px uint8 images from a pageable in-memory dataset, a
   light model): images/s by hand (a pinning DataLoader + non_blocking, and a plain
   DataLoader + ``.to()``) and through DeviceDataLoader at prefetch 1 and 2, and the GB/s
   of DeviceDataLoader's copies against ``copy_``'s and the PCIe link's peak;
7. two real training loops (a torchvision ResNet-18 on 224 px uint8 images and a small
   CNN on 64 px float images): images precomputed in memory, shuffled, ``drop_last``, 6
   persistent workers, bf16 autocast, channels_last, 5 warm-up steps then 60 timed
   steps, a fresh seeded model per variant, best of 2; with the bare loader's rate;
8. to_device inside torch.compile: compilations over fresh batches;
9. fit_batch with the process limited to 4 GiB of the GPU: the size found against the
   exact largest, 200 steps at it, and the memory left allocated after the search.

Each section runs under a watchdog (:data:`BUDGET_S`); one that fails or runs out of
time is reported as such, and every other section still is. On an H100 it takes about
5-6 minutes (tests 2 min, loops 1.5 min, the rest 2 min), 590 s at the most.

``--smoke`` runs every section on the CPU with tiny sizes, through the same pipeline an
accelerator takes: the meta device is moved to as to an accelerator (packing), a
stand-in takes the side stream's place in DeviceDataLoader (the feed thread pins
through its seam), and the DataLoaders have 2 workers. CI runs it, so the script cannot
rot where no GPU is at hand; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import faulthandler
import functools
import importlib.metadata
import io
import os
import platform
import pstats
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))
from bench_materialize import by_hand, meta_model
from bench_to_device import mixed_batch, per_tensor_loop

import devicekit as dk
from devicekit._base import link_peak
from devicekit._commands._bench import per_image_batch
from devicekit._core import _packing
from devicekit._core._transfer import as_accelerator
from devicekit._loader import _loader, _staging

Mover = Callable[[Any, torch.device], Any]
BUDGET_S: dict[str, float] = {
    # seconds per section, 590 in all: the tests' two subprocesses have 130 and 60
    "tests": 200,
    "transfers": 35,
    "packing": 20,
    "bandwidth": 30,
    "overlap": 55,
    "input": 30,
    "loops": 110,
    "compiled": 45,
    "fit": 40,
    "materialize": 25,
}
TEST_RUNS_S = (130, 60)


@dataclass
class Setting:
    """Where the report runs and how big its work is."""

    device: torch.device
    smoke: bool
    rounds: int
    budget_s: float  # per contender and figure, all rounds together

    @property
    def gpu(self) -> bool:
        """Whether this is a real run on a GPU."""
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for the device's queued work."""
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor in pinned memory where there is an accelerator to pin for."""
        return tensor.pin_memory() if self.gpu else tensor.clone()


class _HostPrefetcher:
    """The smoke run's stand-in for the side stream: copies in order on the host."""

    def __init__(self, device: torch.device, non_blocking: object) -> None:
        self.device = device

    def start(self, batch: Any) -> Any:
        return dk.to_device(batch, self.device)

    def hand_over(self, ticket: Any) -> Any:
        return ticket

    def consumer_done(self) -> None:
        pass

    def timer(self, ticket: Any) -> Callable[[bool], float | None]:
        return lambda wait: None  # the host copies in line: no copy time of its own


@contextlib.contextmanager
def accelerator_on_the_cpu() -> Iterator[None]:
    """The meta device taken as an accelerator: packing, the feed thread, the pipeline.

    The loader stages batches in ordinary memory (nothing can be pinned without an
    accelerator), so the feed thread and its pinning threads run what they run on a GPU.
    """
    _loader.PREFETCHERS["meta"] = _HostPrefetcher
    _staging.ALLOCATORS["meta"] = _staging.PAGEABLE
    try:
        with as_accelerator("meta"):
            yield
    finally:
        del _loader.PREFETCHERS["meta"], _staging.ALLOCATORS["meta"]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def interleaved(
    contenders: dict[str, Callable[[], Any]], setting: Setting, budget_s: float | None = None
) -> dict[str, float]:
    """Median microseconds per call of each contender, rounds interleaved.

    Each call is followed by a synchronize, so a contender's figure is what one
    transfer costs from start to data on the device.
    """

    def once(fn: Callable[[], Any]) -> None:
        fn()
        setting.sync()

    budget_s = budget_s or setting.budget_s
    numbers = {}
    for name, fn in contenders.items():
        once(fn)  # warm caches, allocators and per-type decisions
        start = time.perf_counter()
        once(fn)
        took = time.perf_counter() - start
        numbers[name] = max(1, int(budget_s / setting.rounds / max(took, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(setting.rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            for _ in range(numbers[name]):
                once(fn)
            samples[name].append((time.perf_counter() - start) / numbers[name] * 1e6)
    return {name: statistics.median(times) for name, times in samples.items()}


# 1. The cuda-marked tests.


def cuda_tests(setting: Setting) -> list[str]:
    lines = ["## cuda-marked tests", ""]
    if setting.smoke:
        return [*lines, "Not run in --smoke.", ""]
    pytest = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    runs = {
        "all cuda tests": ({}, ["tests"]),
        # PyTorch's CUDA sanitizer checks every kernel's stream accesses for races.
        "loader tests under TORCH_CUDA_SANITIZER=1": (
            {"TORCH_CUDA_SANITIZER": "1"},
            ["tests/test_loader_cuda.py"],
        ),
    }
    for (label, (environment, paths)), limit_s in zip(runs.items(), TEST_RUNS_S, strict=True):
        try:
            result = subprocess.run(
                [*pytest, *paths],
                capture_output=True,
                text=True,
                check=False,
                timeout=limit_s,
                env={**os.environ, **environment},
            )
        except subprocess.TimeoutExpired as expired:
            output = expired.stdout or b""
            text = output.decode() if isinstance(output, bytes) else output
            lines += [f"{label}: did not finish in {limit_s} s", "", "```", text[-3000:], "```", ""]
            continue
        tail = (result.stdout + result.stderr).strip().splitlines()[-20:]
        lines += [f"{label}: exit code {result.returncode}", "", "```", *tail, "```", ""]
    return lines


# 2. Transfers against peers.


def _peers() -> dict[str, Mover]:
    found: dict[str, Mover] = {}
    try:
        from accelerate.utils import send_to_device

        found["accelerate"] = lambda batch, device: send_to_device(batch, device, non_blocking=True)
    except ImportError:
        pass
    try:
        from lightning_fabric.utilities.apply_func import move_data_to_device
    except ImportError:
        try:
            from lightning.fabric.utilities.apply_func import move_data_to_device
        except ImportError:
            move_data_to_device = None
    if move_data_to_device is not None:
        found["lightning"] = move_data_to_device
    return found


def transfer_workloads(setting: Setting) -> dict[str, Callable[[], Any]]:
    scale = 8 if setting.smoke else 1
    return {
        "dict of 8 x 16 KiB": lambda: {f"f{i}": torch.randn(64, 64) for i in range(8)},
        "64 per-image dicts of 3 small tensors": per_image_batch,
        # The GPU table's nested batch: bench_to_device's with 10 targets (that table,
        # measured before this script, says 24 tensors; counted, they are 25).
        "mixed nested batch, 25 tensors": functools.partial(mixed_batch, targets=10),
        "1000 x 4 KiB": lambda: [torch.randn(1024) for _ in range(1000 // scale)],
        "64 images 3x224x224 + boxes": lambda: [
            {"image": torch.randn(3, 224 // scale, 224 // scale), "boxes": torch.rand(5, 4)}
            for _ in range(64)
        ],
    }


def _pin_all(batch: Any, setting: Setting) -> Any:
    from devicekit._core._tree import map_leaves

    return map_leaves(lambda x, _: setting.pin(x) if isinstance(x, torch.Tensor) else x, batch)


def transfers(setting: Setting) -> list[str]:
    movers: dict[str, Mover] = {
        ".to(d)": per_tensor_loop,
        ".to(d, non_blocking=True)": functools.partial(per_tensor_loop, non_blocking=True),
        **_peers(),
        "devicekit": dk.to_device,
    }
    lines = [
        "## Host -> device transfers",
        "",
        (
            f"Median us per call, each followed by a synchronize, {setting.rounds} interleaved "
            "rounds. x: how many times faster devicekit is than that contender."
        ),
        "",
    ]
    for memory in ("pageable", "pinned"):
        rows = []
        for name, make in transfer_workloads(setting).items():
            batch = make() if memory == "pageable" else _pin_all(make(), setting)
            contenders = {
                label: functools.partial(move, batch, setting.device)
                for label, move in movers.items()
            }
            medians = interleaved(contenders, setting)
            ours = medians["devicekit"]
            rows.append(
                [name]
                + [
                    f"{took:.0f}" if label == "devicekit" else f"{took:.0f} ({took / ours:.2f}x)"
                    for label, took in medians.items()
                ]
            )
        lines += [f"### {memory} sources", ""]
        lines += table(["workload", *movers], rows)
    return lines


# 3. Packing: the chunk bound swept, and where one call's host time goes.


@contextlib.contextmanager
def _chunk_bound(chunk: int) -> Iterator[None]:
    chosen = _packing.CHUNK_BYTES
    _packing.CHUNK_BYTES = chunk  # type: ignore[misc] - the sweep sets the bound
    try:
        yield
    finally:
        _packing.CHUNK_BYTES = chosen  # type: ignore[misc]


def _with_chunk(chunk: int, batch: Any, device: torch.device) -> None:
    with _chunk_bound(chunk):
        dk.to_device(batch, device)


def packing(setting: Setting) -> list[str]:
    lines = ["## Packing", ""]
    workloads = transfer_workloads(setting)
    chunks = (64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20)
    names = ("1000 x 4 KiB", "64 per-image dicts of 3 small tensors")
    columns = {}
    for name in names:
        batch = workloads[name]()
        contenders = {  # every chunk size in each round: interleaved
            str(chunk): functools.partial(_with_chunk, chunk, batch, setting.device)
            for chunk in chunks
        }
        columns[name] = interleaved(contenders, setting)
    rows = [
        [f"{chunk >> 10} KiB" + (" (chosen)" if chunk == _packing.CHUNK_BYTES else "")]
        + [f"{columns[name][str(chunk)]:.0f}" for name in names]
        for chunk in chunks
    ]
    lines += table(["chunk bound", "1000 x 4 KiB us", "64 per-image dicts us"], rows)
    batch = workloads["1000 x 4 KiB"]()
    dk.to_device(batch, setting.device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        dk.to_device(batch, setting.device)
        setting.sync()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    profile = [line for line in out.getvalue().splitlines() if line.strip()][-14:]
    lines += ["Host profile, 20 calls on 1000 x 4 KiB (cProfile, tottime):", "", "```"]
    return [*lines, *profile, "```", ""]


# 4. Bulk bandwidth.


def _bandwidth_row(mib: int, setting: Setting) -> list[str]:
    nbytes = mib << 20
    host = torch.randn(nbytes // 4)
    pinned = setting.pin(host)
    device = setting.device
    # Device -> host needs data on a device: the smoke run reads from host memory.
    source = device if setting.gpu else torch.device("cpu")
    on_device = host.to(source)
    target = torch.empty_like(host, device=device)
    pinned_out = setting.pin(torch.empty_like(host))

    def to_host_non_blocking() -> None:
        on_device.to("cpu", non_blocking=True)
        setting.sync()

    moves: dict[str, Callable[[], Any]] = {
        "pinned copy_": lambda: target.copy_(pinned, non_blocking=True),
        "pinned devicekit": lambda: dk.to_device(pinned, device),
        "pageable .to()": lambda: host.to(device, non_blocking=True),
        "pageable devicekit": lambda: dk.to_device(host, device),
        "d->h .to('cpu')": lambda: on_device.to("cpu"),
        "d->h .to('cpu', non_blocking) + sync": to_host_non_blocking,
        "d->h copy_ to pinned": lambda: pinned_out.copy_(on_device),
        "d->h devicekit": lambda: dk.to_device(on_device, "cpu"),
    }
    medians = interleaved(moves, setting, budget_s=2 * setting.budget_s)
    return [f"{mib} MiB"] + [f"{nbytes / (medians[name] * 1e-6) / 1e9:.1f}" for name in moves]


def bandwidth(setting: Setting) -> list[str]:
    rows = [_bandwidth_row(mib, setting) for mib in ((4, 16) if setting.smoke else (64, 256))]
    header = [
        "size",
        "pinned copy_ GB/s",
        "pinned devicekit",
        "pageable .to()",
        "pageable devicekit",
        "d->h .to('cpu')",
        "d->h non_blocking + sync",
        "d->h copy_ to pinned (limit)",
        "d->h devicekit",
    ]
    return ["## Bandwidth", "", "GB/s, all contenders interleaved.", "", *table(header, rows)]


# 5. The loader's overlap and memory.


class _Compute:
    """A step of a given length on the device: a calibrated sleep kernel on a GPU."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.cycles_per_s = 0.0
        if setting.gpu:
            cycles = 1_000_000
            torch.cuda._sleep(cycles)
            setting.sync()
            start = time.perf_counter()
            for _ in range(10):
                torch.cuda._sleep(cycles)
            setting.sync()
            self.cycles_per_s = cycles * 10 / (time.perf_counter() - start)

    def __call__(self, seconds: float) -> None:
        if self.setting.gpu:
            torch.cuda._sleep(int(seconds * self.cycles_per_s))
        else:
            time.sleep(seconds)


def _per_step(run_epoch: Callable[[], int], setting: Setting) -> float:
    run_epoch()  # warm: pinned blocks, the side stream, the caching allocator
    setting.sync()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        steps = run_epoch()
        setting.sync()
        times.append((time.perf_counter() - start) / steps)
    return min(times)


class _Batches(Dataset[torch.Tensor]):
    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.batches[index]


def _host_rss_mib() -> float:
    try:
        with open("/proc/self/status") as status:  # Linux: the current RSS
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the peak, elsewhere


def overlap(setting: Setting) -> list[str]:
    count, mib = (6, 1) if setting.smoke else (24, 16)
    batches = [torch.randn((mib << 20) // 4) for _ in range(count)]
    compute = _Compute(setting)
    pinned_batches = [setting.pin(batch) for batch in batches]

    def copy_only() -> int:
        for batch in pinned_batches:
            batch.to(setting.device, non_blocking=True)
        return count

    def pin_only() -> int:
        for batch in batches:
            setting.pin(batch)
        return count

    copy_s = _per_step(copy_only, setting)
    pin_s = _per_step(pin_only, setting)
    pinned_batches.clear()  # the memory table below measures the loader's alone
    pinning = DataLoader(_Batches(batches), batch_size=None, pin_memory=setting.gpu)
    rows = []
    for factor in (1, 2):
        step_s = max(copy_s, pin_s) * factor

        def step(batch: torch.Tensor, step_s: float = step_s) -> None:
            compute(step_s)
            batch.add_(1.0)

        def by_hand(step: Callable[[torch.Tensor], None] = step) -> int:
            for batch in batches:
                step(batch.to(setting.device, non_blocking=True))
            return count

        def pinned_by_hand(step: Callable[[torch.Tensor], None] = step) -> int:
            for batch in pinning:
                step(batch.to(setting.device, non_blocking=True))
            return count

        def compute_only(step_s: float = step_s) -> int:
            for _ in batches:
                compute(step_s)
            return count

        compute_s = _per_step(compute_only, setting)
        bound = max(compute_s, copy_s, pin_s)
        cells = [
            f"{factor}x max(copy, pin)",
            f"{_per_step(by_hand, setting) / bound:.2f}",
            f"{_per_step(pinned_by_hand, setting) / bound:.2f}",
        ]
        for prefetch in (1, 2, 3, 4):
            loader = dk.DeviceDataLoader(batches, setting.device, prefetch=prefetch)

            def through(loader: Any = loader, step: Callable[[torch.Tensor], None] = step) -> int:
                for batch in loader:
                    step(batch)
                return count

            cells.append(f"{_per_step(through, setting) / bound:.2f}")
        rows.append(cells)
    lines = [
        "## Loader overlap",
        "",
        (
            f"{count} batches of {mib} MiB, pageable; per step copy {copy_s * 1e3:.3f} ms, pin "
            f"{pin_s * 1e3:.3f} ms. Figures: per-step time / max(compute, copy, pin). "
            "Targets (issue 48): <= 1.10 at prefetch >= 1; the input-bound loop (next "
            "section) >= 1.5x the images/s of a pinning DataLoader + non_blocking by hand; "
            "DeviceDataLoader's copies there >= 90% of copy_'s GB/s from pinned memory."
        ),
        "",
        *table(
            [
                "compute",
                "by hand, pageable",
                "by hand, pinning DataLoader",
                "prefetch 1",
                "prefetch 2",
                "prefetch 3",
                "prefetch 4",
            ],
            rows,
        ),
    ]
    return lines + _loader_memory(batches, setting)


def _loader_memory(batches: list[torch.Tensor], setting: Setting) -> list[str]:
    epochs = 3 if setting.smoke else 50
    rows = []
    for prefetch in (1, 2, 3, 4):
        loader = dk.DeviceDataLoader(batches, setting.device, prefetch=prefetch)
        if setting.gpu:
            torch.cuda.reset_peak_memory_stats(setting.device)
        pinned_mib, rss_mib, threads = [], [], []
        for _ in range(epochs):
            for batch in loader:
                batch.add_(1.0)
                threads.append(threading.active_count())
            setting.sync()
            rss_mib.append(_host_rss_mib())
            if setting.gpu:
                stats = torch.cuda.host_memory_stats()
                pinned_mib.append(stats.get("allocated_bytes.current", 0) / 2**20)
        peak = (
            f"{torch.cuda.max_memory_allocated(setting.device) / 2**20:.0f}"
            if setting.gpu
            else "n/a"
        )
        pinned = f"{min(pinned_mib):.0f}..{max(pinned_mib):.0f}" if pinned_mib else "n/a"
        rss = f"{min(rss_mib):.0f}..{max(rss_mib):.0f}"
        stats = loader.stats
        pool = f"{stats.pinned_bytes / 2**20:.0f} of {(stats.pinned_limit or 0) / 2**20:.0f}"
        rows.append([str(prefetch), peak, pinned, pool, rss, f"{min(threads)}..{max(threads)}"])
        loader.close()
    total_mib = sum(batch.nbytes for batch in batches) / 2**20
    return [
        f"Memory over {epochs} epochs (MiB; the batches are {total_mib:.0f} MiB of host memory):",
        "",
        *table(
            [
                "prefetch",
                "device peak",
                "PyTorch's pinned host",
                "loader's pool, of its cap",
                "host RSS",
                "threads",
            ],
            rows,
        ),
    ]


# 7. Real training loops.


class _Images(Dataset[tuple[torch.Tensor, int]]):
    """Images made once, in memory: the workers only index, as a cached dataset does."""

    def __init__(self, count: int, size: int, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(0)
        shape = (count, 3, size, size)
        if dtype is torch.uint8:
            self.images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        else:
            self.images = torch.rand(shape, generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], index % 10


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def _resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


WARM_STEPS = 5


def _train(
    model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], setting: Setting
) -> tuple[int, float]:
    """Train on every batch; the number timed and their seconds, after the warm-up steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    device_type = setting.device.type
    start, timed = 0.0, 0
    for step, (images, labels) in enumerate(batches):
        if step == WARM_STEPS:  # the pipeline is full, cudnn has chosen: the clock starts
            setting.sync()
            start = time.perf_counter()
        inputs = images.to(memory_format=torch.channels_last)
        if inputs.dtype is torch.uint8:
            inputs = inputs.float().div_(255)
        autocast = (
            torch.autocast(device_type, dtype=torch.bfloat16)
            if setting.gpu
            else contextlib.nullcontext()  # autocast refuses the smoke run's meta device
        )
        with autocast:
            loss = nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        timed += step >= WARM_STEPS
    setting.sync()
    return timed, time.perf_counter() - start


def _loader_alone(loader: DataLoader[Any]) -> tuple[int, float]:
    start, timed = 0.0, 0
    for step, _ in enumerate(loader):
        if step == WARM_STEPS:
            start = time.perf_counter()
        timed += step >= WARM_STEPS
    return timed, time.perf_counter() - start


def _image_loader(
    dataset: Dataset[Any], batch_size: int, workers: int, *, pin: bool
) -> DataLoader[Any]:
    """The report's loops' DataLoader: shuffled, drop_last, persistent workers."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=True,
    )


def training_loops(setting: Setting) -> list[str]:
    loops: dict[str, tuple[Callable[[], nn.Module], int, torch.dtype, int]] = {
        # name: (model, image size, dtype, batch size)
        "small CNN, 64 px float32, batch 512": (_small_cnn, 64, torch.float32, 512),
    }
    try:
        import torchvision  # noqa: F401 - present or not

        loops["ResNet-18, 224 px uint8, batch 256"] = (_resnet18, 224, torch.uint8, 256)
    except ImportError:
        pass
    timed_steps, workers, rounds = (3, 2, 1) if setting.smoke else (60, 6, 2)
    device = setting.device
    rows = []
    columns: list[str] = []
    verdicts: list[str] = []
    for name, (make_model, full_size, dtype, full_batch) in loops.items():
        size, batch_size = (16, 8) if setting.smoke else (full_size, full_batch)
        dataset = _Images((WARM_STEPS + timed_steps) * batch_size, size, dtype)

        plain, pinning = (
            _image_loader(dataset, batch_size, workers, pin=pin and setting.gpu)
            for pin in (False, True)
        )
        variants: dict[str, Callable[[], Iterator[Any]]] = {
            ".to(d), no pinning": lambda plain=plain: (
                (x.to(device), y.to(device)) for x, y in plain
            ),
            "pin_memory + non_blocking": lambda pinning=pinning: (
                (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                for x, y in pinning
            ),
        }
        # Kept, to read what each measured of its last epoch.
        wrapped = {
            "DeviceDataLoader": dk.DeviceDataLoader(plain, device),
            "DeviceDataLoader(pinning loader)": dk.DeviceDataLoader(pinning, device),
            "DeviceDataLoader(prefetch=0)": dk.DeviceDataLoader(plain, device, prefetch=0),
        }
        variants.update({key: (lambda w=w: iter(w)) for key, w in wrapped.items()})
        rates: dict[str, list[float]] = {variant: [] for variant in ["loader alone", *variants]}
        for _ in range(rounds):  # best of the rounds, variants interleaved
            timed, seconds = _loader_alone(plain)
            rates["loader alone"].append(timed * batch_size / seconds)
            for variant, batches in variants.items():
                torch.manual_seed(0)  # the same fresh model for every variant
                model = dk.to_device(make_model(), device).to(memory_format=torch.channels_last)
                timed, seconds = _train(model, batches(), setting)
                rates[variant].append(timed * batch_size / seconds)
        rows.append([name] + [f"{max(rate):,.0f}" for rate in rates.values()])
        columns = ["loop", *rates]
        for variant, measured in wrapped.items():
            stats = measured.stats
            copies = stats.copy_per_batch
            copy = f"{1e3 * sum(copies) / len(copies):.2f} ms" if copies else "not measured"
            steps = stats.step_per_batch
            step = f"{1e3 * sum(steps) / len(steps):.2f} ms" if steps else "-"
            verdicts.append(
                f"- {name}, {variant}: waited {stats.wait_fraction:.0%}; a copy {copy}, a "
                f"step {step} (host); verdict: {stats.verdict}"
            )
    lines = [
        "## Real training loops",
        "",
        (
            f"Images per second: images in memory, shuffled, drop_last, {workers} persistent "
            f"DataLoader workers, bf16 autocast, channels_last, {WARM_STEPS} warm-up steps "
            f"then {timed_steps} timed, a fresh seeded model per variant, best of {rounds}. "
            "'loader alone' iterates the DataLoader without a GPU: the most any variant can reach. "
            "These loops are compute-bound: DeviceDataLoader must not make them slower."
        ),
        "",
    ]
    measured = [
        "",
        "What DeviceDataLoader measured of each variant's last epoch (warm-up included):",
        "",
    ]
    return lines + table(columns, rows) + measured + verdicts


# 6. An input-bound loop: the copy is the step.


def _light_model() -> nn.Module:
    """A 1x1 convolution, pooling and a linear layer: next to nothing beside a large copy."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


class _Cycled(Dataset[tuple[torch.Tensor, int]]):
    """``length`` samples, read from fewer images in memory, round and round."""

    def __init__(self, images: _Images, length: int) -> None:
        self.images = images
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index % len(self.images)]


def input_bound(setting: Setting) -> list[str]:
    """Large images from a pageable in-memory dataset, a light model: the copy dominates.

    A batch of 256 images of 3x224x224 uint8 is 38.5 MB: on an H100 (GPU-COSTS.md) a pinned
    copy_ moves it in about 0.7 ms, a pageable copy in 2-2.3 ms, and a DataLoader's one
    pinning thread (about 7 GiB/s) pins it in about 5 ms, while the light model's step
    should take well under a millisecond. The samples are read round and round from 1,024
    distinct images, which take 154 MB to hold and well under a second to make.
    """
    size, batch_size, workers = (16, 8, 2) if setting.smoke else (224, 256, 6)
    timed_steps, rounds, cached = (3, 1, 16) if setting.smoke else (60, 3, 1024)
    device = setting.device
    dataset = _Cycled(_Images(cached, size, torch.uint8), (WARM_STEPS + timed_steps) * batch_size)

    plain, pinning = (
        _image_loader(dataset, batch_size, workers, pin=pin and setting.gpu)
        for pin in (False, True)
    )
    by_hand = "DataLoader(pin_memory=True) + .to(d, non_blocking=True)"
    variants: dict[str, Callable[[], Iterator[Any]]] = {
        by_hand: lambda: (
            (x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in pinning
        ),
        "DataLoader(pin_memory=False) + .to(d)": lambda: (
            (x.to(device), y.to(device)) for x, y in plain
        ),
    }
    wrapped = {
        f"DeviceDataLoader, prefetch {prefetch}": dk.DeviceDataLoader(
            plain, device, prefetch=prefetch
        )
        for prefetch in (1, 2)
    }
    variants.update({key: (lambda w=w: iter(w)) for key, w in wrapped.items()})
    rates: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(rounds):  # best of the rounds, variants interleaved
        for variant, batches in variants.items():
            torch.manual_seed(0)  # the same fresh model for every variant
            model = dk.to_device(_light_model(), device).to(memory_format=torch.channels_last)
            timed, seconds = _train(model, batches(), setting)
            rates[variant].append(timed * batch_size / seconds)
    best = {variant: max(rate) for variant, rate in rates.items()}
    rows = [
        [variant, f"{rate:,.0f}", f"{rate / best[by_hand]:.2f}x"] for variant, rate in best.items()
    ]
    # What one batch is on the device: the images and their labels (int64).
    nbytes = batch_size * (3 * size * size + 8)
    pinned = setting.pin(torch.empty(nbytes, dtype=torch.uint8))
    target = torch.empty_like(pinned, device=device)
    copy_us = interleaved({"copy_": lambda: target.copy_(pinned, non_blocking=True)}, setting)
    limit = nbytes / copy_us["copy_"] / 1e3
    copy_rows = [["copy_ from pinned memory (the limit)", f"{limit:.1f}", "100%"]]
    verdicts = []
    for variant, measured in wrapped.items():
        achieved = measured.stats.copy_gbps  # its copies' bytes over their time
        copy_rows.append(
            [variant, "not measured", "-"]
            if achieved is None
            else [variant, f"{achieved:.1f}", f"{achieved / limit:.0%} (target >= 90%)"]
        )
        verdicts.append(f"- {variant}: verdict: {measured.stats.verdict}")
    link = link_peak(device)
    said = (
        f"The link: {link}; copy_ reaches {limit / link.gb_per_s:.0%} of it."
        if link is not None
        else "The link's peak is not known here (no NVML reads this device's PCIe link)."
    )
    return [
        "## An input-bound loop",
        "",
        (
            f"Large images from a pageable in-memory dataset, a light model: {size} px uint8 "
            f"images, batch {batch_size} ({nbytes / 1e6:.3g} MB), {workers} persistent "
            "DataLoader workers, shuffled, drop_last, a 1x1 conv + pooling + linear, bf16 "
            f"autocast, {WARM_STEPS} warm-up steps then {timed_steps} timed, best of {rounds}, "
            "variants interleaved. Targets (issue 48): DeviceDataLoader >= 1.5x the images/s "
            "of the pinning DataLoader by hand; its copies >= 90% of copy_'s GB/s."
        ),
        "",
        *table(["variant", "images/s", "x by hand (pinning)"], rows),
        (
            "Host -> device GB/s: DeviceDataLoader's stats.copy_gbps (its last epoch's "
            "read-ahead batches, their bytes over their copies' time), against copy_ of as "
            "many bytes from pinned memory, each call synchronized."
        ),
        "",
        *table(["copy", "GB/s", "of copy_"], copy_rows),
        said,
        "",
        *verdicts,
        "",
    ]


# The report.


def compiled(setting: Setting) -> list[str]:
    """to_device inside torch.compile (inductor on a GPU): one compile for fresh batches."""
    backend = "inductor" if setting.gpu else "eager"  # the smoke run has no compiler to spare
    graphs: list[int] = []

    def counting(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        graphs.append(1)
        if not setting.gpu:
            return graph.forward
        from torch._inductor.compile_fx import compile_fx  # GPU runs only: imported there

        return compile_fx(graph, inputs)

    device = setting.device

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        moved = dk.to_device(batch, device, dtype=torch.float16)
        return (moved["x"] * 2).sum() + moved["y"].float().sum()

    rows = []
    for options in ({}, {"copy": True}):
        graphs.clear()
        torch._dynamo.reset()
        compiled_step = torch.compile(
            lambda b, o=options: step(b) if not o else dk.to_device(b, device, **o)["x"].sum(),
            fullgraph=True,
            backend=counting,
        )
        start = time.perf_counter()
        for _ in range(12):  # fresh batches, as a DataLoader makes them
            batch = {"x": torch.randn(64, 128), "y": torch.randint(0, 10, (64,))}
            compiled_step(batch)
        setting.sync()
        seconds = time.perf_counter() - start
        rows.append([repr(options) or "{}", str(len(graphs)), f"{seconds:.2f}"])
    return [
        f"## Inside torch.compile ({backend}, fullgraph=True, 12 fresh batches)",
        "",
        *table(["options", "compilations", "seconds"], rows),
        "",
    ]


FIT_MEMORY_GIB = 4.0  # what the fit section lets its process use of the GPU
FIT_STEPS = 200


def _exact_largest(found: dk.BatchFit, fits: Callable[[int], bool]) -> tuple[int, int]:
    """The largest size that fits, bisected to one sample between the search's bounds."""
    low = found.batch_size
    high = min((t.batch_size for t in found.tries if not t.fitted), default=low + 1)
    steps = 0
    while high - low > 1:
        middle = (low + high) // 2
        steps += 1
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, steps


def fit(setting: Setting) -> list[str]:
    """fit_batch under a memory limit: the size against the exact largest, then a run at it.

    On a GPU, ``set_per_process_memory_fraction`` gives the process FIT_MEMORY_GIB; a CNN
    on 64 px images is trained with SGD (no optimizer state: what is allocated after the
    search is what was before it, once a first step has made cuBLAS's workspaces). The
    exact largest size that fits is found by bisection to one sample from the search's
    own bounds (memory grows with the batch, so every smaller size fits too). The smoke
    run's step runs "out of memory" above 100.
    """
    device = setting.device
    torch.manual_seed(0)
    model = dk.to_device(_small_cnn(), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    side = 8 if setting.smoke else 64

    def step(batch_size: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        if setting.smoke and batch_size > 100:
            msg = "CUDA out of memory (the smoke run's stand-in)"
            raise torch.OutOfMemoryError(msg)
        images = torch.randn(batch_size, 3, side, side, device=device)
        labels = torch.randint(0, 10, (batch_size,), device=device)
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    def fits(batch_size: int) -> bool:
        try:
            step(batch_size)
        except torch.OutOfMemoryError:
            fitted = False
        else:
            fitted = True
        optimizer.zero_grad(set_to_none=True)
        if setting.gpu:
            torch.cuda.empty_cache()
        return fitted

    if setting.gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(FIT_MEMORY_GIB * 2**30 / total, device)
    try:
        # One step first: the first matrix product allocates cuBLAS's workspaces (about 64
        # MiB on an H100, through the caching allocator, kept for the process), which
        # would otherwise count as left behind by the search (+65 MiB on 2026-11-26).
        fits(8)
        setting.sync()
        before = torch.cuda.memory_allocated(device) if setting.gpu else 0
        start = time.perf_counter()
        found = dk.fit_batch(step, start=8, limit=1 << 16, device=device)
        setting.sync()
        search_s = time.perf_counter() - start
        after = torch.cuda.memory_allocated(device) if setting.gpu else 0
        low, exact_tries = _exact_largest(found, fits)
        steps = 20 if setting.smoke else FIT_STEPS
        run_ok = all(fits(found.batch_size) for _ in range(steps))
    finally:
        if setting.gpu:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    rows = [
        ["size found", str(found.batch_size)],
        ["exact largest (bisection)", f"{low} ({exact_tries} more steps)"],
        ["found / exact", f"{found.batch_size / low:.1%} (target >= 90%)"],
        ["tries, seconds", f"{len(found.tries)}, {search_s:.1f} s"],
        [f"{steps} steps at the size found", "no out of memory" if run_ok else "OUT OF MEMORY"],
        [
            "memory_allocated after - before",
            f"{(after - before) / 2**20:+.2f} MiB (target within 1)",
        ],
    ]
    limit = "the stand-in's 100" if setting.smoke else f"{FIT_MEMORY_GIB:g} GiB"
    return [
        f"## fit_batch ({limit}, a CNN on {side} px images, SGD)",
        "",
        *table(["what", "figure"], rows),
        "",
        "```",
        found.explain(),
        "```",
        "",
    ]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _command_output(command: list[str]) -> str:
    try:
        return subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:  # Linux names the model there
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _devices_seen() -> list[str]:
    """What a manager sees of this machine: each GPU's memory, utilization and processes."""
    with warnings.catch_warnings():  # a smoke run's CPU fallback is no news
        warnings.simplefilter("ignore", RuntimeWarning)
        return dk.DeviceManager().explain().splitlines()


def header(setting: Setting) -> list[str]:
    gpu = torch.cuda.get_device_name(setting.device) if setting.gpu else "none (smoke run)"
    driver = "n/a"
    if setting.gpu:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = (_command_output(query).split() or ["unknown"])[0]
    root = Path(__file__).parent.parent
    commit = _command_output(["git", "-C", str(root), "rev-parse", "HEAD"])
    dirty = _command_output(["git", "-C", str(root), "status", "--porcelain", "--untracked=no"])
    peers = ", ".join(
        f"{name} {_version(name)}"
        for name in ("accelerate", "lightning-fabric", "lightning", "torchvision")
    )
    return [
        "# devicekit GPU report",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit}{'' if dirty in ('', 'unknown') else ' (with uncommitted changes)'}",
        f"- GPU: {gpu}; driver {driver}; CUDA {torch.version.cuda}",
        (
            f"- PyTorch {torch.__version__}; Python {platform.python_version()}; "
            f"devicekit {dk.__version__}"
        ),
        f"- peers: {peers}",
        f"- host: {_cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads",
        "",
        "```",
        *_devices_seen(),
        "```",
        "",
    ]


def _materialize_once(
    how: Callable[[nn.Module, torch.device], None], sharded: bool, setting: Setting
) -> tuple[float, float | None]:
    """Seconds and peak MiB of one way of giving a fresh meta model storage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    blocks, width = (4, 16) if setting.smoke else (500, 1024)
    device = torch.device("cpu") if setting.smoke else setting.device  # the smoke's is meta
    model = meta_model(blocks, width)
    if sharded:
        mesh = init_device_mesh(device.type, (1,))
        for layer in model:  # each Linear a unit (each LayerNorm rides with the root's)
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    setting.sync()
    if setting.gpu:
        torch.cuda.reset_peak_memory_stats(setting.device)
    with warnings.catch_warnings():
        # The smoke run's CPU mesh: DTensor warns that its random ops are not coordinated.
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
        start = time.perf_counter()
        how(model, device)
        setting.sync()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(setting.device) / 2**20 if setting.gpu else None
    del model
    if setting.gpu:
        torch.cuda.empty_cache()
    return seconds, peak


def meta_models(setting: Setting) -> list[str]:
    """dk.materialize against to_empty + reset_parameters, plain and under FSDP2 on one rank.

    The model: 1,000 modules (Linear and LayerNorm pairs, 1024 wide: 2 GiB of float32),
    built on meta anew for each timing. The sharded rows call fully_shard on each Linear
    and the root over a one-rank mesh (a process group of one), as torchtitan's flow does
    with its blocks. Three rounds each, medians.
    """
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        backend = "nccl" if setting.gpu else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for sharded in (False, True):
            hand, ours, hand_peak, ours_peak = [], [], [], []
            for _ in range(1 if setting.smoke else 3):
                seconds, peak = _materialize_once(by_hand, sharded, setting)
                hand.append(seconds)
                hand_peak.append(peak)
                seconds, peak = _materialize_once(dk.materialize, sharded, setting)
                ours.append(seconds)
                ours_peak.append(peak)
            hand_ms, ours_ms = statistics.median(hand) * 1e3, statistics.median(ours) * 1e3
            peaks = (
                "-"
                if hand_peak[0] is None or ours_peak[0] is None
                else f"{max(hand_peak):.0f} / {max(ours_peak):.0f}"  # type: ignore[type-var]
            )
            rows.append(
                [
                    "FSDP2, one-rank mesh" if sharded else "plain",
                    f"{hand_ms:.1f}",
                    f"{ours_ms:.1f}",
                    f"{ours_ms / hand_ms:.2f}x (target <= 1.2x)",
                    peaks,
                ]
            )
    finally:
        if started:
            dist.destroy_process_group()
    header = ["model", "by hand ms", "materialize ms", "ratio", "peak MiB (hand / ours)"]
    return ["## materialize (1,000 modules built on meta)", "", *table(header, rows), ""]


SECTIONS: dict[str, Callable[[Setting], list[str]]] = {
    "tests": cuda_tests,
    "transfers": transfers,
    "packing": packing,
    "bandwidth": bandwidth,
    "overlap": overlap,
    "input": input_bound,
    "loops": training_loops,
    "compiled": compiled,
    "fit": fit,
    "materialize": meta_models,
}


class SectionTimeout(Exception):  # noqa: N818 - what it reports is a time limit
    """Raised in the main thread when a section runs past its budget."""


@contextlib.contextmanager
def watchdog(seconds: float, *, hard: bool) -> Iterator[None]:
    """Raise SectionTimeout after ``seconds``; with ``hard``, end the process later still.

    A hang inside a C call that holds the interpreter is not interrupted by the signal:
    ``hard`` then dumps every thread's stack and exits 30 s later, after the sections
    before have been written.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: object) -> None:
        msg = f"the section ran past its {seconds:g} s budget"
        raise SectionTimeout(msg)

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    if hard:
        faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if hard:
            faulthandler.cancel_dump_traceback_later()


def run_section(name: str, setting: Setting) -> list[str]:
    """One section's lines, or what stopped it; never raises but for Ctrl-C."""
    start = time.perf_counter()
    budget = BUDGET_S[name] * (0.5 if setting.smoke else 1)
    try:
        with watchdog(budget, hard=not setting.smoke):
            lines = SECTIONS[name](setting)
    except Exception as error:  # reported in its place; the others still run
        trace = traceback.format_exception(error)[-12:]
        lines = [f"## {name}: FAILED", "", "```", *"".join(trace).splitlines(), "```", ""]
    return [*lines, f"({name}: {time.perf_counter() - start:.0f} s)", ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, the accelerator path on the CPU: for CI"
    )
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run these sections only")
    args = parser.parse_args(argv)
    context: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if args.smoke:
        setting = Setting(torch.device("meta"), smoke=True, rounds=2, budget_s=0.005)
        context = accelerator_on_the_cpu()
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        setting = Setting(device, smoke=False, rounds=15, budget_s=0.25)
    else:
        parser.error("no CUDA GPU is visible; --smoke runs the script on the CPU")

    def emit(lines: list[str]) -> None:  # as each section ends: a later hang loses nothing
        print("\n".join(lines), flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write("\n".join(lines) + "\n")

    if args.out:
        args.out.write_text("")
    emit(header(setting))
    with context:
        for name in SECTIONS:
            if not args.only or name in args.only:
                emit(run_section(name, setting))


if __name__ == "__main__":
    main()
