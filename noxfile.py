"""Quality gates: ``nox -s tests slow lint typecheck docs``; ``nox -s build`` checks the release.

Every session installs torch==2.13.0 before the project: a bare ``torch`` requirement
would let pip pick the newest build, with several GB of CUDA packages.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import nox
from packaging.requirements import Requirement  # nox's own dependency

nox.options.sessions = ["tests", "slow", "interop", "lint", "typecheck", "docs"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
# The oldest PyTorch devicekit supports (pyproject's floor: torch.accelerator came in 2.6).
OLDEST_TORCH = "torch==2.6.0"
# Exact versions, as for ruff: a new release of either must not turn the session red on its own.
BUILD_TOOLS = ["build==1.6.1", "twine==7.0.0"]


def install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite's fast tier, as the README runs it."""
    install(session, "test")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """The slow tier, as .ci/run runs it: the tests that start a fresh Python (conftest.py)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-m", "slow", *session.posargs)


@nox.session
def interop(session: nox.Session) -> None:
    """to_device and the checks on transformers', tensordict's and torch_geometric's objects,
    and the documentation's sections that use them or accelerate and Fabric.

    The packages must be there: a missing one fails the session instead of skipping.
    """
    install(session, "test,interop,bench")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_interop.py",
        "tests/test_docs.py",
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
    # Lightning Fabric's side of each example too, the other-libraries guide those
    # libraries' objects.
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
    session.run("python", "-m", "pytest", "-m", "slow or not slow", *session.posargs)  # both tiers


@nox.session
def build(session: nox.Session) -> None:
    """The sdist and the wheel, checked, then installed and run as a user gets them.

    ``python -m build`` makes the sdist, then the wheel from the unpacked sdist, so a file
    the sdist leaves out fails here too. The wheel is installed into a virtual environment
    of its own, and its command is run from a directory outside the clone: there, an
    import of the checkout cannot stand in for a file the wheel lacks. Not one of the
    default sessions: it installs PyTorch afresh each time (about a minute).
    """
    session.install(*BUILD_TOOLS)
    dist = Path(session.create_tmp()) / "dist"
    # Files from an earlier run, of another version, would be checked and installed too.
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist))
    (sdist,) = dist.glob("devicekit-*.tar.gz")
    (wheel,) = dist.glob("devicekit-*.whl")
    # --strict: a README that PyPI would not render, or no content type for it, fails.
    session.run("twine", "check", "--strict", str(sdist), str(wheel))
    _check_wheel(session, wheel)

    with tempfile.TemporaryDirectory(prefix="devicekit-build-") as outside:
        venv = Path(outside) / "venv"
        session.run("python", "-m", "venv", str(venv))
        python = str(venv / "bin" / "python")
        session.run(python, "-m", "pip", "install", "--quiet", TORCH, external=True)
        session.run(python, "-m", "pip", "install", TORCH, str(wheel), external=True)
        with session.chdir(outside):
            # Where devicekit was imported from: the environment, not the clone.
            session.run(python, "-c", _FROM_THE_WHEEL, str(venv), external=True)
            devicekit = str(venv / "bin" / "devicekit")
            session.run(devicekit, "info", external=True)
            session.run(devicekit, "demo", "--epochs", "1", external=True)


# Run in the wheel's environment, with that environment's directory as argument.
_FROM_THE_WHEEL = """
import sys, pathlib, devicekit, _devicekit_cli
venv = pathlib.Path(sys.argv[1]).resolve()
for module in (devicekit, _devicekit_cli):
    where = pathlib.Path(module.__file__).resolve()
    if venv not in where.parents:
        sys.exit(f"Expected {module.__name__} to be imported from {venv}, got {where}.")
print(f"devicekit {devicekit.__version__} from {pathlib.Path(devicekit.__file__).parent}")
"""


def _check_wheel(session: nox.Session, wheel: Path) -> None:
    """What twine does not look at: the files, the command, the version and the requirements."""
    found = re.search(
        r'^__version__ = "(.+)"$', Path("devicekit/__init__.py").read_text(), re.MULTILINE
    )
    if found is None:
        session.error('Expected a line __version__ = "..." in devicekit/__init__.py, found none.')
    version = found[1]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (info,) = {name.split("/")[0] for name in names if ".dist-info/" in name}
        metadata = HeaderParser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()

    if metadata["Version"] != version:
        session.error(
            f"Expected {wheel.name} to have version {version}, as devicekit/__init__.py says; "
            f"its METADATA says {metadata['Version']}."
        )
    # The command's module sits beside the package, outside it (pyproject's only-include).
    expected = {"_devicekit_cli.py", "devicekit/__init__.py", "devicekit/cli.py"}
    if Path("devicekit/py.typed").exists():
        expected.add("devicekit/py.typed")  # without it, mypy ignores the wheel's types
    if missing := sorted(expected - names):
        session.error(f"Expected {wheel.name} to hold {', '.join(missing)}, it does not.")
    # Tests, docs or benchmarks in the wheel would install as top-level packages.
    tops = {name.split("/")[0] for name in names}
    if stray := sorted(tops - {"devicekit", "_devicekit_cli.py", info}):
        session.error(
            f"Expected only devicekit and _devicekit_cli.py in {wheel.name}, found {stray}."
        )
    if "devicekit = _devicekit_cli:main" not in entry_points.splitlines():
        session.error(
            f"Expected the console script devicekit = _devicekit_cli:main in {wheel.name}, "
            f"found entry_points.txt:\n{entry_points}"
        )
    # Unconditional: torch under an extra's marker would install devicekit without it.
    requires = [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]
    always = [requirement for requirement in requires if requirement.marker is None]
    if "torch" not in {requirement.name for requirement in always}:
        listed = sorted(str(requirement) for requirement in always)
        session.error(f"Expected {wheel.name} to require torch; it always requires {listed}.")
    session.log(f"{wheel.name}: {len(names)} files; the command, py.typed and torch are there.")
