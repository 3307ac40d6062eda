"""The wheel holds what the installed command needs.

A wheel that lacks ``_devicekit_cli.py`` installs a ``devicekit`` command that fails on
its first line, while every other test passes: they import the clone. Built here in a
few seconds, offline, with the hatchling the test extra installs; ``nox -s build``
builds the sdist too, checks it with twine and runs the installed command.
"""

from __future__ import annotations

import subprocess
import zipfile
from collections.abc import Iterator
from email.parser import HeaderParser
from pathlib import Path

import pytest

import devicekit

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory, fresh_python: str) -> Iterator[zipfile.ZipFile]:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: it would download hatchling into a fresh environment each run.
    command = [fresh_python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*command, "--quiet", "--wheel-dir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}\n{result.stderr}"
    (built,) = out.glob("devicekit-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [path for path in wheel.namelist() if path.endswith(f".dist-info/{name}")]
    return wheel.read(path).decode()


@pytest.mark.parametrize(
    "path", ["_devicekit_cli.py", "devicekit/__init__.py", "devicekit/cli.py", "devicekit/py.typed"]
)
def test_the_wheel_holds(wheel: zipfile.ZipFile, path: str) -> None:
    # _devicekit_cli.py beside the package, not in it: pyproject's only-include names both.
    assert path in wheel.namelist()


def test_the_wheel_installs_the_command(wheel: zipfile.ZipFile) -> None:
    entry_points = _dist_info(wheel, "entry_points.txt").splitlines()
    assert "devicekit = _devicekit_cli:main" in entry_points


def test_the_wheel_has_the_packages_version(wheel: zipfile.ZipFile) -> None:
    metadata = HeaderParser().parsestr(_dist_info(wheel, "METADATA"))
    assert metadata["Name"] == "devicekit"
    assert metadata["Version"] == devicekit.__version__
