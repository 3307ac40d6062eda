"""to_device against the handwritten comprehension and its peers, side by side in one run.

Run ``python benchmarks/bench_to_device.py`` (``--quick`` for a smoke run). Peers that
are not installed are skipped; ``pip install -e ".[bench]"`` installs them all.

Targets (docs/background/performance.rst): with nothing to move (target == current
device) <= 1.2x the handwritten comprehension; for a real move (cpu -> meta, and cpu ->
cuda where a GPU exists) <= 1.3x; faster than every peer on every workload. On a GPU,
1000 x 4 KiB tensors also go packed vs one non_blocking copy per tensor.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import timeit
from collections import namedtuple
from typing import TYPE_CHECKING, Any

import torch

import devicekit as dk
from devicekit._commands._bench import handwritten_per_image, per_image_batch

if TYPE_CHECKING:
    from collections.abc import Callable

Inputs = namedtuple("Inputs", ["input_ids", "attention_mask"])
Target = namedtuple("Target", ["boxes", "labels"])


def flat_dict() -> dict[str, torch.Tensor]:
    return {f"feature_{i}": torch.randn(16, 16) for i in range(8)}


def flat_list() -> list[torch.Tensor]:
    return [*flat_dict().values()]


def flat_tuple() -> tuple[torch.Tensor, ...]:
    return (*flat_dict().values(),)


def mixed_batch(targets: int = 4) -> dict[str, Any]:
    """Namedtuples, lists, a tuple, None and strings around 5 + 2 x ``targets`` tensors."""
    return {
        "inputs": Inputs(torch.randint(0, 100, (8, 32)), torch.ones(8, 32, dtype=torch.bool)),
        "targets": [Target(torch.randn(3, 4), torch.tensor([1, 2, 3])) for _ in range(targets)],
        "pixel_values": torch.randn(8, 3, 16, 16),
        "names": ["a", "b", "c", "d"],
        "weights": None,
        "extra": (torch.zeros(8), {"split": "train", "lengths": torch.arange(8)}),
    }


def handwritten_flat(batch: dict[str, torch.Tensor], device: torch.device) -> Any:
    return {key: value.to(device) for key, value in batch.items()}


def handwritten_flat_list(batch: list[torch.Tensor], device: torch.device) -> Any:
    return [value.to(device) for value in batch]


def handwritten_flat_tuple(batch: tuple[torch.Tensor, ...], device: torch.device) -> Any:
    # A list comprehension made a tuple: a generator inside tuple() is slower.
    return tuple([value.to(device) for value in batch])


def handwritten_mixed(batch: dict[str, Any], device: torch.device) -> Any:
    extra, extra_meta = batch["extra"]
    return {
        "inputs": Inputs(*(t.to(device) for t in batch["inputs"])),
        "targets": [Target(t.boxes.to(device), t.labels.to(device)) for t in batch["targets"]],
        "pixel_values": batch["pixel_values"].to(device),
        "names": list(batch["names"]),
        "weights": batch["weights"],
        "extra": (
            extra.to(device),
            {"split": extra_meta["split"], "lengths": extra_meta["lengths"].to(device)},
        ),
    }


def per_tensor_loop(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """The loop a GPU target is measured against: ``.to()`` on every tensor of the batch.

    The batch is taken apart and rebuilt by plain recursion over dicts, namedtuples,
    lists and tuples.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking) if non_blocking else batch.to(device)
    if isinstance(batch, dict):
        return {
            key: per_tensor_loop(value, device, non_blocking=non_blocking)
            for key, value in batch.items()
        }
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(
            *(per_tensor_loop(value, device, non_blocking=non_blocking) for value in batch)
        )
    if isinstance(batch, list | tuple):
        return type(batch)(
            per_tensor_loop(value, device, non_blocking=non_blocking) for value in batch
        )
    return batch


WORKLOADS: dict[str, tuple[Callable[[], Any], Callable[[Any, torch.device], Any]]] = {
    "flat dict of 8": (flat_dict, handwritten_flat),
    "flat list of 8": (flat_list, handwritten_flat_list),
    "flat tuple of 8": (flat_tuple, handwritten_flat_tuple),
    "64 per-image dicts": (per_image_batch, handwritten_per_image),
    "mixed nested batch": (mixed_batch, handwritten_mixed),
}


def _move_leaf(device: torch.device) -> Callable[[Any], Any]:
    return lambda x: x.to(device) if isinstance(x, torch.Tensor) else x


def peers() -> dict[str, Callable[[Any, torch.device], Any]]:
    """The peers that are installed, each as ``fn(batch, device)``."""
    found: dict[str, Callable[[Any, torch.device], Any]] = {}
    try:
        from accelerate.utils import send_to_device

        found["accelerate.send_to_device"] = send_to_device
    except ImportError:
        pass
    try:
        from lightning_fabric.utilities.apply_func import move_data_to_device

        found["lightning move_data_to_device"] = move_data_to_device
    except ImportError:
        pass
    try:
        from ignite.utils import convert_tensor

        found["ignite convert_tensor"] = convert_tensor
    except ImportError:
        pass
    from torch.utils import _pytree

    found["torch _pytree.tree_map"] = lambda b, d: _pytree.tree_map(_move_leaf(d), b)
    try:
        import optree

        found["optree.tree_map"] = lambda b, d: optree.tree_map(_move_leaf(d), b, none_is_leaf=True)
    except ImportError:
        pass
    return found


def race(
    contenders: dict[str, Callable[[], Any]], repeat: int, budget_s: float
) -> dict[str, float]:
    """Median microseconds per call of each contender, timed in interleaved rounds.

    Each round times every contender once, so drift in the machine's speed during the
    run (other load, frequency changes) reaches all of them alike and the ratios hold.
    """
    numbers = {}
    for name, fn in contenders.items():
        fn()  # warm caches (per-type decisions, allocator) before timing
        once = timeit.timeit(fn, number=5) / 5
        numbers[name] = max(1, int(budget_s / repeat / len(contenders) / max(once, 1e-7)))
    rounds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, fn in contenders.items():
            took = timeit.timeit(fn, number=numbers[name])
            rounds[name].append(took / numbers[name] * 1e6)
    return {name: statistics.median(times) for name, times in rounds.items()}


def compare(device: torch.device, label: str, repeat: int, budget_s: float) -> list[str]:
    rows = [f"\n{label}", f"{'workload':<20} {'contender':<32} {'median us':>10} {'x hand':>7}"]
    movers = {"handwritten": None, "devicekit.to_device": dk.to_device, **peers()}
    for workload, (make, handwritten) in WORKLOADS.items():
        batch = make()
        contenders = {
            name: functools.partial(move or handwritten, batch, device)
            for name, move in movers.items()
        }
        refused = {}
        for name, contender in list(contenders.items()):
            try:
                contender()
            except TypeError as error:  # noqa: PERF203 - once per peer; ignite takes tensors, dicts and lists alone
                refused[name] = str(error)
                del contenders[name]
        medians = race(contenders, repeat, budget_s)
        hand = medians["handwritten"]
        for name, took in medians.items():
            rows.append(f"{workload:<20} {name:<32} {took:>10.1f} {took / hand:>7.2f}")
        rows += [f"{workload:<20} {name:<32} refuses: {why}" for name, why in refused.items()]
    return rows


def packed_vs_per_tensor(device: torch.device, repeat: int, budget_s: float) -> list[str]:
    leaves = [torch.randn(1024) for _ in range(1000)]  # 1000 x 4 KiB

    def per_tensor() -> None:
        [leaf.to(device, non_blocking=True) for leaf in leaves]
        torch.cuda.synchronize(device)

    def packed() -> None:
        dk.to_device(leaves, device)
        torch.cuda.synchronize(device)

    medians = race({"per tensor": per_tensor, "packed": packed}, repeat, budget_s)
    one_by_one, together = medians["per tensor"], medians["packed"]
    return [
        f"\n1000 x 4 KiB host tensors -> {device}",
        f"per-tensor non_blocking copies {one_by_one:>10.1f} us",
        (
            f"devicekit packed copy          {together:>10.1f} us"
            f"   ({one_by_one / together:.1f}x faster)"
        ),
    ]


def no_tensors(repeat: int) -> list[str]:
    """A container without tensors (token ids) against copying it: target <= 3x."""
    ids = list(range(1_000_000))
    medians = race(
        {"list()": lambda: list(ids), "to_device": lambda: dk.to_device({"ids": ids}, "cpu")},
        repeat,
        0.5,
    )
    ratio = medians["to_device"] / medians["list()"]
    return [
        "\n1,000,000 ints, no tensor",
        (
            f"list() {medians['list()'] / 1e3:8.2f} ms   "
            f"to_device {medians['to_device'] / 1e3:8.2f} ms   ({ratio:.1f}x; target <= 3)"
        ),
    ]


def skip_keys(device: torch.device, repeat: int) -> list[str]:
    """A call with ``skip_keys`` against the same call without: target <= 1.5x."""
    batch = {"input_ids": torch.ones(8, 4), "mask": torch.ones(8, 4), "raw": ["x"] * 8, "n": 3}
    medians = race(
        {
            "plain": lambda: dk.to_device(batch, device),
            "skip_keys": lambda: dk.to_device(batch, device, skip_keys="raw"),
        },
        repeat,
        0.5,
    )
    ratio = medians["skip_keys"] / medians["plain"]
    return [
        f"\nskip_keys, a 4-key batch -> {device}",
        (
            f"plain {medians['plain']:8.2f} us   skip_keys {medians['skip_keys']:8.2f} us   "
            f"({ratio:.2f}x; target <= 1.5)"
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    repeat, budget = (3, 0.05) if args.quick else (21, 6.0)
    torch.set_num_threads(1)  # allocation and copy costs without thread-pool noise
    print(f"torch {torch.__version__}, devicekit {dk.__version__}")
    rows = compare(torch.device("cpu"), "nothing to move (cpu -> cpu)", repeat, budget)
    rows += compare(torch.device("meta"), "real move (cpu -> meta)", repeat, budget)
    rows += no_tensors(repeat)
    rows += skip_keys(torch.device("cpu"), repeat) + skip_keys(torch.device("meta"), repeat)
    if torch.cuda.is_available():
        cuda = torch.device("cuda", torch.cuda.current_device())
        rows += compare(cuda, f"real move (cpu -> {cuda})", repeat, budget)
        rows += packed_vs_per_tensor(cuda, repeat, budget)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
