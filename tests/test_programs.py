"""The tests' time limit on programs holds when a child of the program hangs."""

from __future__ import annotations

import sys
import textwrap

import pytest

from .programs import run_program

# The program starts a child that sleeps for ten minutes holding its output pipes, and
# ends at once: subprocess.run(timeout=...) would wait for the child.
LEAVES_A_CHILD = textwrap.dedent(
    """
    import subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("started", flush=True)
    """
)


def test_a_child_holding_the_pipes_fails_the_run_at_the_limit() -> None:
    with pytest.raises(AssertionError, match=r"ran past 2 s"):
        run_program([sys.executable, "-c", LEAVES_A_CHILD], timeout=2)


def test_a_program_that_ends_gives_its_status_and_output() -> None:
    result = run_program([sys.executable, "-c", "print('out'); raise SystemExit(3)"], timeout=60)
    assert (result.returncode, result.stdout) == (3, "out\n")
