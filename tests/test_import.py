"""``import devicekit`` stays light: nothing of torch.compile's machinery, no optional package.

What is imported is checked, not how long it takes (timings live in
benchmarks/bench_import.py): torch._dynamo alone added about a second.
"""

from __future__ import annotations

import json
import subprocess

import pytest

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "numpy.testing", "hypothesis")
OPTIONAL = ("pynvml", "transformers", "tensordict", "torch_geometric", "matplotlib")


# One fresh interpreter for both tests: what ``import devicekit`` imports, printed as a
# JSON list on the first line, then what first use of a lazy name loads.
_IMPORT_THEN_FIRST_USE = (
    "import json, sys, torch\n"
    "before = set(sys.modules)\n"
    "import devicekit\n"
    "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    "import devicekit as dk\n"
    "from devicekit import save\n"
    "assert save is dk.save and 'devicekit._files._checkpoint' in sys.modules\n"
    "assert dk.fit_batch.__module__ == 'devicekit._memory._fit_batch'\n"
    "assert {'track_transfers', 'BatchFit', 'load'} <= set(dir(dk))\n"
    "try:\n"
    "    dk.fit_batches\n"
    "except AttributeError as error:\n"
    "    print(error)\n"
)


@pytest.fixture(scope="module")
def fresh_import(fresh_python: str) -> tuple[list[str], str]:
    """The modules ``import devicekit`` imported, and what first use printed after it."""
    result = subprocess.run(
        [fresh_python, "-c", _IMPORT_THEN_FIRST_USE], capture_output=True, text=True, check=True
    )
    imported, first_use = result.stdout.split("\n", 1)
    return json.loads(imported), first_use


def test_importing_devicekit_imports_nothing_of_the_compiler_nor_optional_packages(
    fresh_import: tuple[list[str], str],
) -> None:
    imported, _ = fresh_import
    assert "devicekit._core._kinds" in imported  # the package itself was imported here
    heavy = [name for name in imported if name.startswith(HEAVY + OPTIONAL)]
    assert heavy == []


def test_what_few_loops_need_is_imported_on_first_use(fresh_import: tuple[list[str], str]) -> None:
    imported, first_use = fresh_import
    assert "devicekit._select._manager" in imported
    assert not {
        "devicekit._checks._audit",
        "devicekit._files._checkpoint",
        "devicekit._memory._fit_batch",
    } & set(imported)
    assert first_use == "module 'devicekit' has no attribute 'fit_batches'\n"
