"""Running a program as a user would, with a time limit that holds for its children too."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence


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
