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
import os
import re
import sys
import warnings
from typing import Any

import torch

import devicekit
from devicekit._base import META, DeviceKitError, count, gib
from devicekit._commands import (
    BATCH_SIZE,
    bench_report,
    fit_demo_batch,
    measure_bench,
    schedule_for,
    train,
)
from devicekit._doctor import diagnose, look, refusal, report_lines, report_object
from devicekit._select import (
    DeviceManager,
    Holder,
    claim_holders,
    family_notes,
    who_uses,
    whole_number,
)


class UserError(Exception):
    """A mistake in what was asked of the command: one line on stderr, status 2."""


def _printable(line: str) -> str:
    r"""``line`` as the command shows it: every character a terminal would act on, escaped.

    Values from outside reach the lines the command prints: environment variables (the
    doctor's "Seen:"), the claim directory's path, the names and notes of drivers and
    backends. An escape sequence among them (``"\x1b[2J"`` clears the screen), a newline
    or any other control or format character is shown as Python writes it in a string,
    as ``--json`` escapes it; so are undecodable bytes (:func:`_escaped`), which print()
    would refuse.

    >>> print(_printable("LOCAL_RANK=\x1b[2J\x1b]0;x\x07, CUDA_VISIBLE_DEVICES=0\n1, café"))
    LOCAL_RANK=\x1b[2J\x1b]0;x\x07, CUDA_VISIBLE_DEVICES=0\n1, café
    """
    return "".join(char if char.isprintable() else _escaped(char) for char in line)


def _escaped(char: str) -> str:
    r"""How a character the command cannot show is written: as Python writes it in a string.

    So a byte that was not UTF-8, which Python reads (in a variable, a path) as a lone
    surrogate, is written as that surrogate's escape, ``\udc80`` for the byte 0x80: as
    messages show it (their values are written by ``repr``), on a terminal and in
    ``--json`` alike. The surrogate itself no UTF-8 output may hold.

    >>> print(_escaped("\x1b"), _escaped("\u202e"), _escaped("\udc80"))
    \x1b \u202e \udc80
    """
    return ascii(char)[1:-1]


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _json(report: object) -> str:
    r"""``report`` as ``--json`` prints it: JSON that is valid UTF-8, the one place it is written.

    A lone surrogate (an undecodable byte of a variable or a path) would be written as
    JSON's escape of it, ``"\udc80"``, which strict parsers refuse (it is no character):
    it is written as :func:`_escaped` says, the six characters ``\udc80``.

    >>> print(_json({"LOCAL_RANK": "\udc80\x1b", "name": "café"}))
    {
      "LOCAL_RANK": "\\udc80\u001b",
      "name": "caf\u00e9"
    }
    """
    # Written unescaped first, a lone surrogate can stand only inside a string: there it
    # becomes the JSON of its escape's six characters, and the text is written again.
    raw = json.dumps(report, ensure_ascii=False)
    text = _SURROGATE.sub(lambda found: json.dumps(_escaped(found[0]))[1:-1], raw)
    return json.dumps(json.loads(text), indent=2)


def _say(*lines: str, file: Any = None, flush: bool = False) -> None:
    """Print each of ``lines`` on a line of its own, through :func:`_printable`: the one rule.

    A newline inside a line (a value's) is escaped, never a line of its own.
    """
    print("\n".join(map(_printable, lines)), file=file, flush=flush)


def _manager(device: str | None = None) -> DeviceManager:
    # The fallback warning would repeat what the output itself says.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if device is not None:
            # Read as DEVICEKIT_DEVICE is: a small whole number is an index; anything else,
            # 5,000 digits included, is a device for the manager to parse or refuse.
            index = whole_number(device)
            return DeviceManager(device if index is None else index)
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


@dataclasses.dataclass
class _Run:
    """What the demo has done so far: what Ctrl-C reports."""

    epochs_done: int = 0


def _demo(
    manager: DeviceManager,
    epochs: int,
    *,
    as_json: bool,
    slow_data: bool,
    fit: bool,
    steps: int | None,
    run: _Run,
) -> int:
    if manager.device.type == "meta":
        msg = (
            f"Expected a device with memory for the demo to train on, got meta: {META}. "
            "Choose cpu or an accelerator."
        )
        raise UserError(msg)
    if not as_json:
        print(f"devicekit {devicekit.__version__}: a small CNN on synthetic 16x16 images")
        _say(f"device: {manager.device} ({manager.reason})", flush=True)
    found = fit_demo_batch(manager.device) if fit else None
    # A larger batch trains as the default one only with its learning rate scaled.
    schedule = schedule_for(BATCH_SIZE if found is None else found.batch_size, steps=steps)
    if found is not None and not as_json:
        _say(*found.explain().split("\n"), flush=True)  # devicekit's own lines
        _say(*schedule.explain().split("\n"), flush=True)
    progress = None if as_json else _progress(epochs)
    reports = []
    # Over a progress line, the epoch's line goes back to the start and covers it.
    start, pad = ("\r", " " * 20) if progress is not None else ("", "")
    for report in train(
        manager.device,
        epochs=epochs,
        samples=schedule.samples,
        batch_size=schedule.batch_size,
        learning_rate=schedule.learning_rate,
        warmup_steps=schedule.warmup_steps,
        slow_data=slow_data,
        on_batch=progress,
    ):
        reports.append(report)
        run.epochs_done = report.epoch
        if not as_json:
            print(
                f"{start}epoch {report.epoch}/{epochs}  loss {report.first_loss:.3f} -> "
                f"{report.loss:.3f}  {report.samples_per_second:,.0f} samples/s  "
                f"{report.seconds:.1f} s  waiting for data {report.wait_fraction:.0%}{pad}",
                flush=True,
            )
    if as_json:
        summary: dict[str, object] = {
            "device": str(manager.device),
            "reason": manager.reason,
            "epochs": [dataclasses.asdict(report) for report in reports],
        }
        if found is not None:
            summary["fit_batch"] = {
                "batch_size": found.batch_size,
                "tries": [each._asdict() for each in found.tries],
                "reason": found.reason,
                "learning_rate": schedule.learning_rate,
                "warmup_steps": schedule.warmup_steps,
                "samples": schedule.samples,
            }
        print(_json(summary))
    else:
        samples = sum(report.samples for report in reports)
        seconds = sum(report.seconds for report in reports)
        print(
            f"Trained {count(epochs, 'epoch')} on {manager.device}: loss "
            f"{reports[0].first_loss:.3f} (first batch) -> {reports[-1].loss:.3f} (last epoch), "
            f"{samples / seconds:,.0f} samples/s over {seconds:.1f} s."
        )
        _say(f"Last epoch: {reports[-1].verdict}")
    return 0


def _gib(size: int | None) -> str:
    return "-" if size is None else gib(size)


def _info_table(manager: DeviceManager) -> str:
    """``devicekit info``'s table and what follows it, each line through :func:`_printable`."""
    claims = claim_holders(manager.devices)
    header = ("", "device", "backend", "name", "total", "free", "busy", "capability", "claimed by")
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
                "-" if info.utilization is None else f"{info.utilization:.0%}",
                capability,
                _holder(claims, info.device),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in rows
    ]
    lines.append("")
    lines += [f"{info.device}: {used}" for info in manager.devices if (used := who_uses(info))]
    lines.append(f"selected: {manager.device} ({manager.reason})")
    lines += [f"no {name}: {note}" for name, note in manager.notes().items()]
    return "\n".join(map(_printable, lines))


def _holder(claims: dict[torch.device, Holder], device: torch.device) -> str:
    return str(claims[device]) if device in claims else "-"


def _info_json(manager: DeviceManager) -> str:
    choice = {"selected": str(manager.device), "reason": manager.reason}
    return _json(_info_object(choice, manager.devices, manager.notes()))


def _refused_json(error: Exception) -> str:
    """``info --json`` where no device can be chosen: why, and the devices all the same.

    ``error`` is the manager's, as plain ``info`` says it; ``findings`` the doctor's of it.
    """
    machine = look()
    devices = tuple(info for family in machine.families for info in family.devices)
    notes = family_notes(machine.families)
    choice = {
        "selected": None,
        "reason": None,
        "error": str(error),
        "findings": [finding._asdict() for finding in refusal(machine)],
    }
    return _json(_info_object(choice, devices, notes))


def _info_object(
    choice: dict[str, Any], devices: tuple[devicekit.DeviceInfo, ...], notes: dict[str, str]
) -> dict[str, Any]:
    def record(info: devicekit.DeviceInfo) -> dict[str, Any]:
        fields = dataclasses.asdict(info)
        fields["device"] = str(info.device)
        if info.processes is not None:
            fields["processes"] = [process._asdict() for process in info.processes]
        return fields

    return {
        "devicekit": devicekit.__version__,
        "torch": torch.__version__,
        **choice,
        "devices": [record(info) for info in devices],
        "claims": {str(d): holder.pid for d, holder in claim_holders(devices).items()},
        "notes": notes,
    }


def _info(*, as_json: bool) -> int:
    """``devicekit info``: the table, or ``--json``'s object, even where the choice is refused.

    A refusal (a malformed ``LOCAL_RANK``, say) ends as every mistake does, with its
    one line on stderr and status 2; ``--json`` first prints the object that says it.
    """
    try:
        manager = _manager()
    except (DeviceKitError, ValueError) as error:
        if as_json:
            print(_refused_json(error))
            sys.stdout.flush()  # as run_parsed does, so that a closed pipe is caught there
        raise
    print(_info_json(manager) if as_json else _info_table(manager))
    return 0


def run_parsed(args: argparse.Namespace) -> int:
    """Run what ``_devicekit_cli.parse`` read from the command line; the exit status.

    A mistake in what was asked (a device this machine lacks, a bad environment
    variable) is one line on stderr and status 2; ``--debug`` (or ``DEVICEKIT_DEBUG=1``)
    shows the traceback instead. Ctrl-C ends with one line and status 130; a reader
    that goes away (``devicekit info | head -1``) ends it quietly with status 0, and an
    output that cannot be written (``> /dev/full``, a closed stdout) with one line and
    status 1.

    >>> import _devicekit_cli
    >>> run_parsed(_devicekit_cli.parse([]))  # doctest: +ELLIPSIS
    devicekit ... (PyTorch ...)
    device: ...
    0
    """
    debug = args.debug or os.environ.get("DEVICEKIT_DEBUG", "") not in ("", "0")
    if sys.stdout is None:  # started with stdout closed (>&-): print() would drop it all
        print("devicekit: error: cannot write the output: stdout is closed.", file=sys.stderr)
        return 1
    run = _Run()
    try:
        status = _run(args, run)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at exit
    except KeyboardInterrupt:
        done = f" after {count(run.epochs_done, 'epoch')}" if args.command == "demo" else ""
        print(f"\ndevicekit: interrupted{done}.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (| head), before or after the last write, which is a
        # matter of timing: the same quiet status 0 either way.
        _drop_output()
        return 0
    except OSError as error:
        if error.filename is not None:  # a file devicekit itself opened: a real failure
            raise
        _drop_output()
        print(f"devicekit: error: cannot write the output: {error.strerror}.", file=sys.stderr)
        return 1
    except (UserError, DeviceKitError, ValueError) as error:
        if debug:
            raise
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        _say(f"devicekit: error: {message}", file=sys.stderr)
        return 2
    return status


def _drop_output() -> None:
    """Point stdout at the null device, so that Python's exit flushes it without error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _doctor(*, as_json: bool) -> int:
    """The doctor's findings, a line each, then what it saw; status 1 where one breaks a run."""
    machine = look()
    findings = diagnose(machine)
    if as_json:
        print(_json(report_object(findings, machine)))
    else:
        _say(*[finding.line() for finding in findings] or ["No problem found."])
        print("\nSeen:")
        _say(*[f"  {line}" for line in report_lines(machine)])
    return 1 if any(finding.severity == "error" for finding in findings) else 0


def _run(args: argparse.Namespace, run: _Run) -> int:
    if args.command == "doctor":
        return _doctor(as_json=args.json)
    if args.command == "bench":
        measured = measure_bench()
        if args.json:
            print(_json(measured))  # JSON escapes what a terminal acts on
        else:
            _say(*bench_report(measured))
        return 0
    if args.command == "demo":
        return _demo(
            _manager(args.device),
            args.epochs,
            as_json=args.json,
            slow_data=args.slow_data,
            fit=args.fit_batch,
            steps=args.steps,
            run=run,
        )
    if args.command == "info":
        return _info(as_json=args.json)
    manager = _manager()
    print(f"devicekit {devicekit.__version__} (PyTorch {torch.__version__})")
    _say(f"device: {manager.device} ({manager.reason})")
    return 0
