"""What each devicekit piece adds to a step of a loop of tiny steps, on the CPU.

Run ``python benchmarks/bench_tiny_steps.py`` (``--quick`` for a smoke run). The loop is
PyTorch's regression example (``examples/regression/main.py`` in pytorch/examples): a
``Linear(4, 1)`` fitted to a polynomial, a fresh random batch of 32 each step, SGD
written out, a step of 100-400 us. The plain loop is timed beside the same loop with one
devicekit piece added at a time, then with all of them as the documentation teaches:

- ``to_device(batch, device)`` on each batch;
- ``DeviceDataLoader`` over the generator of batches (``prefetch`` 1, its default, and 0);
- ``guard(model)`` around the loop;
- ``with manager:`` around the loop;
- ``current_device()`` read each step, where the batch is made;
- all together: ``with manager:``, ``to_device(model)``, ``guard(model)``, and a
  ``DeviceDataLoader`` over batches made on ``current_device()``.

Two tables. The first is the whole step, from one step's start to the next: what a
script sees, a piece's cost taken as the median over rounds of its loop's time less the
plain loop's, each variant run right beside a plain loop, first or second by turns.
PyTorch's step varies by tens of microseconds, so these figures are good to a few at
best; the second table is the one to compare versions of devicekit by.

The second is devicekit's own time, timed where it runs, inside the loop: the call of
``to_device`` or ``current_device``, the loader's ``next()`` less the generator's own
work, the guarded forward call less the plain loop's, and what a loop pays once
(entering ``with``, installing the guard, starting the epoch) spread over its steps.
Beside it, the same calls timed alone, over and over, as micro-benchmarks time them.
In a loop they cost several times more: PyTorch's step, between two of them, leaves
little of devicekit's code or data in the processor's caches. Absolute figures move by
a third from one process to the next on a shared machine: compare versions over several
runs of each, in turn.

``--calls`` adds a third table: each call a piece makes (the loader's ``next()``, a
forward under ``guard`` and with a pre-hook that does nothing, ...), timed right after a
real step and alone, so that what is PyTorch's own (its dispatch of any forward pre-hook)
stands beside what is devicekit's.

The garbage collector is off while a loop runs, as in timeit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import timeit
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812 (as PyTorch's example writes it)
from torch import nn

import devicekit as dk

DEGREE = 4
BATCH = 32
CPU = torch.device("cpu")
clock = time.perf_counter_ns


def _targets() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(DEGREE, 1, generator=generator) * 5, torch.randn(1, generator=generator) * 5


W_TARGET, B_TARGET = _targets()


def make_features(x: torch.Tensor) -> torch.Tensor:
    """The matrix with columns ``x, x^2, x^3, x^4``, as PyTorch's example builds it."""
    x = x.unsqueeze(1)
    return torch.cat([x**i for i in range(1, DEGREE + 1)], 1)


def f(x: torch.Tensor) -> torch.Tensor:
    """The function the model approximates."""
    return x.mm(W_TARGET.to(x.device)) + B_TARGET.item()


def get_batch(device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch of ``BATCH`` pairs ``(x, f(x))``, made on ``device``."""
    random = torch.randn(BATCH, device=device)
    x = make_features(random)
    return x, f(x)


class _Log:
    """What one loop records, in nanoseconds."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # each step's start
        self.forwards: list[int] = []  # each forward call
        self.made: list[int] = []  # the generator's own work on each batch
        self.own: list[int] = []  # devicekit's calls in each step
        self.once = 0  # devicekit's calls made once a loop


log = _Log()


def batches(steps: int, device: Callable[[], torch.device] | None = None) -> Iterator[Any]:
    """``steps`` batches, each made on ``device()`` where given (that call is timed)."""
    for _ in range(steps):
        start = clock()
        where = None if device is None else device()
        asked = clock()
        batch = get_batch(where)
        log.made.append(clock() - asked)
        if device is not None:
            log.own.append(asked - start)
        yield batch


def step(model: nn.Module, batch_x: torch.Tensor, batch_y: torch.Tensor) -> float:
    """One step of the example: zero the grads, the loss, backward, SGD by hand."""
    log.starts.append(clock())
    model.zero_grad()
    start = clock()
    prediction = model(batch_x)
    log.forwards.append(clock() - start)
    output = F.smooth_l1_loss(prediction, batch_y)
    loss = output.item()
    output.backward()
    for param in model.parameters():
        param.data.add_(-0.1 * param.grad)
    return loss


def _next(batches: Iterator[Any]) -> Any:
    """The next batch, noting the time ``next()`` took beyond the generator's own work."""
    made = len(log.made)
    start = clock()
    batch = next(batches, None)
    took = clock() - start
    if batch is not None:
        own = took - sum(log.made[made:])
        if len(log.own) > made:  # current_device(), inside the generator: timed there
            log.own[-1] += own
        else:
            log.own.append(own)
    return batch


# Each variant runs `steps` steps on the model and manager given and returns the last
# loss: the same in every variant, since each starts from the same seed.


def plain(model: nn.Module, manager: dk.DeviceManager, steps: int) -> float:
    loss = 0.0
    for _ in range(steps):
        batch_x, batch_y = get_batch()
        loss = step(model, batch_x, batch_y)
    return loss


def moved(model: nn.Module, manager: dk.DeviceManager, steps: int) -> float:
    loss = 0.0
    for _ in range(steps):
        batch = get_batch()
        start = clock()
        batch_x, batch_y = dk.to_device(batch, CPU)
        log.own.append(clock() - start)
        loss = step(model, batch_x, batch_y)
    return loss


def loader(prefetch: int) -> Callable[[nn.Module, dk.DeviceManager, int], float]:
    def loop(model: nn.Module, manager: dk.DeviceManager, steps: int) -> float:
        loss = 0.0
        start = clock()
        epoch = iter(dk.DeviceDataLoader(batches(steps), CPU, prefetch=prefetch))
        log.once += clock() - start
        while (batch := _next(epoch)) is not None:
            loss = step(model, *batch)
        return loss

    return loop


def _inside(
    block: contextlib.AbstractContextManager[object],
    model: nn.Module,
    manager: dk.DeviceManager,
    steps: int,
) -> float:
    """The plain loop inside ``block``; entering and leaving it count as once-only work."""
    start = clock()
    with block:
        log.once += clock() - start
        loss = plain(model, manager, steps)
        start = clock()
    log.once += clock() - start
    return loss


def guarded(model: nn.Module, manager: dk.DeviceManager, steps: int) -> float:
    return _inside(dk.guard(model), model, manager, steps)


def managed(model: nn.Module, manager: dk.DeviceManager, steps: int) -> float:
    return _inside(manager, model, manager, steps)


def current(model: nn.Module, manager: dk.DeviceManager, steps: int) -> float:
    loss = 0.0
    for _ in range(steps):
        start = clock()
        device = dk.current_device()
        log.own.append(clock() - start)
        batch_x, batch_y = get_batch(device)
        loss = step(model, batch_x, batch_y)
    return loss


def together(model: nn.Module, manager: dk.DeviceManager, steps: int) -> float:
    loss = 0.0
    start = clock()
    with manager:
        model = dk.to_device(model)
        with dk.guard(model):
            epoch = iter(dk.DeviceDataLoader(batches(steps, dk.current_device)))
            log.once += clock() - start
            while (batch := _next(epoch)) is not None:
                loss = step(model, *batch)
            start = clock()
    log.once += clock() - start
    return loss


VARIANTS: dict[str, Callable[[nn.Module, dk.DeviceManager, int], float]] = {
    "plain loop": plain,
    "to_device(batch, device)": moved,
    "DeviceDataLoader(prefetch=1)": loader(1),
    "DeviceDataLoader(prefetch=0)": loader(0),
    "guard(model)": guarded,
    "with manager:": managed,
    "current_device() per step": current,
    "all together, as the docs teach": together,
}
GUARDED = frozenset({"guard(model)", "all together, as the docs teach"})


class _Round(NamedTuple):
    period_us: float  # the median period from one step's start to the next
    forward_us: float  # the median forward call
    own_us: float  # the median of devicekit's calls a step, without the forward's share
    once_us: float  # devicekit's calls made once, over the steps
    loss: float


def _timed(name: str, manager: dk.DeviceManager, steps: int, seed: int) -> _Round:
    global log  # noqa: PLW0603 - one fresh log a loop, read by the loop's own functions
    torch.manual_seed(seed)
    model = nn.Linear(DEGREE, 1)
    log = _Log()
    enabled = gc.isenabled()
    gc.disable()
    try:
        loss = VARIANTS[name](model, manager, steps)
    finally:
        if enabled:
            gc.enable()
    periods = [(b - a) / 1e3 for a, b in zip(log.starts, log.starts[1:], strict=False)]
    return _Round(
        statistics.median(periods) if periods else 0.0,
        statistics.median(log.forwards) / 1e3,
        statistics.median(log.own) / 1e3 if log.own else 0.0,
        log.once / steps / 1e3,
        loss,
    )


class Row(NamedTuple):
    """One variant's figures, in microseconds per step."""

    name: str
    step_us: float
    """The median period from one step's start to the next, over the rounds."""
    added_us: float
    """The median over rounds of that period less the plain loop's beside it."""
    added_low_us: float
    """The lower quartile of those differences."""
    added_high_us: float
    """The upper quartile."""
    own_us: float
    """devicekit's own time in the loop a step (see the module's docstring)."""
    alone_us: float
    """The same calls timed alone, over and over, the fastest repeat (0 for the plain loop)."""
    loss: float
    """The last step's loss, the same in every variant."""


def measure(steps: int, rounds: int, only: Collection[str] = ()) -> list[Row]:
    """Every variant's figures over ``rounds`` rounds of ``steps`` steps each.

    In each round every variant runs right beside a plain loop, first or second by
    turns, and is compared with that one: the machine's speed drifts by 10-20% over a
    few tens of milliseconds here, more than most pieces cost.
    """
    with warnings.catch_warnings():
        # current_device() outside a block makes the process's manager, on the CPU here.
        warnings.filterwarnings("ignore", "devicekit uses the CPU", RuntimeWarning)
        return _measure(steps, rounds, only)


def _measure(steps: int, rounds: int, only: Collection[str]) -> list[Row]:
    manager = dk.DeviceManager("cpu")
    names = [name for name in VARIANTS if not only or name in only or name == "plain loop"]
    others = names[1:]
    paired: dict[str, list[tuple[_Round, _Round]]] = {name: [] for name in names}
    for name in names:  # a warm-up round: first calls build caches, import lazily
        _timed(name, manager, steps, seed=0)
    for number in range(rounds):
        shift = number % len(others) if others else 0
        for name in others[shift:] + others[:shift]:
            if number % 2:
                ours = _timed(name, manager, steps, seed=number)
                plain = _timed("plain loop", manager, steps, seed=number)
            else:
                plain = _timed("plain loop", manager, steps, seed=number)
                ours = _timed(name, manager, steps, seed=number)
            paired[name].append((ours, plain))
            paired["plain loop"].append((plain, plain))
    alone = pieces_alone(manager, steps, rounds)
    rows = []
    for name in names:
        added = sorted(ours.period_us - plain.period_us for ours, plain in paired[name])
        own = [
            ours.own_us
            + ours.once_us
            + (ours.forward_us - plain.forward_us if name in GUARDED else 0.0)
            for ours, plain in paired[name]
        ]
        rows.append(
            Row(
                name,
                statistics.median(ours.period_us for ours, _ in paired[name]),
                statistics.median(added),
                added[len(added) // 4],
                added[(3 * len(added)) // 4],
                statistics.median(own) if name != "plain loop" else 0.0,
                alone.get(name, 0.0),
                paired[name][-1][0].loss,
            )
        )
    return rows


def _alone_us(call: Callable[[], Any], rounds: int, number: int = 2000) -> float:
    # The fastest repeat: alone, noise only adds time.
    return min(timeit.repeat(call, number=number, repeat=rounds)) / number * 1e6


def pieces_alone(manager: dk.DeviceManager, steps: int, rounds: int) -> dict[str, float]:
    """The calls each variant adds, timed alone in tight loops (microseconds a step)."""
    rounds = max(3, min(rounds, 7))
    model = nn.Linear(DEGREE, 1)
    batch = get_batch()
    repeat = [batch] * 200

    def epoch(source: Callable[[], Any]) -> None:
        for _ in source():
            pass

    def plain_epoch() -> None:
        epoch(lambda: iter(repeat))

    def entered() -> None:
        with manager:
            pass

    with torch.no_grad():
        forward = _alone_us(lambda: model(batch[0]), rounds)
        with dk.guard(model):
            guard = _alone_us(lambda: model(batch[0]), rounds) - forward
    base = _alone_us(plain_epoch, rounds, 20) / len(repeat)
    per_batch = {
        prefetch: _alone_us(
            lambda prefetch=prefetch: epoch(
                lambda: dk.DeviceDataLoader(iter(repeat), CPU, prefetch=prefetch)
            ),
            rounds,
            20,
        )
        / len(repeat)
        - base
        for prefetch in (1, 0)
    }
    current = _alone_us(dk.current_device, rounds)
    with manager:
        current_in = _alone_us(dk.current_device, rounds)
    return {
        "to_device(batch, device)": _alone_us(lambda: dk.to_device(batch, CPU), rounds),
        "DeviceDataLoader(prefetch=1)": per_batch[1],
        "DeviceDataLoader(prefetch=0)": per_batch[0],
        "guard(model)": guard,
        "with manager:": _alone_us(entered, rounds) / steps,
        "current_device() per step": current,
        "all together, as the docs teach": per_batch[1] + guard + current_in,
    }


def report(rows: list[Row], steps: int, rounds: int) -> list[str]:
    """The two tables :func:`measure`'s rows print as."""
    lines = [
        (
            f"torch {torch.__version__}, devicekit {dk.__version__}, {steps} steps a loop, "
            f"{rounds} rounds; medians, us per step"
        ),
        "",
        "The whole step (what a script sees):",
        f"  {'variant':<34} {'step':>7} {'added':>7}   {'quartiles':<15}",
    ]
    for row in rows:
        spread = f"[{row.added_low_us:+.1f}, {row.added_high_us:+.1f}]"
        lines.append(f"  {row.name:<34} {row.step_us:>7.1f} {row.added_us:>+7.2f}   {spread}")
    lines += [
        "",
        "devicekit's own time, in the loop and alone:",
        f"  {'variant':<34} {'in the loop':>11} {'alone':>7} {'ratio':>6}",
    ]
    for row in rows[1:]:
        ratio = f"{row.own_us / row.alone_us:6.1f}" if row.alone_us > 0 else f"{'-':>6}"
        lines.append(f"  {row.name:<34} {row.own_us:>11.2f} {row.alone_us:>7.2f} {ratio}")
    return lines


def calls_after_a_step(count: int) -> list[tuple[str, float, float]]:
    """Each call the pieces make, timed right after a real step and alone (us, medians).

    After a step is where the loop makes them; alone, over and over, is how micro-
    benchmarks time them. The calls take turns, a step before each, so that drift in the
    machine's speed reaches them alike. A ``with manager:`` block is open throughout.
    """
    torch.manual_seed(0)
    model, hooked, guarded = nn.Linear(DEGREE, 1), nn.Linear(DEGREE, 1), nn.Linear(DEGREE, 1)
    hooked.register_forward_pre_hook(lambda module, args: None)
    fixed = get_batch()

    def forever() -> Iterator[Any]:
        while True:
            yield fixed

    manager = dk.DeviceManager("cpu")
    plain_epoch = forever()
    epochs = {p: iter(dk.DeviceDataLoader(forever(), CPU, prefetch=p)) for p in (1, 0)}

    def entered(batch: Any) -> None:
        with manager:
            pass

    calls: dict[str, Callable[[Any], Any]] = {
        "nothing (the clock's own cost)": lambda batch: None,
        "to_device(batch, device)": lambda batch: dk.to_device(batch, CPU),
        "next() of the plain generator": lambda batch: next(plain_epoch),
        "next() of a DeviceDataLoader epoch": lambda batch: next(epochs[1]),
        "  the same, prefetch=0": lambda batch: next(epochs[0]),
        "Linear(4, 1) forward": lambda batch: model(batch[0]),
        "  with a pre-hook doing nothing": lambda batch: hooked(batch[0]),
        "  under guard(model)": lambda batch: guarded(batch[0]),
        "current_device() in a with block": lambda batch: dk.current_device(),
        "entering and leaving with manager:": entered,
    }
    after: dict[str, list[int]] = {name: [] for name in calls}
    alone: dict[str, list[int]] = {name: [] for name in calls}
    enabled = gc.isenabled()
    gc.disable()
    try:
        with manager, dk.guard(guarded):
            for _ in range(count):
                for name, call in calls.items():
                    step(model, *get_batch())
                    batch = get_batch()
                    start = clock()
                    call(batch)
                    after[name].append(clock() - start)
            for name, call in calls.items():
                for _ in range(count):
                    start = clock()
                    call(fixed)
                    alone[name].append(clock() - start)
    finally:
        if enabled:
            gc.enable()
    return [
        (name, statistics.median(after[name]) / 1e3, statistics.median(alone[name]) / 1e3)
        for name in calls
    ]


def report_calls(rows: list[tuple[str, float, float]], count: int) -> list[str]:
    """The table :func:`calls_after_a_step`'s rows print as."""
    lines = [
        f"Each call right after a step and alone, us (medians of {count}):",
        f"  {'call':<40} {'after a step':>12} {'alone':>7}",
    ]
    lines += [f"  {name:<40} {after:>12.2f} {alone:>7.2f}" for name, after, alone in rows]
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--steps", type=int, help="steps in each timed loop (default 100)")
    parser.add_argument("--rounds", type=int, help="rounds (default 41)")
    parser.add_argument("--only", nargs="+", default=(), metavar="VARIANT", help="these only")
    parser.add_argument(
        "--calls", action="store_true", help="also time each call right after a step and alone"
    )
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; the variants are {list(VARIANTS)}")
    torch.set_num_threads(1)
    steps = args.steps or (5 if args.quick else 100)
    rounds = args.rounds or (2 if args.quick else 41)
    rows = measure(steps, rounds, args.only)
    print("\n".join(report(rows, steps, rounds)))
    if args.calls:
        count = 20 if args.quick else 3000
        print("\n" + "\n".join(report_calls(calls_after_a_step(count), count)))
    return rows


if __name__ == "__main__":
    main()
