"""The host-side work of a packed transfer, measured on any machine, GPU or not.

Run ``python benchmarks/bench_host_side.py`` (``--quick`` for a smoke run).

A packed host->device transfer is host work (walking the batch, grouping its small
tensors, gathering them into a staging buffer, making the device pieces, rebuilding
the containers) around copies that the DMA engine does. Everything but the copies
runs here with ``meta`` standing in for the accelerator (``as_accelerator("meta")``): a
copy to meta allocates nothing and moves no bytes, so what is timed is the host work.

Budget. On the H100 machine of the project's cost model one host->device copy of a
small tensor costs 7.6 us of host time. A transfer's host time there is modelled as its
host work plus 7.6 us per copy launched: one per tensor for the handwritten loop
(``.to(device, non_blocking=True)`` per tensor), one per chunk and per tensor sent
alone for devicekit. The targets ask devicekit to be >= 3x faster than the handwritten
loop on 1000 x 4 KiB, >= 2x on 64 per-image dicts of 3 tensors, and never slower.

Machines differ, so the host work timed here is converted to the H100 host's through
two primitives timed in the same run, whose H100 costs the model lists: ``torch.cat``
into a preallocated buffer (0.52 us per tensor) and ``torch.split`` (0.83 us per
piece). The copies to meta are timed and taken out: on a GPU they are the 7.6 us copies.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_to_device import WORKLOADS as TRANSFER_WORKLOADS
from bench_to_device import per_tensor_loop

import devicekit as dk
from devicekit._commands._bench import handwritten_per_image, per_image_batch
from devicekit._core import _packing
from devicekit._core._packing import CHUNK_BYTES
from devicekit._core._transfer import as_accelerator
from devicekit._core._tree import flatten

if TYPE_CHECKING:
    from collections.abc import Callable

H100_COPY_US = 7.6  # one small host->device copy, per tensor
MOVERS = ("devicekit", "its copies", "loop", "hand", "their copies")
H100_CAT_US = 0.52  # torch.cat(..., out=) per tensor
H100_SPLIT_US = 0.83  # torch.split per piece
META = torch.device("meta")


def _per_tensor(batch: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [tensor.to(device) for tensor in batch]  # the copy's own cost is taken out


WORKLOADS: dict[str, tuple[Callable[[], Any], Callable[[Any, torch.device], Any], float]] = {
    # name: (batch, the handwritten move, the speed-up over it that the targets ask for)
    "1000 x 4 KiB": (lambda: [torch.randn(1024) for _ in range(1000)], _per_tensor, 3.0),
    "64 per-image dicts": (per_image_batch, handwritten_per_image, 2.0),
    "flat dict of 8": (*TRANSFER_WORKLOADS["flat dict of 8"], 1.0),
    "mixed nested batch": (*TRANSFER_WORKLOADS["mixed nested batch"], 1.0),
}


def _best_us(fn: Callable[[], Any], number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e6


_REFERENCE = [torch.randn(1024) for _ in range(1000)]
_BUFFER = torch.empty(1024 * 1000)


def machine_speed() -> tuple[float, float]:
    """This machine's cat and split costs, in us per tensor."""
    cat = _best_us(lambda: torch.cat(_REFERENCE, out=_BUFFER), 20) / 1000
    split = _best_us(lambda: _BUFFER.split(1024), 20) / 1000
    return cat, split


def copies_of(batch: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The batch's distinct tensors, what devicekit copies, and how many go packed.

    What devicekit copies is a stand-in per chunk and each tensor sent alone.
    """
    tensors = {id(leaf): leaf for leaf in flatten(batch).leaves if type(leaf) is torch.Tensor}
    moved = _packing.pack(tensors.values(), META, non_blocking=True, pin=False)
    chunks = {piece.untyped_storage()._cdata: piece for piece in moved.values()}
    alone = [tensor for key, tensor in tensors.items() if key not in moved]
    stand_ins = [torch.empty(CHUNK_BYTES, dtype=torch.uint8) for _ in chunks]
    return list(tensors.values()), alone + stand_ins, len(moved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    repeat = 3 if args.quick else 25
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, devicekit {dk.__version__}")
    rows = [
        (
            f"{'workload':<20} {'tensors':>7} {'packed':>6} {'chunks':>6} {'est us':>8} "
            f"{'loop us':>8} {'vs loop':>8} {'hand us':>8} {'vs hand':>8} {'target':>6}"
        )
    ]
    speeds: list[tuple[float, float]] = []
    with as_accelerator("meta"):
        for name, (make, handwritten, target) in WORKLOADS.items():
            batch = make()
            tensors, launched, packed = copies_of(batch)
            chunks = len(launched) - (len(tensors) - packed)
            number = max(20, 4000 // len(tensors))  # a few ms per measurement
            timed: dict[str, list[float]] = {key: [] for key in MOVERS}
            movers = {
                "devicekit": lambda b=batch: dk.to_device(b, META),
                "its copies": lambda c=launched: [t.to(META, non_blocking=True) for t in c],
                "loop": lambda b=batch: per_tensor_loop(b, META),
                "hand": lambda b=batch, h=handwritten: h(b, META),
                "their copies": lambda c=tensors: [t.to(META) for t in c],
            }
            for _ in range(repeat):  # interleaved: each round times every piece once
                for key, mover in movers.items():
                    timed[key].append(_best_us(mover, number))
                speeds.append(machine_speed())
            # The fastest of each: noise on a shared machine only ever adds time. Host
            # work is each mover's time less that of its own copies, made alone.
            best = {key: min(times) for key, times in timed.items()}
            cat, split = (min(s[i] for s in speeds) for i in range(2))
            scale = (H100_CAT_US + H100_SPLIT_US) / (cat + split)
            host = best["devicekit"] - best["its copies"]
            estimate = host * scale + len(launched) * H100_COPY_US
            hand, loop = (
                (best[key] - best["their copies"]) * scale + len(tensors) * H100_COPY_US
                for key in ("hand", "loop")
            )
            mark = "ok" if loop / estimate >= target else "MISSED"
            rows.append(
                f"{name:<20} {len(tensors):>7} {packed:>6} {chunks:>6} {estimate:>8.1f} "
                f"{loop:>8.1f} {loop / estimate:>7.2f}x {hand:>8.1f} {hand / estimate:>7.2f}x "
                f"{target:>5.1f}x {mark}"
            )
    cat, split = (min(s[i] for s in speeds) for i in range(2))
    scale = (H100_CAT_US + H100_SPLIT_US) / (cat + split)
    print(
        f"this machine: cat {cat:.3f} us/tensor, split {split:.3f} us/piece; "
        f"H100 host = {scale:.2f} x this machine"
    )
    print(
        "Modelled H100 us per call: host work timed here (copies taken out) on the H100 host, "
        "plus 7.6 us per copy.\nest: devicekit; loop: .to() per tensor by plain recursion (the "
        "GPU targets' baseline); hand: a comprehension written for the batch's structure."
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
