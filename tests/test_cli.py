"""The command line, run as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import devicekit


def _run(*args: str, **environ: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit", *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **environ},
    )
    return result.stdout


def test_devicekit_alone_reports_versions_and_device() -> None:
    lines = _run(DEVICEKIT_DEVICE="cpu").splitlines()
    assert lines[0].startswith(f"devicekit {devicekit.__version__} (PyTorch ")
    assert lines[1] == "device: cpu (DEVICEKIT_DEVICE asks for it)"


def test_info_prints_a_table_the_selection_and_why() -> None:
    lines = _run("info", DEVICEKIT_DEVICE="cpu").splitlines()
    assert lines[0].split() == ["device", "backend", "name", "total", "free", "capability"]
    cpu_row = next(line for line in lines if line.split()[:3] == ["*", "cpu", "cpu"])
    assert cpu_row
    assert "selected: cpu (DEVICEKIT_DEVICE asks for it)" in lines


def test_info_json_is_machine_readable() -> None:
    report = json.loads(_run("info", "--json", DEVICEKIT_DEVICE="cpu"))
    assert report["selected"] == "cpu"
    assert report["reason"] == "DEVICEKIT_DEVICE asks for it"
    assert report["devicekit"] == devicekit.__version__
    cpu = next(device for device in report["devices"] if device["device"] == "cpu")
    assert set(cpu) == {
        "device",
        "backend",
        "index",
        "name",
        "total_memory",
        "free_memory",
        "capability",
        "uuid",
    }


def test_version_flag() -> None:
    assert _run("--version").strip() == devicekit.__version__
