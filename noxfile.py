"""Quality gates: ``nox -s tests lint typecheck docs``.

Every session installs torch==2.13.0 before the project: a bare ``torch`` requirement
would let pip pick the newest build, with several GB of CUDA packages.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "interop", "lint", "typecheck", "docs"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
# The oldest PyTorch devicekit supports (pyproject's floor: torch.accelerator came in 2.6).
OLDEST_TORCH = "torch==2.6.0"


def install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, as the README runs it."""
    install(session, "test")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def interop(session: nox.Session) -> None:
    """to_device and the checks on transformers', tensordict's and torch_geometric's objects.

    The packages must be there: a missing one fails the session instead of skipping.
    """
    install(session, "test,interop")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_interop.py",
        *session.posargs,
        env={"DEVICEKIT_REQUIRE_INTEROP": "1"},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff's checks and its formatting, without changing files."""
    session.install("ruff==0.17.6")  # the version the lint extra pins
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package and on the typing tests written as user code."""
    install(session, "lint")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """The Sphinx site with warnings as errors, then every example in it as a doctest."""
    # The API pages import devicekit.testing; the migration guide runs accelerate's and
    # Lightning Fabric's side of each example too, the moving-data guide other libraries'.
    install(session, "docs,testing,bench,interop")
    common = ["-n", "-W", "--keep-going", "docs"]
    session.run("sphinx-build", "-b", "html", *common, "docs/_build/html")
    session.run("sphinx-build", "-b", "doctest", *common, "docs/_build/doctest")


@nox.session
def oldest_torch(session: nox.Session) -> None:
    """The test suite on the oldest PyTorch devicekit supports, 2.6.

    PyPI has no CPU-only build of it for Linux x86-64, so this installs its CUDA build
    and the NVIDIA libraries it links (several GB, once): the CPU tests run on it as on
    any other build. Not one of the default sessions.
    """
    session.install(OLDEST_TORCH)
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)
