"""Every GPU figure in one command: tests, transfers against peers, bandwidth, the loader.

Run on a machine with one CUDA GPU, from the repository root::

    PYTHONPATH=. python benchmarks/gpu_report.py --out gpu-report.md

It takes about five minutes and writes a markdown report (printed too) with the date,
GPU, driver, PyTorch and peer versions, then:

1. the cuda-marked tests (``pytest -m cuda``), each in a fresh interpreter's run;
2. host->device transfers, each call followed by a synchronize, rounds interleaved:
   ``.to(d)`` and ``.to(d, non_blocking=True)`` per tensor, accelerate's
   ``send_to_device``, Lightning's ``move_data_to_device`` and devicekit, on the
   workloads of the targets, pageable and pinned;
3. packing: the chunk size swept, and a profile of the host work of one call;
4. bulk bandwidth, host->device and device->host, against ``copy_``;
5. the loader's overlap: per step against max(compute, copy, pin), for prefetch 1-4,
   with compute equal to the copy time and twice it, and memory over many epochs;
6. two real training loops (a torchvision ResNet-18 on 224 px uint8 images and a small
   CNN on 64 px float images, DataLoader with 6 workers, bf16 autocast, channels_last):
   images per second by hand and through DeviceDataLoader.

``--smoke`` runs every section on the CPU with tiny sizes and no subprocesses: what CI
runs, so the script cannot rot where no GPU is at hand. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import importlib.metadata
import io
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))
from bench_to_device import mixed_batch, per_tensor_loop

import devicekit as dk
from devicekit import _packing
from devicekit._bench import per_image_batch

Mover = Callable[[Any, torch.device], Any]


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
        return tensor.pin_memory() if self.gpu else tensor


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
    for label, (environment, paths) in runs.items():
        result = subprocess.run(
            [*pytest, *paths],
            capture_output=True,
            text=True,
            check=False,
            timeout=240,
            env={**os.environ, **environment},
        )
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


def _pinned(batch: Any, setting: Setting) -> Any:
    return dk.to_device(batch, "cpu") if not setting.gpu else _pin_all(batch)


def _pin_all(batch: Any) -> Any:
    from devicekit._tree import map_leaves

    return map_leaves(lambda x, _: x.pin_memory() if isinstance(x, torch.Tensor) else x, batch)


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
            batch = make() if memory == "pageable" else _pinned(make(), setting)
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


def packing(setting: Setting) -> list[str]:
    lines = ["## Packing", ""]
    if not setting.gpu:
        lines += ["(smoke: the sweep runs to the CPU, where nothing packs)", ""]
    workloads = transfer_workloads(setting)
    chosen = _packing.CHUNK_BYTES
    rows = []
    for chunk in (64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20):
        _packing.CHUNK_BYTES = chunk  # type: ignore[misc] - the sweep sets the bound
        cells = [f"{chunk >> 10} KiB" + (" (chosen)" if chunk == chosen else "")]
        for name in ("1000 x 4 KiB", "64 per-image dicts of 3 small tensors"):
            batch = workloads[name]()
            medians = interleaved(
                {"devicekit": functools.partial(dk.to_device, batch, setting.device)}, setting
            )
            cells.append(f"{medians['devicekit']:.0f}")
        rows.append(cells)
    _packing.CHUNK_BYTES = chosen  # type: ignore[misc]
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


def _gbps(nbytes: int, fn: Callable[[], Any], setting: Setting) -> float:
    medians = interleaved({"x": fn}, setting, budget_s=2 * setting.budget_s)
    return nbytes / (medians["x"] * 1e-6) / 1e9


def _bandwidth_row(mib: int, setting: Setting) -> list[str]:
    nbytes = mib << 20
    host = torch.randn(nbytes // 4)
    pinned = setting.pin(host)
    on_device = host.to(setting.device)
    target = torch.empty_like(host, device=setting.device)
    device = setting.device
    moves: list[Callable[[], Any]] = [
        lambda: target.copy_(pinned, non_blocking=True),
        lambda: dk.to_device(pinned, device),
        lambda: host.to(device, non_blocking=True),
        lambda: dk.to_device(host, device),
        lambda: on_device.to("cpu"),
        lambda: dk.to_device(on_device, "cpu"),
    ]
    return [f"{mib} MiB"] + [f"{_gbps(nbytes, move, setting):.1f}" for move in moves]


def bandwidth(setting: Setting) -> list[str]:
    rows = [_bandwidth_row(mib, setting) for mib in ((4, 64) if setting.smoke else (64, 256))]
    header = [
        "size",
        "pinned copy_ GB/s",
        "pinned devicekit",
        "pageable .to()",
        "pageable devicekit",
        "d->h .to('cpu')",
        "d->h devicekit",
    ]
    return ["## Bandwidth", "", *table(header, rows)]


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
    times = []
    for _ in range(3):
        start = time.perf_counter()
        steps = run_epoch()
        setting.sync()
        times.append((time.perf_counter() - start) / steps)
    return min(times)


def overlap(setting: Setting) -> list[str]:
    count, mib = (6, 1) if setting.smoke else (24, 16)
    batches = [torch.randn((mib << 20) // 4) for _ in range(count)]
    compute = _Compute(setting)

    def copy_only() -> int:
        for batch in pinned_batches:
            batch.to(setting.device, non_blocking=True)
        return count

    def pin_only() -> int:
        for batch in batches:
            setting.pin(batch)
        return count

    pinned_batches = [setting.pin(batch) for batch in batches]
    copy_s = _per_step(copy_only, setting)
    pin_s = _per_step(pin_only, setting)
    rows = []
    for factor in (1, 2):
        step_s = copy_s * factor

        def step(batch: torch.Tensor, step_s: float = step_s) -> None:
            compute(step_s)
            batch.add_(1.0)

        def by_hand(step: Callable[[torch.Tensor], None] = step) -> int:
            for batch in batches:
                step(batch.to(setting.device, non_blocking=True))
            return count

        def compute_only(step_s: float = step_s) -> int:
            for _ in batches:
                compute(step_s)
            return count

        compute_s = _per_step(compute_only, setting)
        bound = max(compute_s, copy_s, pin_s)
        cells = [f"{factor}x copy", f"{_per_step(by_hand, setting) / bound:.2f}"]
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
            f"{pin_s * 1e3:.3f} ms. Figures: per-step time / max(compute, copy, pin); target "
            "<= 1.10."
        ),
        "",
        *table(
            ["compute", "by hand", "prefetch 1", "prefetch 2", "prefetch 3", "prefetch 4"], rows
        ),
    ]
    epochs = 3 if setting.smoke else 50
    memory_rows = []
    for prefetch in (1, 2, 3, 4):
        loader = dk.DeviceDataLoader(batches, setting.device, prefetch=prefetch)
        device_mib, pinned_mib = [], []
        for _ in range(epochs):
            for batch in loader:
                batch.add_(1.0)
            setting.sync()
            if setting.gpu:
                device_mib.append(torch.cuda.memory_allocated(setting.device) / 2**20)
                host_stats = getattr(torch.cuda, "host_memory_stats", dict)  # PyTorch >= 2.5
                stats = host_stats()
                pinned_mib.append(stats.get("allocated_bytes.current", 0) / 2**20)
        spread = (
            f"{min(device_mib):.0f}..{max(device_mib):.0f}" if device_mib else "n/a",
            f"{min(pinned_mib):.0f}..{max(pinned_mib):.0f}" if pinned_mib else "n/a",
        )
        memory_rows.append([str(prefetch), *spread])
    lines += [f"Memory after each of {epochs} epochs (MiB):", ""]
    return lines + table(["prefetch", "device", "pinned host"], memory_rows)


# 6. Real training loops.


class _Images(Dataset[tuple[torch.Tensor, int]]):
    """Synthetic images, made in the workers as a decoding dataset would."""

    def __init__(self, count: int, size: int, dtype: torch.dtype) -> None:
        self.count, self.size, self.dtype = count, size, dtype

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        if self.dtype is torch.uint8:
            image = torch.randint(
                0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=generator
            )
        else:
            image = torch.rand(3, self.size, self.size, generator=generator)
        return image, index % 10


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


def _train(
    model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], setting: Setting
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    device_type = setting.device.type
    for images, labels in batches:
        inputs = images.to(memory_format=torch.channels_last)
        if inputs.dtype is torch.uint8:
            inputs = inputs.float().div_(255)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=setting.gpu):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


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
    steps, workers = (3, 0) if setting.smoke else (60, 6)
    rows = []
    for name, (make_model, full_size, dtype, full_batch) in loops.items():
        size, batch_size = (16, 8) if setting.smoke else (full_size, full_batch)
        dataset = _Images(steps * batch_size, size, dtype)

        def loader(
            pin: bool, dataset: _Images = dataset, batch_size: int = batch_size
        ) -> DataLoader[Any]:
            return DataLoader(
                dataset,
                batch_size=batch_size,
                num_workers=workers,
                pin_memory=pin and setting.gpu,
                persistent_workers=workers > 0,
            )

        plain, pinning = loader(pin=False), loader(pin=True)
        variants: dict[str, Callable[[], Iterator[Any]]] = {
            ".to(d), no pinning": lambda plain=plain: (
                (x.to(setting.device), y.to(setting.device)) for x, y in plain
            ),
            "pin_memory + non_blocking": lambda pinning=pinning: (
                (x.to(setting.device, non_blocking=True), y.to(setting.device, non_blocking=True))
                for x, y in pinning
            ),
            "DeviceDataLoader": lambda plain=plain: iter(
                dk.DeviceDataLoader(plain, setting.device)
            ),
            "DeviceDataLoader(pinning loader)": lambda pinning=pinning: iter(
                dk.DeviceDataLoader(pinning, setting.device)
            ),
            "DeviceDataLoader(prefetch=0)": lambda plain=plain: iter(
                dk.DeviceDataLoader(plain, setting.device, prefetch=0)
            ),
        }
        model = dk.to_device(make_model(), setting.device).to(memory_format=torch.channels_last)
        rates: dict[str, list[float]] = {variant: [] for variant in variants}
        for _ in range(1 if setting.smoke else 2):  # best of two rounds, interleaved
            for variant, batches in variants.items():
                _train(model, batches(), setting)  # warm: workers, cudnn, the allocator
                setting.sync()
                start = time.perf_counter()
                _train(model, batches(), setting)
                setting.sync()
                rates[variant].append(steps * batch_size / (time.perf_counter() - start))
        rows.append([name] + [f"{max(rate):,.0f}" for rate in rates.values()])
        columns = ["loop", *variants]
    lines = [
        "## Real training loops",
        "",
        (
            f"Images per second, {workers} DataLoader workers, bf16 autocast, channels_last, "
            "best of two rounds."
        ),
        "",
    ]
    return lines + table(columns, rows)


# The report.


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header(setting: Setting) -> list[str]:
    gpu = torch.cuda.get_device_name(setting.device) if setting.gpu else "none (smoke run)"
    driver = "n/a"
    if setting.gpu:
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],  # noqa: S607
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout.split()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = "unknown"
    peers = ", ".join(
        f"{name} {_version(name)}"
        for name in ("accelerate", "lightning-fabric", "lightning", "torchvision")
    )
    return [
        "# devicekit GPU report",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {gpu}; driver {driver}; CUDA {torch.version.cuda}",
        (
            f"- PyTorch {torch.__version__}; Python {platform.python_version()}; "
            f"devicekit {dk.__version__}"
        ),
        f"- peers: {peers}",
        (
            f"- host: {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} intra-op threads"
        ),
        "",
    ]


SECTIONS: dict[str, Callable[[Setting], list[str]]] = {
    "tests": cuda_tests,
    "transfers": transfers,
    "packing": packing,
    "bandwidth": bandwidth,
    "overlap": overlap,
    "loops": training_loops,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: for CI")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run these sections only")
    args = parser.parse_args(argv)
    if args.smoke:
        setting = Setting(torch.device("cpu"), smoke=True, rounds=2, budget_s=0.005)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        setting = Setting(device, smoke=False, rounds=15, budget_s=0.25)
    else:
        parser.error("no CUDA GPU is visible; --smoke runs the script on the CPU")
    report = header(setting)
    print("\n".join(report), flush=True)
    for name, section in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        lines = [*section(setting), f"({name}: {time.perf_counter() - start:.0f} s)", ""]
        print("\n".join(lines), flush=True)
        report += lines
    if args.out:
        args.out.write_text("\n".join(report))


if __name__ == "__main__":
    main()
