"""The tests' time limit on programs holds when a child of the program hangs.

And the tiers: a test that starts a fresh interpreter is in the slow one (tests/conftest.py).
"""

from __future__ import annotations

import re
import subprocess
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


def test_a_child_holding_the_pipes_fails_the_run_at_the_limit(fresh_python: str) -> None:
    with pytest.raises(AssertionError, match=r"ran past 2 s"):
        run_program([fresh_python, "-c", LEAVES_A_CHILD], timeout=2)


def test_a_program_that_ends_gives_its_status_and_output(fresh_python: str) -> None:
    result = run_program([fresh_python, "-c", "print('out'); raise SystemExit(3)"], timeout=60)
    assert (result.returncode, result.stdout) == (3, "out\n")


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-c", "pass"],
        ["python3", "-c", "pass"],
        ["torchrun", "--standalone", "script.py"],
        ["unshare", "--pid", "--fork", sys.executable, "-c", "pass"],
        f"cd / && {sys.executable} -c pass",  # a shell's command line
    ],
    ids=["sys.executable", "python3", "torchrun", "under unshare", "shell"],
)
def test_a_test_of_the_fast_tier_that_starts_python_fails_naming_the_fixture(
    command: list[str] | str,
) -> None:
    # Refused before anything starts: this test stays in the fast tier.
    with pytest.raises(pytest.fail.Exception, match=re.escape("ask for the fresh_python fixture")):
        subprocess.run(command, shell=isinstance(command, str), check=False)


def test_a_test_of_the_fast_tier_may_start_other_programs() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0


def test_asking_for_the_fresh_interpreter_puts_a_test_in_the_slow_tier(
    fresh_python: str, request: pytest.FixtureRequest
) -> None:
    assert fresh_python == sys.executable
    assert request.node.get_closest_marker("slow") is not None
