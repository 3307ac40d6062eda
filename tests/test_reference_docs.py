"""The reference pages keep up with the code: every option, exit status and variable."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest
import torch

import _devicekit_cli
from devicekit._select import _launch

ROOT = Path(__file__).resolve().parents[1]
CLI_PAGE = (ROOT / "docs" / "reference" / "cli.rst").read_text(encoding="utf-8")
ENVIRONMENT_PAGE = (ROOT / "docs" / "reference" / "environment.rst").read_text(encoding="utf-8")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse offers no public walk of its parsers: its actions are read directly.
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subparsers.choices)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def test_every_command_has_its_section() -> None:
    commands = _commands(_devicekit_cli.build_parser()[0])
    assert set(commands) == {"info", "demo", "bench", "doctor"}  # the walk found them
    for name in commands:
        assert re.search(rf"^``{name}``\n-+$", CLI_PAGE, re.MULTILINE), name


def test_every_option_of_every_command_is_described() -> None:
    parser = _devicekit_cli.build_parser()[0]
    wanted = {("devicekit", option) for option in _option_strings(parser)}
    wanted |= {
        (name, option)
        for name, command in _commands(parser).items()
        for option in _option_strings(command)
        if option not in ("-h", "--help")  # each command's help is described once, globally
    }
    assert ("demo", "--epochs") in wanted  # the walk reached the commands' own options
    missing = [pair for pair in sorted(wanted) if f"``{pair[1]}" not in CLI_PAGE]
    assert missing == []


@pytest.mark.parametrize("status", [0, 1, 2, 130])
def test_every_exit_status_is_in_the_table(status: int) -> None:
    assert re.search(rf"^   \* - {status}$", CLI_PAGE, re.MULTILINE)


@pytest.mark.parametrize(
    ("args", "environ"),
    [
        (("demo", "--device", "gpu"), {}),
        (("info",), {"LOCAL_RANK": "x"}),
        (("demo", "--device", "CPU"), {}),
        (("demo", "--device", "meta"), {}),
        pytest.param(
            ("demo", "--device", "cuda:7"),
            {},
            marks=pytest.mark.skipif(
                torch.version.cuda is not None, reason="the page shows a CPU-only build"
            ),
        ),
    ],
    ids=["unknown device", "bad LOCAL_RANK", "capitals", "meta", "no CUDA build"],
)
def test_the_error_lines_shown_are_the_ones_printed(
    args: tuple[str, ...],
    environ: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The command in this process; the usage error below runs as a process of its own.
    for name in ("DEVICEKIT_DEVICE", "LOCAL_RANK", "DEVICEKIT_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert _devicekit_cli.main(list(args)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"   {line}\n" in CLI_PAGE


def test_a_usage_error_shows_the_command_s_usage_as_the_page_does(fresh_python: str) -> None:
    result = subprocess.run(
        [fresh_python, "-m", "devicekit", "demo", "--epochs", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    *usage, error = result.stderr.splitlines()  # argparse wraps a long usage line
    assert usage[0].startswith("usage: devicekit demo ")
    assert "".join(f"   {line}\n" for line in [*usage, error]) in CLI_PAGE


def _variables_read() -> set[str]:
    """Every environment variable the package's source reads, found in the source."""
    modules = (ROOT / "devicekit").rglob("*.py")
    source = "\n".join(path.read_text(encoding="utf-8") for path in modules)
    read = set(re.findall(r"environ(?:\.get)?\(?\[?\s*\"([A-Z][A-Z0-9_]+)\"", source))
    read |= {name for names in _launch.VISIBILITY_VARIABLES.values() for name in names}
    read |= {name for launcher in _launch.LAUNCHERS for name in (launcher.rank, launcher.size)}
    return read


def test_every_variable_read_is_documented() -> None:
    read = _variables_read()
    assert {"DEVICEKIT_DEVICE", "DEVICEKIT_DEBUG", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"} <= read
    missing = sorted(name for name in read if f"``{name}``" not in ENVIRONMENT_PAGE)
    assert missing == []


def test_the_variables_table_lists_nothing_devicekit_does_not_read() -> None:
    table = ENVIRONMENT_PAGE.split("Where devicekit's default device comes from")[0]
    listed = set(re.findall(r"^   \* - ``([A-Z][A-Z0-9_]+)``", table, re.MULTILINE))
    listed |= set(re.findall(r"^   \* - ``[A-Z_]+``, ``([A-Z][A-Z0-9_]+)``", table, re.MULTILINE))
    assert "LOCAL_RANK" in listed  # the table was parsed
    assert listed <= _variables_read()
