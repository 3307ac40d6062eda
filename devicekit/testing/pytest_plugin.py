"""devicekit's pytest plugin: ``--stand-in`` and the ``stand_in_device`` fixture.

Installed with devicekit (entry point ``pytest11``), so a project's tests can ask for the
stand-in accelerator of :func:`devicekit.testing.stand_in` without a conftest:

- ``pytest --stand-in`` starts it before the first test, for the whole session: a test
  suite written for "the accelerator, if there is one" runs on it, on a CPU-only machine;
- the ``stand_in_device`` fixture starts it where a test asks (once per process) and
  gives its first device, ``torch.device("standin:0")``.

Nothing is imported until one of them is used: pytest loads this module in every
project where devicekit is installed.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

__all__ = [
    "pytest_addoption",
    "pytest_configure",
    "pytest_terminal_summary",
    "stand_in_device",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--stand-in``."""
    parser.addoption(
        "--stand-in",
        action="store_true",
        default=False,
        help="start devicekit's stand-in accelerator (devicekit.testing.stand_in) for the session",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Start the stand-in where ``--stand-in`` asks."""
    if config.getoption("--stand-in", default=False):
        from devicekit.testing import stand_in  # noqa: PLC0415 - only where asked

        stand_in()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the host memory the session leaves pinned or registered, where the stand-in ran."""
    testing = sys.modules.get("devicekit.testing")
    left = [] if testing is None else testing.still_pinned()
    if left:
        terminalreporter.section("devicekit stand-in: host memory still pinned")
        for line in left:
            terminalreporter.line(line)


@pytest.fixture(scope="session")
def stand_in_device() -> torch.device:
    """The stand-in's first device, the stand-in started (once per process) where it was not."""
    import torch  # noqa: PLC0415 - only where asked

    from devicekit.testing import stand_in  # noqa: PLC0415 - only where asked

    return torch.device(stand_in(), 0)
