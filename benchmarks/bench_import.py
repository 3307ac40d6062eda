"""What ``import devicekit`` adds over ``import torch``, and what ``DeviceManager()`` costs.

Run ``python benchmarks/bench_import.py``. Each import is timed in a fresh interpreter
(torch imported first, then devicekit, timed inside the process), with bytecode caches
written once before, as an installed package has them. Target: at most 30 ms added on
import, less the full garbage collections of torch's objects that fall inside it. CI runs
it (``.ci/run``); tests/test_import.py checks, deterministically, that nothing of
torch.compile's machinery is imported with devicekit.
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

# The time of the import, and of the full garbage collections made during it: a pass over
# every object torch made (100-150 ms on the CI machine) falls inside whichever import
# allocates past Python's threshold next. It is torch's, paid at start-up with or without
# devicekit, and where it falls moves with a few allocations more or less.
TIME_IMPORT = """
import gc, time
import torch
full = []
def timed(phase, info):
    if info["generation"] == 2:
        full.append(time.perf_counter() if phase == "start" else -time.perf_counter())
gc.callbacks.append(timed)
start = time.perf_counter()
import devicekit
took = time.perf_counter() - start
print(took, -sum(full) if len(full) % 2 == 0 else 0.0)
"""
TIME_TORCH = (
    "import time; start = time.perf_counter(); import torch; print(time.perf_counter() - start)"
)


# With bytecode caches, as a user's machine has them: without (PYTHONDONTWRITEBYTECODE,
# set on some CI machines), every import compiles devicekit's sources, 40-50 ms more.
_ENVIRONMENT = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _sample(code: str) -> list[float]:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=_ENVIRONMENT,
    )
    return [float(figure) for figure in result.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=15, help="fresh interpreters per figure")
    args = parser.parse_args()
    _sample(TIME_IMPORT)  # writes the bytecode caches the samples then read
    torch_ms = statistics.median(_sample(TIME_TORCH)[0] for _ in range(args.samples)) * 1e3
    samples = [_sample(TIME_IMPORT) for _ in range(args.samples)]
    added_ms = statistics.median(took for took, _ in samples) * 1e3
    own_ms = statistics.median(took - collecting for took, collecting in samples) * 1e3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback on GPU-less machines
        manager = dk.DeviceManager()
        rounds = timeit.repeat(dk.DeviceManager, number=20, repeat=7)
    construct_ms = statistics.median(rounds) / 20 * 1e3
    print(f"import torch                      {torch_ms:8.1f} ms")
    print(f"import devicekit, after torch     {added_ms:8.1f} ms")
    print(f"  less torch's full collections   {own_ms:8.1f} ms   (target <= 30 ms)")
    print(f"DeviceManager()                   {construct_ms:8.2f} ms   (selected {manager.device})")


if __name__ == "__main__":
    main()
