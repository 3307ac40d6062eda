"""``import devicekit`` stays light: nothing of torch.compile's machinery, no optional package.

What is imported is checked, not how long it takes (timings live in
benchmarks/bench_import.py): torch._dynamo alone added about a second.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "numpy.testing", "hypothesis")
OPTIONAL = ("pynvml", "transformers", "tensordict", "torch_geometric", "matplotlib")


def _imported_with_devicekit() -> list[str]:
    code = (
        "import json, sys, torch\n"
        "before = set(sys.modules)\n"
        "import devicekit\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    found: list[str] = json.loads(result.stdout)
    return found


def test_importing_devicekit_imports_nothing_of_the_compiler_nor_optional_packages() -> None:
    imported = _imported_with_devicekit()
    assert "devicekit._kinds" in imported  # the package itself was imported here
    heavy = [name for name in imported if name.startswith(HEAVY + OPTIONAL)]
    assert heavy == []
