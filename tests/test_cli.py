"""The command line, run as users run it."""

from __future__ import annotations

import subprocess
import sys

import devicekit


def test_python_dash_m_devicekit_reports_version_and_device() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit"], capture_output=True, text=True, check=True
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"devicekit {devicekit.__version__} (PyTorch ")
    assert lines[1].startswith("default device: ")
    assert lines[2].endswith("cpu, meta")


def test_version_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devicekit", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == devicekit.__version__
