"""Shared test configuration: Hypothesis profiles, the cuda and slow markers, and fixtures.

Constants and helpers that tests import (META, CPU, Pair, ...) are in tests/helpers.py.
"""

from __future__ import annotations

import doctest
import functools
import gc
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hypothesis import HealthCheck, settings

import devicekit as dk
from devicekit._base import _current
from devicekit._core import _kinds
from devicekit._select._launch import LAUNCHERS

from .programs import TwoRanks, run_two_ranks

if TYPE_CHECKING:
    from collections.abc import Generator, Iterator

# "ci" runs each property on at least 200 examples; "dev" keeps the local loop quick.
# CI=true (set by CI services and by .ci/run) selects "ci" unless HYPOTHESIS_PROFILE says.
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# The slow tier (python -m pytest -m slow): a test that starts a fresh interpreter (a
# program, the command as a process, torchrun, two ranks, pip building the wheel) takes
# 2-3 s a start, where a test in this process takes about 40 ms. It starts the interpreter
# that the fresh_python fixture gives, and asking for that fixture marks it slow
# (pytest_itemcollected); code that is not the test's, a page's example, is marked slow
# where it is parametrized. A test not marked slow that starts Python fails
# (pytest_runtest_protocol): none can land in the fast tier by forgetting the fixture.
FRESH_PYTHON = "fresh_python"


def pytest_itemcollected(item: pytest.Item) -> None:
    # Before -m selects the tier: a test that asks for a fresh interpreter is slow.
    if FRESH_PYTHON in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.slow)


# The stand-in accelerator (devicekit.testing.stand_in) stays started once started: it
# renames PyTorch's PrivateUse1 device for the process, and DeviceManager() then chooses
# it. So the tests that start it (those asking for stand_in_device, the doctests of its
# own modules) run last, after every test that expects this machine as it is. A case of
# a parametrized fixture that asks for stand_in_device as it runs (request.getfixturevalue)
# says so with the stand_in mark: pytest.param(..., marks=pytest.mark.stand_in).
_STAND_IN_MODULES = "devicekit/testing/_stand_in/"
STAND_IN_MARK = "stand_in"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{STAND_IN_MARK}: the case asks for the stand_in_device fixture as it runs (a "
        "parametrized fixture's case); it runs last, as the tests asking for it do",
    )


def _starts_the_stand_in(item: pytest.Item) -> bool:
    if "stand_in_device" in getattr(item, "fixturenames", ()):
        return True
    if item.get_closest_marker(STAND_IN_MARK) is not None:
        return True
    if item.nodeid.startswith(_STAND_IN_MODULES):
        return True
    # A docstring's example run by tests/test_docs.py, stand_in()'s own among them.
    example = getattr(getattr(item, "callspec", None), "params", {}).get("example")
    return "stand_in(" in str(getattr(example, "docstring", ""))


@pytest.fixture(scope="session")
def fresh_python() -> str:
    """The interpreter a test starts its programs with; asking for it makes the test slow.

    Write ``[fresh_python, "-c", code]`` where ``[sys.executable, "-c", code]`` would go.
    """
    return sys.executable


@pytest.fixture(scope="session")
def start_two_ranks(fresh_python: str) -> TwoRanks:
    """``run_two_ranks`` (tests/programs.py) on the fresh interpreter: ranks 0 and 1 of a script."""
    return functools.partial(run_two_ranks, fresh_python)


# Python itself, and the commands that are Python programs.
_PYTHON_COMMANDS = re.compile(r"python[\d.]*|torchrun|pip[\d.]*")


def _command_line(args: Any, executable: Any) -> list[str]:
    """The words of what subprocess.Popen is asked to start."""
    if isinstance(args, (str, bytes, os.PathLike)):
        words = shlex.split(os.fsdecode(args))
    else:
        words = [os.fsdecode(word) for word in args]
    return words if executable is None else [os.fsdecode(executable), *words]


def _starts_python(words: list[str]) -> bool:
    # Any word, not the first only: `unshare --pid ... python -c ...` starts Python too.
    return any(
        word == sys.executable or _PYTHON_COMMANDS.fullmatch(Path(word).name) for word in words
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Refuse a fresh interpreter to a test of the fast tier.

    Around all of the test, its fixtures' setup and teardown included (a module's too):
    a fixture that builds the wheel starts Python as much as a test does.
    """
    if item.get_closest_marker("slow") is not None:
        return (yield)
    start = subprocess.Popen.__init__

    def refuse_python(
        self: subprocess.Popen[Any], args: Any, bufsize: int = -1, executable: Any = None,
        *rest: Any, **options: Any
    ) -> None:  # fmt: skip
        words = _command_line(args, executable)
        if _starts_python(words):
            pytest.fail(
                f"{item.nodeid} starts a fresh interpreter ({shlex.join(words)[:200]}), which "
                "belongs in the slow tier: ask for the fresh_python fixture (tests/conftest.py) "
                "and start the command with it, [fresh_python, ...] in place of "
                "[sys.executable, ...]; or run the code in this process.",
                pytrace=False,
            )
        start(self, args, bufsize, executable, *rest, **options)

    subprocess.Popen.__init__ = refuse_python  # type: ignore[method-assign]
    try:
        return (yield)
    finally:
        subprocess.Popen.__init__ = start  # type: ignore[method-assign]


@pytest.hookimpl(trylast=True)  # on what -m and -k selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A docstring example that a test runs as its parameter (tests/test_docs.py, with
    # nothing but the example's own imports) is not run again by --doctest-modules.
    run_by_a_test = {
        param.docstring
        for item in items
        if isinstance(item, pytest.Function) and hasattr(item, "callspec")
        for param in item.callspec.params.values()
        if isinstance(param, doctest.DocTest)
    }
    again = [
        item
        for item in items
        if isinstance(item, pytest.DoctestItem) and item.dtest.docstring in run_by_a_test
    ]
    if again:
        config.hook.pytest_deselected(items=again)
        left_out = set(again)
        items[:] = [item for item in items if item not in left_out]
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    items.sort(key=_starts_the_stand_in)  # stable: each group keeps its order


# How many modules were imported when the collector last froze what was alive.
_FROZEN_WITH: dict[str, int] = {"modules": 0}


@pytest.fixture(autouse=True)
def collections_pass_over_what_imports_keep() -> None:
    """Freeze what is alive once a module was imported, so that collections pass over it.

    fit_batch collects garbage after each failed try, and a collection walks every object
    the collector tracks: 0.13 s each with the 160,000 that PyTorch, its lazily imported
    parts and the test modules keep by test_fit_batch, where ~100 collections ran. Those
    live for the session; what tests make after a freeze is collected as before.
    """
    if len(sys.modules) != _FROZEN_WITH["modules"]:
        gc.collect()  # what is garbage already is freed, not kept for good
        gc.freeze()
        _FROZEN_WITH["modules"] = len(sys.modules)


@pytest.fixture(autouse=True)
def no_transfer_rule_left_behind() -> Iterator[None]:
    """Fail a test that leaves a transfer rule registered, once the rule is taken away.

    A rule left in devicekit's table would change how every later test moves its type.
    """
    before = dict(_kinds._rules)
    yield
    left = [cls for cls, rule in list(_kinds._rules.items()) if before.get(cls) is not rule]
    for cls in left:
        dk.unregister_transfer(cls)
    for cls, rule in before.items():
        if cls not in _kinds._rules:  # taken away by the test: given back
            dk.register_transfer(cls)(rule)
    if left:
        names = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in left)
        pytest.fail(
            f"The test left a transfer rule registered for {names}: unregister it in the "
            "test (try/finally, or a fixture), so that later tests are unaffected.",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def managers_close_with_their_test() -> Iterator[None]:
    """Close the managers a test made, as a script's end does.

    An open manager is the default device of every later call given none
    (devicekit._base._current): one a test's reference cycle keeps until the collector runs
    would otherwise decide where later tests' data goes, or make them refuse.
    """
    before = set(_current._open)
    yield
    for reference in set(_current._open) - before:
        manager = reference()
        if manager is not None:
            manager.close()  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts outside any launcher: a CI job run under Slurm or MPI sets these."""
    for launcher in LAUNCHERS:
        monkeypatch.delenv(launcher.rank, raising=False)
        monkeypatch.delenv(launcher.size, raising=False)


@pytest.fixture
def swap_module_params() -> Iterator[None]:
    """Make Module.to keep its Parameter objects on every device pair.

    On CUDA, Module.to moves parameters in place, so an optimizer built before the move
    still holds them. Between cpu and meta PyTorch makes new Parameter objects instead,
    unless this flag is set; the optimizer tests need the CUDA behaviour on the CPU.
    """
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


WATCHDOG_S = 10


class Hang(Exception):  # noqa: N818 - what it reports is a hang
    """Raised in the test's thread when the watchdog fires."""


@pytest.fixture
def watchdog() -> Iterator[None]:
    """Fail, instead of stalling CI, when a test blocks for WATCHDOG_S seconds."""

    def fire(signum: int, frame: object) -> None:
        msg = f"the test did not finish within {WATCHDOG_S} s: it hangs where this was raised"
        raise Hang(msg)

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, WATCHDOG_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
