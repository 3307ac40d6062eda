"""The command line, run as users run it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import _devicekit_cli
import devicekit
import devicekit as dk
from devicekit import cli
from devicekit._base import LinkPeak
from devicekit._commands import _bench, _demo
from devicekit._commands._demo import Schedule, schedule_for
from devicekit._doctor import _report as _doctor_report
from devicekit._loader import _loader
from devicekit._select._backends import CpuBackend

from .fakes import FakeGpus


def _main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """The command run in this process (no second import of PyTorch): status, out, err.

    What only a process of its own shows (a closed stdout or pipe, a full disk, Ctrl-C,
    what is imported before PyTorch) is tested in one, started with ``fresh_python``.
    """
    monkeypatch.delenv("DEVICEKIT_DEBUG", raising=False)
    status = _devicekit_cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_devicekit_alone_reports_versions_and_device(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEVICEKIT_DEVICE", "cpu")
    lines = _main(monkeypatch, capsys)[1].splitlines()
    assert lines[0].startswith(f"devicekit {devicekit.__version__} (PyTorch ")
    assert lines[1] == "device: cpu (DEVICEKIT_DEVICE asks for it)"


def test_info_prints_a_table_the_selection_and_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEVICEKIT_DEVICE", "cpu")
    lines = _main(monkeypatch, capsys, "info")[1].splitlines()
    assert lines[0].split() == [
        "device", "backend", "name", "total", "free", "busy", "capability", "claimed", "by"
    ]  # fmt: skip
    assert any(line.split()[:3] == ["*", "cpu", "cpu"] for line in lines), lines  # selected
    assert "selected: cpu (DEVICEKIT_DEVICE asks for it)" in lines


def test_info_json_is_machine_readable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DEVICEKIT_DEVICE", "cpu")
    report = json.loads(_main(monkeypatch, capsys, "info", "--json")[1])
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
        "utilization",
        "processes",
    }
    assert report["claims"] == {}


@pytest.mark.parametrize(
    ("variable", "value", "launcher"),
    [
        ("LOCAL_RANK", "abc", "torchrun"),
        ("LOCAL_RANK", "-1", "torchrun"),
        ("SLURM_LOCALID", "1.5", "Slurm"),
    ],
)
def test_info_json_says_why_no_device_can_be_chosen(
    variable: str,
    value: str,
    launcher: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("DEVICEKIT_DEVICE", raising=False)
    monkeypatch.setenv(variable, value)
    message = (
        f"Expected {variable} (set by {launcher}) to be a whole number of 0 or more, got {value!r}."
    )
    status, out, err = _main(monkeypatch, capsys, "info", "--json")
    assert (status, err) == (2, f"devicekit: error: {message}\n")  # as plain info ends
    report = json.loads(out)
    assert (report["selected"], report["reason"], report["error"]) == (None, None, message)
    # The doctor's finding of it, in its words: one rule for both.
    _, doctor_out, _ = _main(monkeypatch, capsys, "doctor", "--json")
    (finding,) = report["findings"]
    assert finding in json.loads(doctor_out)["findings"]
    assert finding["what"] == f"{variable}={value!r} is no rank"
    # The devices, all the same: what is here does not depend on the rank.
    assert "cpu" in [device["device"] for device in report["devices"]]
    assert set(report) == {
        "devicekit", "torch", "selected", "reason", "error", "findings", "devices", "claims",
        "notes",
    }  # fmt: skip
    assert _main(monkeypatch, capsys, "info")[2] == f"devicekit: error: {message}\n"


def test_json_holds_a_byte_that_is_not_utf8_as_its_escape(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Python reads such a byte as a lone surrogate, "\udcff": JSON's escape of one is no
    # character, and strict parsers refuse it. The escape is written as text instead.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0\udcff")  # the bytes b"0\xff"
    out = _main(monkeypatch, capsys, "doctor", "--json")[1]
    report = json.loads(out)
    assert report["environment"]["variables"]["CUDA_VISIBLE_DEVICES"] == "0\\udcff"
    json.dumps(report, ensure_ascii=False).encode("utf-8")  # no surrogate left to refuse
    assert _main(monkeypatch, capsys, "doctor")[1].endswith(
        "  Variables: CUDA_VISIBLE_DEVICES=0\\udcff\n"
    )  # as on a terminal


def test_json_is_valid_utf8_whatever_bytes_the_environment_holds(fresh_python: str) -> None:
    environ = {key: value for key, value in os.environb.items() if key != b"DEVICEKIT_DEVICE"}
    environ |= {b"LOCAL_RANK": b"\x80", b"DEVICEKIT_CLAIM_DIR": b"/tmp/claims-\xff\xfe"}
    reports = {}
    for command, status in (("doctor", 1), ("info", 2)):
        result = subprocess.run(
            [fresh_python, "-m", "devicekit", command, "--json"],
            capture_output=True,
            env=environ,
            check=False,
            timeout=120,
        )
        assert result.returncode == status, result.stderr
        text = result.stdout.decode("utf-8")  # strict: a byte that is not UTF-8 fails here
        reports[command] = json.loads(text)
        json.dumps(reports[command], ensure_ascii=False).encode("utf-8")  # a surrogate here
    assert reports["info"]["error"] == (
        "Expected LOCAL_RANK (set by torchrun) to be a whole number of 0 or more, got '\\udc80'."
    )
    variables = reports["doctor"]["environment"]["variables"]
    assert (variables["LOCAL_RANK"], variables["DEVICEKIT_CLAIM_DIR"]) == (
        "\\udc80",
        "/tmp/claims-\\udcff\\udcfe",
    )


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _devicekit_cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == devicekit.__version__


@pytest.mark.parametrize(
    ("args", "environ", "says"),
    [
        (("demo", "--device", "cuda:7"), {}, "got 'cuda:7'"),
        (("info",), {"DEVICEKIT_DEVICE": "cuda:7"}, "DEVICEKIT_DEVICE='cuda:7' cannot be used"),
        (("info",), {"LOCAL_RANK": "x"}, "LOCAL_RANK (set by torchrun)"),
        (
            ("demo", "--device", "meta"),
            {},
            (
                "Expected a device with memory for the demo to train on, got meta: tensors on "
                "the meta device have shapes but no data. Choose cpu or an accelerator.\n"
            ),
        ),
        (
            ("demo", "--device", "cuda:9"),
            {},
            # Why, on this machine: no CUDA build, or too few GPUs.
            "got 'cuda:9': no cuda device is visible"
            if not torch.cuda.is_available()
            else "got 'cuda:9': this process sees",
        ),
        (("demo", "--device", "CPU"), {}, "got 'CPU' (did you mean 'cpu'?)."),
        # Python's own refusal of 4,301 digits was the message once; now devicekit's, cut.
        (("demo", "--device", "9" * 5000), {}, f"got '{'9' * 57}... (5,000 characters)."),
        (
            ("demo", "--device", "cuda:257"),  # PyTorch would read it as cuda:1
            {},
            (
                "Expected a device index PyTorch can keep, got 'cuda:257', which it would read "
                "as cuda:1."
            ),
        ),
    ],
)
def test_a_mistake_is_one_line_and_status_2(
    args: tuple[str, ...],
    environ: dict[str, str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # In this process; test_reference_docs runs a usage mistake as a process of its own.
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    status, out, err = _main(monkeypatch, capsys, *args)
    assert status == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("devicekit: error: ")
    assert says in err


def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    # The flag, or the environment variable, lets the error out of main, where Python
    # prints its traceback and ends with status 1.
    monkeypatch.delenv("DEVICEKIT_DEBUG", raising=False)
    with pytest.raises(devicekit.DeviceUnavailableError, match=re.escape("got 'cuda:7'")):
        _devicekit_cli.main(["--debug", "demo", "--device", "cuda:7"])
    monkeypatch.setenv("DEVICEKIT_DEBUG", "1")
    with pytest.raises(devicekit.DeviceUnavailableError, match=re.escape("got 'cuda:7'")):
        _devicekit_cli.main(["demo", "--device", "cuda:7"])


def test_a_closed_pipe_ends_quietly(fresh_python: str) -> None:
    with subprocess.Popen(
        [fresh_python, "-m", "devicekit", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "DEVICEKIT_DEVICE": "cpu"},
    ) as process:
        assert process.stdout is not None
        process.stdout.close()  # the reader is gone before the first line is written
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0  # as when the reader leaves after the last line
    assert stderr == b""


def test_a_reader_leaving_ends_with_status_0_whatever_the_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Gone:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            return sys.__stdout__.fileno() if sys.__stdout__ is not None else 1

    monkeypatch.setattr(cli, "_drop_output", lambda: None)  # the test's stdout stays
    monkeypatch.setattr(sys, "stdout", Gone())
    assert _devicekit_cli.main(["info"]) == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_output_that_cannot_be_written_is_one_line_and_status_1(fresh_python: str) -> None:
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [fresh_python, "-m", "devicekit", "info"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    assert result.returncode == 1
    assert result.stderr == "devicekit: error: cannot write the output: No space left on device.\n"


def test_a_closed_stdout_is_one_line_and_status_1(fresh_python: str) -> None:
    result = subprocess.run(
        [fresh_python, "-m", "devicekit", "info"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        preexec_fn=lambda: os.close(1),  # the child's stdout, before exec
    )
    assert result.returncode == 1
    assert result.stderr == "devicekit: error: cannot write the output: stdout is closed.\n"


def test_ctrl_c_while_pytorch_imports_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    class Interrupted:  # Ctrl-C lands while devicekit (and so PyTorch) is imported
        def find_spec(self, name: str, *args: object) -> None:
            if name == "devicekit.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "devicekit.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    monkeypatch.delattr(devicekit, "cli")
    assert _devicekit_cli.main([]) == 130


RUN_INFO = "sys.argv[1:] = ['info']; raise SystemExit(_devicekit_cli.main())"
RUN_DEMO = (  # python -m devicekit demo --epochs 1000 --steps 2 --device cpu: short epochs,
    # too many to end before Ctrl-C comes
    "sys.argv[1:] = ['demo', '--epochs', '1000', '--steps', '2', '--device', 'cpu']; "
    "runpy.run_module('devicekit', run_name='__main__')"
)


# Ctrl-C as from a terminal: a CI job run in the background (``&``) starts its children
# with SIGINT ignored, which Python then leaves ignored, so the signal would do nothing.
CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
SAY_UP = "print('up', flush=True); "


def test_ctrl_c_soon_after_start_has_no_traceback(fresh_python: str) -> None:
    with subprocess.Popen(
        [fresh_python, "-c", f"{CTRL_C}import _devicekit_cli, sys; {SAY_UP}{RUN_INFO}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        # A fixed sleep from the start flaked under load: the signal came before Python
        # had set its handler. "up" comes once it has, milliseconds before the guard that
        # PyTorch's import (a second or more of CPU) runs under.
        assert process.stdout is not None
        assert process.stdout.readline() == "up\n"
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    if stdout:  # a machine fast enough to finish first: nothing was interrupted
        pytest.skip("devicekit info finished within 0.2 s of Python being up")
    assert (process.returncode, stderr) == (130, "\ndevicekit: interrupted.\n")


def test_bench_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert _devicekit_cli.main(["bench", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["target"] for row in report["to_device"]] == [
        "cpu (nothing to move)",
        "meta (a real move)",
    ]
    for row in report["to_device"]:
        assert row["handwritten_us"] > 0
        assert row["to_device_us"] > 0
    assert (report["copies"] is None) == (not torch.cuda.is_available())
    assert report["seconds"] > 0


GEN5_X16 = LinkPeak(5, 16, 32 * 128 / 130 / 8 * 16)


def _bench_on(
    monkeypatch: pytest.MonkeyPatch, accelerators: list[str], link: LinkPeak | None
) -> list[torch.device]:
    """Run the bench on a machine with ``accelerators``, timing nothing: the devices measured."""
    measured: list[torch.device] = []

    def copies(device: torch.device) -> list[tuple[str, float, float, float]]:
        measured.append(device)
        return [("1000 x 4 KiB", 9000.0, 7000.0, 200.0), ("1 x 64 MiB", 5900.0, 1300.0, 1290.0)]

    def host_to_device(device: torch.device) -> tuple[float, float]:
        measured.append(device)
        return 52.06, 11.3

    monkeypatch.setattr(_bench, "available_devices", lambda: [*accelerators, "cpu", "meta"])
    monkeypatch.setattr(_bench, "_median_us", lambda fn, **_: 10.0)
    monkeypatch.setattr(_bench, "_copies", copies)
    monkeypatch.setattr(_bench, "_host_to_device", host_to_device)
    monkeypatch.setattr(_bench, "link_peak", lambda device: measured.append(device) or link)
    return measured


def test_bench_sets_a_large_copy_against_the_link(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = _bench_on(monkeypatch, ["cuda:0", "cuda:1"], GEN5_X16)
    status, out, _ = _main(monkeypatch, capsys, "bench")
    assert status == 0
    assert measured == [torch.device("cuda", 0)] * 3  # the first accelerator, link included
    expected = (
        "host -> cuda:0: 52.1 GB/s pinned, 11.3 GB/s pageable, "
        "of the link's 63 GB/s (PCIe gen5 x16)"
    )
    assert expected in out.splitlines()
    status, out, _ = _main(monkeypatch, capsys, "bench", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["copies"]["host_to_device"] == {
        "bytes": 64 << 20,
        "pinned_gb_per_s": 52.06,
        "pageable_gb_per_s": 11.3,
        "link": {"generation": 5, "width": 16, "gb_per_s": GEN5_X16.gb_per_s},
    }


def test_bench_says_where_the_link_is_unknown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _bench_on(monkeypatch, ["cuda:0"], None)  # no NVML, a ROCm or XPU device
    status, out, _ = _main(monkeypatch, capsys, "bench")
    assert status == 0
    assert (
        "host -> cuda:0: 52.1 GB/s pinned, 11.3 GB/s pageable (the link's peak is not known here)"
        in out.splitlines()
    )
    status, out, _ = _main(monkeypatch, capsys, "bench", "--json")
    assert json.loads(out)["copies"]["host_to_device"]["link"] is None


def test_bench_without_an_accelerator_copies_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = _bench_on(monkeypatch, [], GEN5_X16)
    status, out, _ = _main(monkeypatch, capsys, "bench")
    assert status == 0
    assert measured == []
    assert "No accelerator here: host -> device copies are not measured." in out.splitlines()
    assert "GB/s" not in out


def test_a_large_copy_s_rate_is_its_bytes_over_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    sources: list[bool] = []

    def copy_once(fn: Any, **_: object) -> float:
        fn()  # the copy runs, on the CPU here
        return 1000.0 if len(sources) == 1 else 4000.0

    real_copy = torch.Tensor.copy_

    def copy_(target: torch.Tensor, source: torch.Tensor, *, non_blocking: bool = False) -> Any:
        sources.append(non_blocking)
        return real_copy(target, source, non_blocking=non_blocking)

    # No accelerator to pin for: pinning stands in as a copy of its own.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: tensor.clone())
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(_bench, "_median_us", copy_once)
    pinned, pageable = _bench._host_to_device(torch.device("cpu"))
    assert sources == [True, True]
    assert (pinned, pageable) == pytest.approx(((64 << 20) / 1e9 / 1e-3, (64 << 20) / 1e9 / 4e-3))


def test_ctrl_c_says_how_far_the_demo_got(fresh_python: str) -> None:
    with subprocess.Popen(
        [fresh_python, "-c", f"{CTRL_C}import sys, runpy; {RUN_DEMO}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(3)]
        assert lines[2].startswith("epoch 1/1000"), lines  # an epoch is done
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, (stdout[-1500:], stderr[-3000:])
    done = int(stderr.split("interrupted after ")[1].split(" epoch")[0])
    assert done >= 1
    assert "Traceback" not in stderr


# What a user trips on next: usage under the command, --debug after it, help that says
# what each command does, counts that read as English.


def test_an_unknown_option_is_refused_under_the_command_with_a_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _devicekit_cli.main(["demo", "--gpu"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: devicekit demo ")
    assert "unrecognized arguments: --gpu (to choose a GPU, pass --device cuda" in error


def test_debug_is_taken_after_the_command_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "x")
    assert _devicekit_cli.main(["info"]) == 2  # a mistake is one line...
    with pytest.raises(ValueError, match="Expected LOCAL_RANK"):  # ...or, debugging, raised
        _devicekit_cli.main(["info", "--debug"])


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_each_command_s_help_says_what_it_does(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _devicekit_cli.main([command, "--help"])
    lines = capsys.readouterr().out.splitlines()
    description = lines[lines.index("") + 1]
    assert description.endswith(".")
    assert description[0].isupper()


def test_one_epoch_is_counted_in_the_singular(capsys: pytest.CaptureFixture[str]) -> None:
    assert _devicekit_cli.main(["demo", "--epochs", "1", "--steps", "2", "--device", "cpu"]) == 0
    assert "Trained 1 epoch on cpu" in capsys.readouterr().out


def test_the_demo_says_whether_it_waited_for_data(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --slow-data's pauses are all the loader's clock sees pass, however busy the machine:
    # the loop waits for data the whole epoch, by that clock (steps take none of its time).
    now = [0.0]

    def pause(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(_loader, "_clock", lambda: now[0])
    monkeypatch.setattr(_demo, "_sleep", pause)
    monkeypatch.setattr(_loader, "machine_cpus", lambda: 16)
    argv = ["demo", "--epochs", "1", "--steps", "3", "--device", "cpu", "--slow-data"]
    assert _devicekit_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"epoch 1/1 .* waiting for data 100%\n", out), out
    assert out.splitlines()[-1] == (
        "Last epoch: The loop waited for data 100% of this epoch (90.0 ms of 90.0 ms): it is "
        "input-bound. The DataLoader loads every batch in the training process "
        "(num_workers=0) on a 16-core machine; try num_workers=8."
    )


def test_the_demo_s_json_has_each_epoch_s_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--epochs", "1", "--steps", "2", "--device", "cpu", "--json"]
    assert _devicekit_cli.main(argv) == 0
    (epoch,) = json.loads(capsys.readouterr().out)["epochs"]
    assert epoch["samples"] == 2 * 64  # --steps 2 at batch 64
    assert 0 <= epoch["wait_fraction"] <= 1
    assert epoch["verdict"].startswith("The loop waited for data ")


def test_help_and_usage_errors_answer_before_pytorch_is_imported(fresh_python: str) -> None:
    code = (
        "import sys, _devicekit_cli\n"
        "for argv in (['--help'], ['inf'], ['demo', '--gpu'], ['--version']):\n"
        "    try:\n"
        "        _devicekit_cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules, 'devicekit' in sys.modules)\n"
    )
    result = subprocess.run([fresh_python, "-c", code], capture_output=True, text=True, check=False)
    assert result.stdout.splitlines()[-1] == "False False"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("inf", "info"), ("dmeo", "demo"), ("bnech", "bench"), ("docter", "doctor")],
)
def test_a_mistyped_command_gets_the_closest_one(
    typed: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _devicekit_cli.main([typed])
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == (
        f"devicekit: error: unknown command {typed!r}: did you mean {meant!r}? "
        "(choose from 'info', 'doctor', 'demo', 'bench')"
    )


def test_the_demo_fits_its_batch_first_where_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 256, not 1024: an epoch of 8,192 images, not 16,384 (the rule at 1024 is below).
    monkeypatch.setattr(devicekit._commands._demo, "FIT_LIMIT", 256)
    assert _devicekit_cli.main(["demo", "--epochs", "1", "--device", "cpu", "--fit-batch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:6] == [
        "Batch size 256 on cpu.",
        "Tried: 64 fits, 128 fits, 256 fits.",  # the CPU never runs out
        "Chose 256: the limit (256) fit.",
        (
            "Learning rate 0.003 -> 0.006 for batch 256 (square-root scaling from batch 64, "
            "as for Adam, warm-up 4 steps); each epoch 8,192 images in 32 steps."
        ),
    ]
    epoch = re.match(r"epoch 1/1  loss (\d\.\d+) -> (\d\.\d+)  ", lines[6])
    assert epoch is not None, lines[6]
    # The loss falls as at batch 64 (2.292 -> 1.885 in its first epoch; here 2.318 ->
    # 1.919). At batch 256 with batch 64's learning rate it fell to 2.244 in one epoch
    # (at 1024, to 2.296 in one epoch and 2.198 in three).
    assert float(epoch[2]) < 2.1 < float(epoch[1])


def test_the_demo_scales_its_learning_rate_with_the_batch() -> None:
    # Square-root scaling from batch 64, warmed up where it grows; an epoch of
    # 64 / sqrt(batch / 64) steps, so that the learning rate times the steps is kept.
    table = {
        64: Schedule(64, 0.003, 0, 4096),
        128: Schedule(128, 0.003 * 2**0.5, 4, 45 * 128),
        256: Schedule(256, 0.006, 4, 32 * 256),
        1024: Schedule(1024, 0.012, 4, 16 * 1024),
        32: Schedule(32, 0.003 / 2**0.5, 0, 91 * 32),  # a smaller one, as on a small GPU
    }
    found = {batch: schedule_for(batch) for batch in table}
    assert {batch: dataclasses.astuple(each) for batch, each in found.items()} == {
        batch: pytest.approx(dataclasses.astuple(each)) for batch, each in table.items()
    }
    assert found[1024].explain() == (
        "Learning rate 0.003 -> 0.012 for batch 1024 (square-root scaling from batch 64, "
        "as for Adam, warm-up 4 steps); each epoch 16,384 images in 16 steps."
    )
    assert found[64].explain() == (
        "Learning rate 0.003 -> 0.003 for batch 64 (square-root scaling from batch 64, "
        "as for Adam); each epoch 4,096 images in 64 steps."
    )


def test_the_demo_s_json_holds_the_fit(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devicekit._commands._demo, "FIT_LIMIT", 128)  # fewer, smaller tries
    argv = ["demo", "--epochs", "1", "--steps", "2", "--device", "cpu", "--fit-batch", "--json"]
    assert _devicekit_cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fit_batch"] == {
        "batch_size": 128,
        "tries": [
            {"batch_size": 64, "fitted": True, "peak_memory": None},
            {"batch_size": 128, "fitted": True, "peak_memory": None},
        ],
        "reason": "the limit (128) fit",
        "learning_rate": pytest.approx(0.003 * 2**0.5),
        "warmup_steps": 4,
        "samples": 2 * 128,  # --steps 2 in place of the rule's 45 steps of 128
    }
    assert [epoch["samples"] for epoch in report["epochs"]] == [2 * 128]


@pytest.mark.parametrize("option", ["--epochs", "--steps"])
def test_the_demo_s_counts_are_whole_numbers_of_1_or_more(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _devicekit_cli.main(["demo", option, "0"])
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == (
        f"devicekit demo: error: argument {option}: expected a whole number of 1 or more, got '0'"
    )


# Values from outside (the environment, a backend's words) reach the terminal escaped.
HOSTILE = {
    "LOCAL_RANK": "\x1b[2J",  # clears the screen
    "CUDA_VISIBLE_DEVICES": "\x1b]0;x\x07",  # sets the terminal's title
    "SLURM_GPU_BIND": "none\nerror: a line of its own",
    "DEVICEKIT_DEVICE": "",
    "PALS_LOCAL_SIZE": "\u202e4\x7f\x9b",  # right-to-left override, DEL, a C1 control
}


def _nothing_a_terminal_acts_on(text: str) -> None:
    for line in text.split("\n"):
        assert line.isprintable(), repr(line)


def test_the_doctor_prints_what_it_saw_in_the_environment_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in _doctor_report.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in HOSTILE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DEVICEKIT_CLAIM_DIR", f"{tmp_path}/claims\x1b[31m")
    status, out, _ = _main(monkeypatch, capsys, "doctor")
    assert status == 1  # LOCAL_RANK is no rank
    _nothing_a_terminal_acts_on(out)
    assert "error: a line of its own" not in out.splitlines()
    (variables,) = [line for line in out.splitlines() if line.startswith("  Variables: ")]
    assert variables == (
        "  Variables: CUDA_VISIBLE_DEVICES=\\x1b]0;x\\x07, LOCAL_RANK=\\x1b[2J, "
        "PALS_LOCAL_SIZE=\\u202e4\\x7f\\x9b, SLURM_GPU_BIND=none\\nerror: a line of its own, "
        f"DEVICEKIT_DEVICE=, DEVICEKIT_CLAIM_DIR={tmp_path}/claims\\x1b[31m"
    )
    assert out.startswith("error: LOCAL_RANK='\\x1b[2J' is no rank: ")
    # --json was clean already: the same values, escaped as JSON escapes them.
    status, out, _ = _main(monkeypatch, capsys, "doctor", "--json")
    assert json.loads(out)["environment"]["variables"]["LOCAL_RANK"] == "\x1b[2J"
    _nothing_a_terminal_acts_on(out)


def test_info_prints_a_backend_s_words_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    note = "NVML says \x1b[2Jnothing\r\nselected: cuda:7"
    backends = [FakeGpus([], note=note), CpuBackend()]
    monkeypatch.setattr(cli, "_manager", lambda: dk.DeviceManager("cpu", backends=backends))
    status, out, _ = _main(monkeypatch, capsys, "info")
    assert status == 0
    _nothing_a_terminal_acts_on(out)
    assert "no cuda: NVML says \\x1b[2Jnothing\\r\\nselected: cuda:7" in out.splitlines()
    assert [line for line in out.splitlines() if line.startswith("selected:")] == [
        "selected: cpu (asked for cpu)"
    ]
