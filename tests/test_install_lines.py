"""Every install line in the README and the documentation runs as written.

A line is a command in a console block: a ``$`` line of a page, any line of the README's
``console`` blocks. Each names ``torch==2.13.0`` before what depends on torch, and pip
resolves each, with ``--dry-run`` after ``install``, in a plain virtual environment on
this machine's package indexes.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
TORCH = "torch==2.13.0"

_README_CONSOLE = re.compile(r"```console\n(.*?)```", re.DOTALL)
_PROMPT = re.compile(r"^[ \t]+\$ (.*)$", re.MULTILINE)


def _lines() -> dict[str, str]:
    """Each distinct command line that runs ``pip install``, and where it is first found."""
    found: dict[str, str] = {}
    readme = ROOT / "README.md"
    for block in _README_CONSOLE.findall(readme.read_text(encoding="utf-8")):
        for line in block.splitlines():
            found.setdefault(line.strip(), "README.md")
    for page in sorted(DOCS.rglob("*.rst")):
        if "_build" in page.parts or "generated" in page.parts:
            continue
        for line in _PROMPT.findall(page.read_text(encoding="utf-8")):
            found.setdefault(line.strip(), str(page.relative_to(ROOT)))
    return {line: where for line, where in found.items() if "pip install" in line}


LINES = _lines()


def _installs(line: str) -> list[list[str]]:
    """The arguments after ``install`` of each ``pip install`` of a line, in order."""
    words = shlex.split(line, comments=True)
    commands: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            commands.append([])
        else:
            commands[-1].append(word)
    return [
        command[command.index("install") + 1 :]
        for command in commands
        if "pip" in command[:3] and "install" in command
    ]


def _installs_devicekit(argument: str) -> bool:
    # The clone itself: ".", ".[extra]", or "-e" before either.
    return argument in {"-e", "."} or argument.startswith(".[")


def test_the_lines_were_found() -> None:
    assert "README.md" in LINES.values()
    assert "docs/install.rst" in LINES.values()
    assert len(LINES) >= 5


def test_install_lines_splits_a_line_into_its_installs() -> None:
    line = 'python -m pip install torch==2.13.0 -e ".[test]" && python -m pytest  # tests'
    assert _installs(line) == [[TORCH, "-e", ".[test]"]]
    line = "python -m pip install torch==2.13.0 && python -m pip install -e . && devicekit demo"
    assert _installs(line) == [[TORCH], ["-e", "."]]


@pytest.mark.parametrize("line", LINES)
def test_a_line_names_the_torch_version_before_what_needs_torch(line: str) -> None:
    # A bare torch, or devicekit before torch, lets pip take the newest release, with
    # GBs of CUDA packages on Linux.
    arguments = [argument for install in _installs(line) for argument in install]
    assert arguments, line
    assert not re.search(r"<[^>]*>", line), f"{line} holds a placeholder"
    named = [argument for argument in arguments if re.match(r"torch\b", argument)]
    assert all(argument == TORCH for argument in named), line
    for position, argument in enumerate(arguments):
        if _installs_devicekit(argument):
            assert TORCH in arguments[:position], f"{line} installs devicekit before {TORCH}"


# What would make the plain environment see this one's packages, or pin what a line does not.
_NOT_PASSED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_CONSTRAINT")


def _dry_run(python: Path, install: list[str], pinned: bool, constraint: Path) -> str:
    """pip's answer to one install with ``--dry-run``, run from the clone as a reader would."""
    environment = {
        **{name: value for name, value in os.environ.items() if name not in _NOT_PASSED},
        "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        # An index this machine cannot reach fails at once instead of after retries.
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "5",
    }
    if pinned:
        # An earlier install of the same line named torch==2.13.0: a dry run installed
        # nothing, so the pin stands in for the torch that the earlier one leaves.
        environment["PIP_CONSTRAINT"] = str(constraint)
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", *install],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
        env=environment,
    )
    assert result.returncode == 0, f"pip install {shlex.join(install)}:\n{result.stderr[-3000:]}"
    return result.stdout


def test_every_install_line_resolves_as_written(fresh_python: str, tmp_path: Path) -> None:
    # A plain environment: with the system's site packages everything would be there.
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    constraint = tmp_path / "constraint.txt"
    constraint.write_text(f"{TORCH}\n", encoding="utf-8")
    runs = []
    for line in LINES:
        seen_torch = False
        for install in _installs(line):
            runs.append((install, seen_torch))
            seen_torch = seen_torch or TORCH in install
    distinct = list({shlex.join(install): (install, pinned) for install, pinned in runs}.values())
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda run: _dry_run(python, run[0], run[1], constraint), distinct))
    for (install, _), answer in zip(distinct, answers, strict=True):
        would = re.search(r"^Would install (.*)$", answer, re.MULTILINE)
        taken = would[1].split() if would else []
        torches = [package for package in taken if package.startswith("torch-")]
        assert all(package.startswith("torch-2.13.0") for package in torches), (install, taken)
