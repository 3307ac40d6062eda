"""The figure of guide/waiting-for-data, made from a real run on the machine building the docs.

The demo's model trains through a DeviceDataLoader twice, on the CPU: once on data
that is ready in memory, once on data whose every batch takes 30 ms more to load (the
demo's ``--slow-data``). Each run's per-batch wait and step times, as ``loader.stats``
gives them, are drawn side by side and written to a CSV file; the verdicts are written
for the page to include. conf.py calls :func:`write` before the build reads the pages.
"""

from __future__ import annotations

import csv
from typing import TYPE_CHECKING

import matplotlib as mpl

mpl.use("Agg")  # no display on a build machine
import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils.data import DataLoader

import devicekit as dk
from devicekit._commands._demo import SmallCNN, _slowly, synthetic_images

if TYPE_CHECKING:
    from pathlib import Path

BATCHES = 24
RUNS = {"ready in memory": False, "slow to load (--slow-data)": True}


def measure(*, slow_data: bool) -> dk.LoaderStats:
    """One epoch of the demo's loop on the CPU, and what its loader measured."""
    torch.manual_seed(0)
    images = DataLoader(
        synthetic_images(64 * BATCHES), batch_size=64, collate_fn=_slowly if slow_data else None
    )
    loader = dk.DeviceDataLoader(images, "cpu")
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for inputs, labels in loader:
        loss = nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loader.stats


def write(out: Path) -> None:
    """The figure, the per-batch CSV and the verdicts, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stats = {name: measure(slow_data=slow) for name, slow in RUNS.items()}
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True, layout="constrained")
    for ax, (name, run) in zip(axes, stats.items(), strict=True):
        batches = range(1, run.batches + 1)
        waits = [1e3 * s for s in run.wait_per_batch]
        steps = [1e3 * s for s in run.step_per_batch]
        ax.bar(batches, waits, color="#d95f02", label="waiting for the batch")
        ax.bar(batches, steps, bottom=waits, color="#1b9e77", label="the step")
        ax.set_title(f"Data {name}: {run.wait_fraction:.0%} waiting", fontsize=10)
        ax.set_xlabel("batch")
    axes[0].set_ylabel("ms")
    axes[0].legend(loc="upper right", fontsize=8)
    figure.savefig(out / "waiting-for-data.svg")
    plt.close(figure)

    with (out / "waiting-for-data.csv").open("w", newline="") as file:
        rows = csv.writer(file)
        rows.writerow(["run", "batch", "wait_s", "step_s"])
        for name, run in stats.items():
            for index, (wait, step) in enumerate(
                zip(run.wait_per_batch, run.step_per_batch, strict=True), start=1
            ):
                rows.writerow([name, index, f"{wait:.6f}", f"{step:.6f}"])
    verdicts = [f"{name}:\n    {run.verdict}\n" for name, run in stats.items()]
    (out / "waiting-for-data.txt").write_text("\n".join(verdicts))
