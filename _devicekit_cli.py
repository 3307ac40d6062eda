"""The ``devicekit`` command's first lines, outside the package on purpose.

Importing devicekit imports PyTorch, which takes a second or two. Here, before any of
that is imported, the command line is read: ``--help``, ``--version`` and a mistyped
command or option answer at once. Ctrl-C while PyTorch then imports ends the command
as Ctrl-C ends it later (``devicekit.cli.run_parsed``): one line on stderr and status 130.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Final


def main(argv: Sequence[str] | None = None) -> int:
    """Read the arguments, import the command line, then run it."""
    args = parse(argv)  # answers --help and usage errors before PyTorch is imported
    try:
        from devicekit.cli import run_parsed  # noqa: PLC0415 - under the guard on purpose
    except KeyboardInterrupt:
        print("\ndevicekit: interrupted.", file=sys.stderr)
        return 130
    return run_parsed(args)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command and its options; a usage error exits with status 2, as argparse does."""
    parser, commands = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    first = next((arg for arg in given if not arg.startswith("-")), None)
    if first is not None and first not in commands:
        close = difflib.get_close_matches(first, commands, n=1, cutoff=0.5)
        hint = f": did you mean {close[0]!r}?" if close else ""
        parser.error(
            f"unknown command {first!r}{hint} (choose from {', '.join(map(repr, commands))})"
        )
    args, unknown = parser.parse_known_args(given)
    if unknown:  # under the command's own usage, where the option would have gone
        where = commands.get(args.command, parser)
        hint = (
            " (to choose a GPU, pass --device cuda or --device cuda:1)"
            if args.command == "demo" and any(a.lstrip("-") in ("gpu", "cuda") for a in unknown)
            else ""
        )
        where.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def _version() -> str:
    try:
        return metadata.version("devicekit")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        import devicekit  # noqa: PLC0415 - the slow way, only there

        return devicekit.__version__


def _count(text: str) -> int:
    """``--epochs`` and ``--steps``: a whole number of 1 or more, under demo's own usage."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        msg = f"expected a whole number of 1 or more, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return number


_COMMANDS: Final = {
    "info": "List the devices, the one selected, and why.",
    "doctor": "Name the environment mistakes that put ranks on the wrong GPU, and the fix.",
    "demo": "Train a small CNN on synthetic data through devicekit.",
    "bench": "Measure devicekit's transfers on this machine.",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser of the command line, and that of each command by name."""
    parser = argparse.ArgumentParser(
        prog="devicekit", description="Device handling for PyTorch training loops."
    )
    parser.add_argument("--version", action="version", version=_version())
    debug_help = "show the traceback of an error (DEVICEKIT_DEBUG=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # --debug is taken after the command too; there its default leaves the global one be.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = {
        name: subparsers.add_parser(
            name, help=text[0].lower() + text[1:-1], description=text, parents=[common]
        )
        for name, text in _COMMANDS.items()
    }
    for name in ("info", "doctor", "bench"):
        commands[name].add_argument(
            "--json", action="store_true", help="print a JSON report instead"
        )
    demo = commands["demo"]
    demo.add_argument("--epochs", type=_count, default=3, help="passes over the data (default 3)")
    demo.add_argument(
        "--steps",
        type=_count,
        help="steps per epoch, for a short run (default: 64 at batch 64, see --fit-batch)",
    )
    demo.add_argument("--device", help="a device such as cuda:1 (default: devicekit's choice)")
    demo.add_argument("--json", action="store_true", help="print a JSON report at the end only")
    demo.add_argument(
        "--slow-data",
        action="store_true",
        help="make each batch slow to load, to see an input-bound loop and its verdict",
    )
    demo.add_argument(
        "--fit-batch",
        action="store_true",
        help=(
            "first find the largest batch that fits (up to 1024), then train at it with "
            "the learning rate scaled to it"
        ),
    )
    return parser, commands


if __name__ == "__main__":
    raise SystemExit(main())
