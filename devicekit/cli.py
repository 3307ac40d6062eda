"""The ``devicekit`` command line (also ``python -m devicekit``).

``devicekit`` alone prints the versions and the device devicekit would use;
``devicekit info`` lists every device found, the one selected and why;
``devicekit demo`` trains a small CNN through devicekit; ``devicekit bench`` measures
its transfers on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import devicekit
from devicekit._bench import report as bench_report
from devicekit._demo import train
from devicekit._manager import DeviceManager


def _manager(device: str | None = None) -> DeviceManager:
    # The fallback warning would repeat what the output itself says.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if device is not None:
            return DeviceManager(int(device) if device.isdigit() else device)
        return DeviceManager.from_env()


def _progress(epochs: int) -> Any:
    """A progress line rewritten in place, on terminals only (logs get the epoch lines)."""
    if not sys.stdout.isatty():
        return None
    width = 20

    def show(epoch: int, done: int, batches: int) -> None:
        filled = math.floor(width * done / batches)
        bar = "#" * filled + "-" * (width - filled)
        print(f"\repoch {epoch}/{epochs} [{bar}] {done}/{batches} batches", end="", flush=True)

    return show


def _demo(manager: DeviceManager, epochs: int, *, as_json: bool) -> int:
    if not as_json:
        print(f"devicekit {devicekit.__version__}: a small CNN on synthetic 16x16 images")
        print(f"device: {manager.device} ({manager.reason})")
    progress = None if as_json else _progress(epochs)
    reports = []
    # Over a progress line, the epoch's line goes back to the start and covers it.
    start, pad = ("\r", " " * 20) if progress is not None else ("", "")
    for report in train(manager.device, epochs=epochs, on_batch=progress):
        reports.append(report)
        if not as_json:
            print(
                f"{start}epoch {report.epoch}/{epochs}  loss {report.loss:.3f}  "
                f"{report.samples_per_second:,.0f} samples/s  {report.seconds:.1f} s{pad}"
            )
    first, last = reports[0], reports[-1]
    if as_json:
        summary = {
            "device": str(manager.device),
            "reason": manager.reason,
            "epochs": [dataclasses.asdict(report) for report in reports],
        }
        print(json.dumps(summary, indent=2))
    else:
        rate = sum(r.samples_per_second for r in reports) / len(reports)
        print(
            f"Trained {epochs} epoch(s) on {manager.device}: loss {first.loss:.3f} -> "
            f"{last.loss:.3f}, {rate:,.0f} samples/s."
        )
    return 0


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def _info_table(manager: DeviceManager) -> str:
    header = ("", "device", "backend", "name", "total", "free", "capability")
    rows = [header]
    for info in manager.devices:
        capability = "-" if info.capability is None else "{}.{}".format(*info.capability)
        rows.append(
            (
                "*" if info.device == manager.device else "",
                str(info.device),
                info.backend,
                info.name or "-",
                _gib(info.total_memory),
                _gib(info.free_memory),
                capability,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in rows
    ]
    lines.append("")
    lines.append(f"selected: {manager.device} ({manager.reason})")
    lines += [f"no {name}: {note}" for name, note in manager.notes().items()]
    return "\n".join(lines)


def _info_json(manager: DeviceManager) -> str:
    def record(info: devicekit.DeviceInfo) -> dict[str, Any]:
        fields = dataclasses.asdict(info)
        fields["device"] = str(info.device)
        return fields

    report = {
        "devicekit": devicekit.__version__,
        "torch": torch.__version__,
        "selected": str(manager.device),
        "reason": manager.reason,
        "devices": [record(info) for info in manager.devices],
        "notes": manager.notes(),
    }
    return json.dumps(report, indent=2)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    >>> main([])  # doctest: +ELLIPSIS
    devicekit ... (PyTorch ...)
    device: ...
    0

    Args:
        argv: The arguments after the program name; None reads them from the command line.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="devicekit", description="Device handling for PyTorch training loops."
    )
    parser.add_argument("--version", action="version", version=devicekit.__version__)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser("info", help="list the devices, the one selected, and why")
    info.add_argument("--json", action="store_true", help="print a JSON report instead")
    demo = commands.add_parser("demo", help="train a small CNN on synthetic data through devicekit")
    demo.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    demo.add_argument("--device", help="a device such as cuda:1 (default: devicekit's choice)")
    demo.add_argument("--json", action="store_true", help="print a JSON report at the end only")
    commands.add_parser("bench", help="measure devicekit's transfers on this machine")
    args = parser.parse_args(argv)
    if args.command == "bench":
        print("\n".join(bench_report()))
        return 0
    if args.command == "demo":
        if args.epochs < 1:
            parser.error(f"--epochs must be 1 or more, got {args.epochs}")
        return _demo(_manager(args.device), args.epochs, as_json=args.json)
    manager = _manager()
    if args.command == "info":
        print(_info_json(manager) if args.json else _info_table(manager))
        return 0
    print(f"devicekit {devicekit.__version__} (PyTorch {torch.__version__})")
    print(f"device: {manager.device} ({manager.reason})")
    return 0
