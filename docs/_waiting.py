"""The figure of guide/waiting-for-data, drawn from a committed measurement.

The demo's model trained through a DeviceDataLoader twice, on the CPU: once on a list
of batches ready in memory, once through a DataLoader whose every batch takes 30 ms
more to load (the demo's ``--slow-data``). Each epoch's per-batch wait and step times,
as ``loader.stats`` gave them, and the machine they were measured on, are in
``_data/waiting-for-data.json``. The build draws that file, never a run of its own:
every build draws the same figure whatever the machine and its load, so the page's
words about it stay true. The verdicts shown are the ones this build's code writes of
those figures.

``python docs/_waiting.py`` measures again and rewrites the file (about 5 s); conf.py
calls :func:`write` before the build reads the pages.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import matplotlib as mpl

mpl.use("Agg")  # no display on a build machine
import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils.data import DataLoader

import devicekit as dk
from devicekit._commands._demo import SmallCNN, _slowly, synthetic_images
from devicekit._loader import _stats

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DATA = Path(__file__).parent / "_data" / "waiting-for-data.json"
BATCHES = 24
RUNS = {"ready in memory": False, "slow to load (--slow-data)": True}
"""Batches made beforehand, in a list; a DataLoader whose every batch sleeps first."""
WAIT, STEP = "#d95f02", "#1b9e77"  # the bands picture's orange and green


class Run(NamedTuple):
    """One measured epoch: its name, its per-batch times in seconds, and its loader's setup."""

    name: str
    waits: tuple[float, ...]
    steps: tuple[float, ...]
    setup: _stats.Setup

    @property
    def stats(self) -> _stats.LoaderStats:
        """The epoch's stats as the loader sums them, with the verdict this build writes."""
        wait_s, step_s = sum(self.waits), sum(self.steps)
        stats = _stats.LoaderStats(
            batches=len(self.waits),
            wait_s=wait_s,
            step_s=step_s,
            elapsed_s=wait_s + step_s,
            wait_fraction=wait_s / (wait_s + step_s),
            wait_per_batch=self.waits,
            step_per_batch=self.steps,
            finished=True,
        )
        return dataclasses.replace(stats, verdict=_stats.verdict(stats, self.setup))


def measure() -> dict[str, Any]:
    """Both epochs of the demo's loop on the CPU, as the file stores them."""
    # One thread: on a small machine that other work shares, two threads contend for its
    # cores and a step's time swings tenfold (11 to 276 ms on 2 cores); one runs it steadily.
    threads, load_average = torch.get_num_threads(), os.getloadavg()[0]
    torch.set_num_threads(1)
    runs = []
    for name, slow in RUNS.items():
        torch.manual_seed(0)
        images = synthetic_images(64 * BATCHES)
        source: Any = (
            DataLoader(images, batch_size=64, collate_fn=_slowly)
            if slow
            else [(x, y) for x, y in zip(*(t.split(64) for t in images.tensors), strict=True)]
        )
        loader = dk.DeviceDataLoader(source, "cpu")
        model = SmallCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        for inputs, labels in loader:
            loss = nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        setup = loader._setup(ahead=False)  # what its verdict was judged on
        runs.append(
            {
                "name": name,
                "setup": {
                    "source": setup.source,
                    "num_workers": setup.num_workers,
                    "cpus": setup.cpus,
                },
                "wait_s": [round(s, 6) for s in loader.stats.wait_per_batch],
                "step_s": [round(s, 6) for s in loader.stats.step_per_batch],
                "verdict": loader.stats.verdict,
            }
        )
    torch.set_num_threads(threads)
    uname = platform.uname()
    return {
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": f"{uname.machine} {uname.system}",
            "torch": torch.__version__,
            "torch_threads": 1,
            "load_average": round(load_average, 1),  # other work on the machine, at the start
        },
        "command": "python docs/_waiting.py",
        "runs": runs,
    }


def load(path: Path = DATA) -> tuple[dict[str, Any], list[Run]]:
    """The file's record (when, where) and its epochs."""
    record = json.loads(path.read_text(encoding="utf-8"))
    runs = [
        Run(
            run["name"],
            tuple(run["wait_s"]),
            tuple(run["step_s"]),
            # On the CPU: nothing pinned, nothing copied ahead, no persistent workers.
            _stats.Setup(**run["setup"], persistent_workers=False, pinned=False, accelerator=False),
        )
        for run in record["runs"]
    ]
    return record, runs


def draw(runs: list[Run]) -> Figure:
    """The two epochs side by side, a bar per batch: each batch's wait under its step."""
    shape, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True, layout="constrained")
    for ax, run in zip(axes, runs, strict=True):
        batches = range(1, len(run.waits) + 1)
        waits = [1e3 * s for s in run.waits]
        steps = [1e3 * s for s in run.steps]
        ax.bar(batches, waits, color=WAIT, label="waiting for the batch")
        ax.bar(batches, steps, bottom=waits, color=STEP, label="the step")
        ax.set_title(f"Data {run.name}: {run.stats.wait_fraction:.0%} waiting", fontsize=10)
        ax.set_xlabel("batch")
    axes[0].set_ylabel("ms")
    # Above both panels, outside them: over no bar.
    shape.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncols=2)
    return shape


def figure(runs: list[Run]) -> str:
    """:func:`draw` as SVG text that depends on the runs alone: the same bytes every build.

    matplotlib salts its clip-path ids with a random value and dates the file, unless told.
    """
    with mpl.rc_context({"svg.hashsalt": "waiting-for-data"}):
        shape = draw(runs)
        text = io.StringIO()
        shape.savefig(text, format="svg", metadata={"Date": None})
        plt.close(shape)
    return text.getvalue()


def write(out: Path, path: Path = DATA) -> None:
    """The figure, the per-batch CSV and the verdicts, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    _, runs = load(path)
    (out / "waiting-for-data.svg").write_text(figure(runs), encoding="utf-8")
    with (out / "waiting-for-data.csv").open("w", newline="", encoding="utf-8") as file:
        rows = csv.writer(file)
        rows.writerow(["run", "batch", "wait_s", "step_s"])
        for run in runs:
            for index, (wait, step) in enumerate(zip(run.waits, run.steps, strict=True), start=1):
                rows.writerow([run.name, index, f"{wait:.6f}", f"{step:.6f}"])
    verdicts = [f"{run.name}:\n    {run.stats.verdict}\n" for run in runs]
    (out / "waiting-for-data.txt").write_text("\n".join(verdicts), encoding="utf-8")


if __name__ == "__main__":
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(measure(), indent=1) + "\n", encoding="utf-8")
    print(*(f"{run.name}: {run.stats.verdict}" for run in load()[1]), sep="\n")
