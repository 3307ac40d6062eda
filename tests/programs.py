"""Running a program as a user would, with a time limit that holds for its children too."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def run_program(
    command: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end, or fail once ``timeout`` seconds have passed.

    ``subprocess.run(timeout=...)`` kills the program but then waits for its output
    pipes to close, which never happens while a child it started (a torchrun worker,
    a DataLoader worker) is stuck holding them. The program runs in a session of its
    own, so the whole session is killed instead, and a hang fails the test.
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        try:
            stdout, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            # A child that left the session (a torchrun worker orphaned at its exit)
            # still holds the pipes: stop reading rather than wait for it forever.
            for pipe in (process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()
            stderr = "(its output pipes were still held by a child that left its session)"
        msg = f"{' '.join(command)} ran past {timeout} s; what it printed:\n{stderr[-3000:]}"
        raise AssertionError(msg) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# Starts each rank as a child and exits with the worst status; run through run_program, so
# a rank that hangs fails the test with the others.
_RANKS = (
    "import subprocess, sys\n"
    "children = [subprocess.Popen([sys.executable, *sys.argv[1:3], str(rank), *sys.argv[3:]])"
    " for rank in range(2)]\n"
    "sys.exit(max(child.wait() for child in children))\n"
)


def run_two_ranks(
    python: str, script: Path, folder: Path, *arguments: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``script folder RANK arguments...`` as ranks 0 and 1, with this checkout's devicekit.

    Tests call it as the ``two_ranks`` fixture (tests/conftest.py), which gives ``python``.
    """
    here = str(Path(__file__).parent.parent)  # this checkout's devicekit, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    command = [python, "-c", _RANKS, str(script), str(folder), *arguments]
    return run_program(command, timeout=timeout, env=env)


TwoRanks = Callable[..., subprocess.CompletedProcess[str]]
"""The type of the ``start_two_ranks`` fixture: ``run_two_ranks`` without its ``python``."""
