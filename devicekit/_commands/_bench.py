"""``devicekit bench``: what devicekit's transfers cost on this machine, in a few seconds.

The to_device overhead against the handwritten comprehension (nothing to move, and a
real move), and where an accelerator exists, host->device copies of many small
tensors and of one large batch: pageable, pinned, and packed by devicekit; then the
GB/s a large ``copy_`` reaches from pinned and from pageable memory, against what the
device's link carries where devicekit can read it (:func:`~devicekit._base.link_peak`).
"""

from __future__ import annotations

import functools
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import torch

from devicekit._base import HOST_TYPES, LinkPeak, available_devices, link_peak
from devicekit._core import to_device

__all__ = ["bench_report", "handwritten_per_image", "measure_bench", "per_image_batch"]


def per_image_batch(count: int = 64) -> list[dict[str, Any]]:
    """``count`` per-image dicts of 3 tensors and an id, as a detection collate makes."""
    return [
        {
            "image": torch.randn(3, 32, 32),
            "boxes": torch.randn(5, 4),
            "labels": torch.randint(0, 10, (5,)),
            "image_id": i,
        }
        for i in range(count)
    ]


def handwritten_per_image(batch: list[dict[str, Any]], device: torch.device) -> Any:
    """The comprehension people write for :func:`per_image_batch`."""
    return [
        {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in item.items()}
        for item in batch
    ]


def _median_us(fn: Callable[[], Any], *, rounds: int = 7, budget_s: float = 0.3) -> float:
    fn()
    once = timeit.timeit(fn, number=3) / 3
    number = max(1, int(budget_s / rounds / max(once, 1e-7)))
    return statistics.median(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _copies(device: torch.device) -> list[tuple[str, float, float, float]]:
    small = [torch.randn(1024) for _ in range(1000)]  # 1000 x 4 KiB
    large = torch.randn(16 << 20)  # 64 MiB
    rows = []
    for label, tensors in (("1000 x 4 KiB", small), ("1 x 64 MiB", [large])):
        pinned = [t.pin_memory() for t in tensors]

        def pageable(tensors: list[torch.Tensor] = tensors) -> None:
            [t.to(device, non_blocking=True) for t in tensors]
            _sync(device)

        def pinned_copies(pinned: list[torch.Tensor] = pinned) -> None:
            [t.to(device, non_blocking=True) for t in pinned]
            _sync(device)

        def packed(tensors: list[torch.Tensor] = tensors) -> None:
            to_device(tensors, device)
            _sync(device)

        rows.append((label, _median_us(pageable), _median_us(pinned_copies), _median_us(packed)))
    return rows


# One copy large enough that its fixed costs (the launch, the synchronize: about 20 us)
# are under 2% of it at an H100's 54.5 GB/s (1.2 ms), and small enough to time in a few
# rounds of the bench's seconds.
BANDWIDTH_BYTES = 64 << 20


def _host_to_device(device: torch.device) -> tuple[float, float]:
    """GB/s of one :data:`BANDWIDTH_BYTES` ``copy_`` to ``device``: from pinned, from pageable."""
    pageable = torch.ones(BANDWIDTH_BYTES, dtype=torch.uint8)  # written: its pages exist
    pinned = pageable.pin_memory()
    target = torch.empty_like(pageable, device=device)

    def copy(source: torch.Tensor) -> None:
        target.copy_(source, non_blocking=True)
        _sync(device)

    pinned_us = _median_us(functools.partial(copy, pinned))
    pageable_us = _median_us(functools.partial(copy, pageable))
    return BANDWIDTH_BYTES / pinned_us / 1e3, BANDWIDTH_BYTES / pageable_us / 1e3


def measure_bench() -> dict[str, Any]:
    """What ``devicekit bench`` measures, as ``bench --json`` prints it.

    ``to_device``: one row per target, the handwritten comprehension and to_device in
    microseconds and their ratio; ``copies``: the accelerator measured, one row per
    batch and ``host_to_device``, a large copy's GB/s (``pinned_gb_per_s``,
    ``pageable_gb_per_s``) and the device's ``link`` (``generation``, ``width``,
    ``gb_per_s``; None where unknown), or None without an accelerator; ``seconds``: how
    long measuring took.
    """
    start = time.perf_counter()
    batch = per_image_batch()
    to_device_rows = []
    for label, device in (
        ("cpu (nothing to move)", torch.device("cpu")),
        ("meta (a real move)", torch.device("meta")),
    ):
        hand = _median_us(functools.partial(handwritten_per_image, batch, device))
        ours = _median_us(functools.partial(to_device, batch, device))
        to_device_rows.append({"target": label, "handwritten_us": hand, "to_device_us": ours})
    accelerators = [name for name in available_devices() if name not in HOST_TYPES]
    copies = None
    if accelerators:
        device = torch.device(accelerators[0])
        rows = [
            {"what": label, "pageable_us": pageable, "pinned_us": pinned, "packed_us": packed}
            for label, pageable, pinned, packed in _copies(device)
        ]
        pinned_gb, pageable_gb = _host_to_device(device)
        link = link_peak(device)  # after the copies: CUDA has started, and names its GPU
        copies = {
            "device": str(device),
            "rows": rows,
            "host_to_device": {
                "bytes": BANDWIDTH_BYTES,
                "pinned_gb_per_s": pinned_gb,
                "pageable_gb_per_s": pageable_gb,
                "link": None if link is None else link._asdict(),
            },
        }
    return {"to_device": to_device_rows, "copies": copies, "seconds": time.perf_counter() - start}


def bench_report(measured: dict[str, Any]) -> list[str]:
    """The table ``devicekit bench`` prints for what :func:`measure_bench` returned."""
    lines = [
        "to_device vs the handwritten comprehension, 64 per-image dicts of 3 tensors",
        f"  {'target':<28} {'handwritten us':>15} {'to_device us':>13} {'ratio':>6}",
    ]
    for row in measured["to_device"]:
        hand, ours = row["handwritten_us"], row["to_device_us"]
        lines.append(f"  {row['target']:<28} {hand:>15.1f} {ours:>13.1f} {ours / hand:>6.2f}")
    copies = measured["copies"]
    if copies is not None:
        lines += [
            "",
            f"host -> {copies['device']} copies",
            f"  {'what':<16} {'pageable us':>12} {'pinned us':>10} {'packed us':>10}",
        ]
        lines += [
            f"  {row['what']:<16} {row['pageable_us']:>12.1f} {row['pinned_us']:>10.1f} "
            f"{row['packed_us']:>10.1f}"
            for row in copies["rows"]
        ]
        lines += ["", _bandwidth_line(copies["device"], copies["host_to_device"])]
    else:
        lines += ["", "No accelerator here: host -> device copies are not measured."]
    lines.append(f"({measured['seconds']:.1f} s)")
    return lines


def _bandwidth_line(device: str, measured: dict[str, Any]) -> str:
    """A large copy's GB/s, against the device's link where it is known.

    >>> link = {"generation": 5, "width": 16, "gb_per_s": 63.015}
    >>> _bandwidth_line("cuda:0", {"pinned_gb_per_s": 52.06, "pageable_gb_per_s": 11.3,
    ...                            "link": link})
    "host -> cuda:0: 52.1 GB/s pinned, 11.3 GB/s pageable, of the link's 63 GB/s (PCIe gen5 x16)"
    """
    line = (
        f"host -> {device}: {measured['pinned_gb_per_s']:.1f} GB/s pinned, "
        f"{measured['pageable_gb_per_s']:.1f} GB/s pageable"
    )
    if measured["link"] is None:
        return f"{line} (the link's peak is not known here)"
    link = LinkPeak(**measured["link"])
    return f"{line}, of the link's {link.rate} ({link.name})"
