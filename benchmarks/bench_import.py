"""What ``import devicekit`` adds over ``import torch``, and what ``DeviceManager()`` costs.

Run ``python benchmarks/bench_import.py``. Each import is timed in a fresh interpreter
(torch imported first, then devicekit, timed inside the process), with bytecode caches
written once before, as an installed package has them. Target: at most 30 ms added on
import. CI runs it (``.ci/run``); tests/test_import.py checks, deterministically, that
nothing of torch.compile's machinery is imported with devicekit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import timeit
import warnings

import devicekit as dk

TIME_IMPORT = (
    "import time; import torch; start = time.perf_counter(); import devicekit; "
    "print(time.perf_counter() - start)"
)
TIME_TORCH = (
    "import time; start = time.perf_counter(); import torch; print(time.perf_counter() - start)"
)


# With bytecode caches, as a user's machine has them: without (PYTHONDONTWRITEBYTECODE,
# set on some CI machines), every import compiles devicekit's sources, 40-50 ms more.
_ENVIRONMENT = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _sample(code: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=_ENVIRONMENT,
    )
    return float(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=15, help="fresh interpreters per figure")
    args = parser.parse_args()
    _sample(TIME_IMPORT)  # writes the bytecode caches the samples then read
    torch_ms = statistics.median(_sample(TIME_TORCH) for _ in range(args.samples)) * 1e3
    added_ms = statistics.median(_sample(TIME_IMPORT) for _ in range(args.samples)) * 1e3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback on GPU-less machines
        manager = dk.DeviceManager()
        rounds = timeit.repeat(dk.DeviceManager, number=20, repeat=7)
    construct_ms = statistics.median(rounds) / 20 * 1e3
    print(f"import torch                      {torch_ms:8.1f} ms")
    print(f"import devicekit, after torch     {added_ms:8.1f} ms   (target <= 30 ms)")
    print(f"DeviceManager()                   {construct_ms:8.2f} ms   (selected {manager.device})")


if __name__ == "__main__":
    main()
