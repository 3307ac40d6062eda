"""What the checks cost where they used to cost most: long lists of scalars, large models.

Run ``python benchmarks/bench_checks.py`` (``--quick`` for a smoke run).

- ``find_devices`` on ``{"ids": list(range(10**6)), "x": tensor}``, against ``to_device``
  of the same batch: a list of scalars is one inert leaf to both, so the check costs
  about what the move does. Target: at most 2x ``to_device``.
- ``find_unmoved`` on a model of 1,000 modules (a plain ``nn.Sequential`` of
  ``Linear``/``ReLU`` pairs): one walk of every module's attributes. Target: at most
  100 ms here, "well under a second" for any model.
- ``guard(model)``: installing it walks the model once for what ``Module.to()`` left
  behind; a forward under it only compares, so it costs what ``bench_guard.py`` measures
  (here beside the same forward without a guard).
- ``find_unmoved`` on a module holding a list 3,000 deep with a tensor at each level:
  the walk keeps its own stack and links its routes, so depth costs time in proportion
  (the paths returned, one per tensor, are the only quadratic part); it once raised
  RecursionError. Target: well under a second.
- ``track_transfers()`` around a step of 200 small aten ops and 2 copies to ``meta``,
  beside the same step bare: a dispatch mode costs each op a Python call; the copies'
  checks (pinned, layout, where in user code) are paid by the copies alone.

Rounds alternate between the things compared, so drift in the machine's speed reaches
them alike; the figures are medians.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from typing import Any

import torch
from torch import nn

import devicekit as dk

META = torch.device("meta")


def _median_s(call: Any, number: int, rounds: int) -> float:
    return statistics.median(timeit.repeat(call, number=number, repeat=rounds)) / number


def long_scalar_list(length: int) -> dict[str, Any]:
    """A batch with a long list of plain ints beside a tensor (ids, token counts)."""
    return {"ids": list(range(length)), "x": torch.ones(4)}


def deep_chain(depth: int) -> nn.Module:
    """A layer holding ``[t, [t, [... [t] ...]]]``, ``depth`` lists deep, in a plain attribute."""
    chain: list[Any] = [torch.ones(1)]
    for _ in range(depth - 1):
        chain = [torch.ones(1), chain]
    layer = nn.Linear(2, 2)
    layer.chain = chain
    return layer


def thousand_modules(pairs: int = 500) -> nn.Module:
    """``pairs`` Linear/ReLU pairs, each in its own Sequential: 2 * pairs + pairs + 1 modules."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(pairs)])


def small_step(x: torch.Tensor) -> None:
    """200 small aten ops and 2 copies to meta: the host's side of a tiny training step."""
    y = x
    for _ in range(100):
        y = (y + 1) * 0.5
    y.to(META, non_blocking=True)
    x.to(META)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller inputs")
    args = parser.parse_args()
    rounds = 3 if args.quick else 9
    torch.set_num_threads(1)

    batch = long_scalar_list(10**4 if args.quick else 10**6)
    moves, checks = [], []
    for _ in range(rounds):
        moves.append(_median_s(lambda: dk.to_device(batch, META), 1, 1))
        checks.append(_median_s(lambda: dk.find_devices(batch), 1, 1))
    move_ms, check_ms = statistics.median(moves) * 1e3, statistics.median(checks) * 1e3
    print(f"list of {len(batch['ids'])} ints and a tensor:")
    print(f"  to_device(batch, 'meta')          {move_ms:9.2f} ms")
    print(
        f"  find_devices(batch)               {check_ms:9.2f} ms   "
        f"({check_ms / move_ms:.2f}x to_device; target <= 2x)"
    )

    model = thousand_modules(50 if args.quick else 500)
    count = sum(1 for _ in model.modules())
    walk_ms = _median_s(lambda: dk.find_unmoved(model), 1, rounds) * 1e3
    print(f"model of {count} modules:")
    print(f"  find_unmoved(model)               {walk_ms:9.2f} ms   (target <= 100 ms)")

    installs, guarded, plain = [], [], []
    x = torch.ones(1, 2)

    def install() -> None:
        with dk.guard(model):
            pass

    with torch.no_grad():
        for _ in range(rounds):
            installs.append(_median_s(install, 1, 1))
            with dk.guard(model):
                guarded.append(_median_s(lambda: model(x), 20, 1))
            plain.append(_median_s(lambda: model(x), 20, 1))
    install_ms = statistics.median(installs) * 1e3
    guarded_ms, plain_ms = statistics.median(guarded) * 1e3, statistics.median(plain) * 1e3
    print(f"  guard(model) installed            {install_ms:9.2f} ms   (walks the model once)")
    print(f"  forward, no guard                 {plain_ms:9.2f} ms")
    print(f"  forward, guard(model)             {guarded_ms:9.2f} ms   (compares, never walks)")

    deep = deep_chain(300 if args.quick else 3_000)
    deep_ms = _median_s(lambda: dk.find_unmoved(deep), 1, rounds) * 1e3
    print(f"module holding a list {len(dk.find_unmoved(deep)):,} deep, a tensor at each level:")
    print(f"  find_unmoved(module)              {deep_ms:9.2f} ms   (target well under 1 s)")

    bare, tracked = [], []
    x = torch.ones(8)

    def tracked_step() -> None:
        with dk.track_transfers():
            small_step(x)

    for _ in range(rounds):
        bare.append(_median_s(lambda: small_step(x), 20, 1))
        tracked.append(_median_s(tracked_step, 20, 1))
    bare_ms, tracked_ms = statistics.median(bare) * 1e3, statistics.median(tracked) * 1e3
    print("a step of 200 small ops and 2 copies to meta:")
    print(f"  bare                              {bare_ms:9.2f} ms")
    print(
        f"  under track_transfers()           {tracked_ms:9.2f} ms   "
        f"({(tracked_ms - bare_ms) / 202 * 1e3:.1f} us an op more)"
    )


if __name__ == "__main__":
    main()
