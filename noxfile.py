"""Quality gates: ``nox -s tests lint typecheck docs``.

Every session installs torch==2.13.0 before the project: a bare ``torch`` requirement
would let pip pick the newest build, with several GB of CUDA packages.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"


def install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, as the README runs it."""
    install(session, "test")
    session.run("python", "-m", "pytest", *session.posargs)


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
    install(session, "docs,testing")  # the API pages import devicekit.testing
    common = ["-n", "-W", "--keep-going", "docs"]
    session.run("sphinx-build", "-b", "html", *common, "docs/_build/html")
    session.run("sphinx-build", "-b", "doctest", *common, "docs/_build/doctest")
