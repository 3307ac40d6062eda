"""Shared test configuration: Hypothesis profiles, the cuda marker, and fixtures.

Constants and helpers that tests import (META, CPU, Pair, ...) are in tests/helpers.py.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import HealthCheck, settings

import devicekit as dk
from devicekit._base import _current
from devicekit._core import _kinds
from devicekit._select._launch import LAUNCHERS

if TYPE_CHECKING:
    from collections.abc import Iterator

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
