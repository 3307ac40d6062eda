"""The command line, run as users run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import devicekit
from devicekit import cli


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


def _fails(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devicekit", *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **environ},
    )


@pytest.mark.parametrize(
    ("args", "environ", "says"),
    [
        (("demo", "--device", "cuda:7"), {}, "got 'cuda:7'"),
        (("info",), {"DEVICEKIT_DEVICE": "cuda:7"}, "DEVICEKIT_DEVICE='cuda:7' cannot be used"),
        (("info",), {"LOCAL_RANK": "x"}, "LOCAL_RANK (set by torchrun)"),
        (("demo", "--device", "meta"), {}, "meta tensors have none"),
    ],
)
def test_a_mistake_is_one_line_and_status_2(
    args: tuple[str, ...], environ: dict[str, str], says: str
) -> None:
    result = _fails(*args, **environ)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("devicekit: error: ")
    assert says in result.stderr


def test_debug_shows_the_traceback() -> None:
    by_flag = _fails("--debug", "demo", "--device", "cuda:7")
    by_environment = _fails("demo", "--device", "cuda:7", DEVICEKIT_DEBUG="1")
    for result in (by_flag, by_environment):
        assert result.returncode == 1
        assert "Traceback (most recent call last)" in result.stderr
        assert "DeviceUnavailableError" in result.stderr


def test_a_closed_pipe_ends_quietly() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "devicekit", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "DEVICEKIT_DEVICE": "cpu"},
    ) as process:
        assert process.stdout is not None
        process.stdout.close()  # the reader is gone before the first line is written
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141
    assert stderr == b""


def test_ctrl_c_says_how_far_the_demo_got() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "devicekit", "demo", "--epochs", "50", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(3)]
        assert lines[2].startswith("epoch 1/50"), lines  # an epoch is done
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130
    done = int(stderr.split("interrupted after ")[1].split(" epoch")[0])
    assert done >= 1
    assert "Traceback" not in stderr


# What a user trips on next: usage under the command, --debug after it, help that says
# what each command does, counts that read as English.


def test_an_unknown_option_is_refused_under_the_command_with_a_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--gpu"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: devicekit demo ")
    assert "unrecognized arguments: --gpu (to choose a GPU, pass --device cuda" in error


def test_debug_is_taken_after_the_command_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "x")
    assert cli.main(["info"]) == 2  # a mistake is one line...
    with pytest.raises(ValueError, match="Expected LOCAL_RANK"):  # ...or, debugging, raised
        cli.main(["info", "--debug"])


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_each_command_s_help_says_what_it_does(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    lines = capsys.readouterr().out.splitlines()
    description = lines[lines.index("") + 1]
    assert description.endswith(".")
    assert description[0].isupper()


def test_one_epoch_is_counted_in_the_singular(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--epochs", "1", "--device", "cpu"]) == 0
    assert "Trained 1 epoch on cpu" in capsys.readouterr().out
