"""The ``devicekit`` command line (also ``python -m devicekit``).

``devicekit`` alone prints the versions and the device devicekit would use;
``devicekit info`` lists every device found, the one selected and why (``--json``
for machines).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import devicekit
from devicekit._manager import DeviceManager


def _manager() -> DeviceManager:
    # The fallback warning would repeat what the output itself says.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return DeviceManager.from_env()


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
    args = parser.parse_args(argv)
    manager = _manager()
    if args.command == "info":
        print(_info_json(manager) if args.json else _info_table(manager))
        return 0
    print(f"devicekit {devicekit.__version__} (PyTorch {torch.__version__})")
    print(f"device: {manager.device} ({manager.reason})")
    return 0
