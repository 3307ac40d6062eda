"""The loader's two pictures, drawn as plain SVG each time the docs are built.

- ``loader-timeline.svg`` (background/loader-pipeline): the pipeline in three lanes, the
  feed thread, the loader's side stream and the compute stream, over four steps, with
  the two waits that order them (an event before each step, a stream wait before each
  copy).
- ``verdict-bands.svg`` (guide/waiting-for-data): the share of an epoch spent waiting,
  cut into the verdict's three bands at :data:`devicekit._loader._stats.COMPUTE_BOUND`
  and :data:`devicekit._loader._stats.INPUT_BOUND`, with the sentence
  :func:`devicekit._loader._stats.verdict` writes in each band. The thresholds and the
  sentences are read from the code when the picture is drawn, so the picture cannot say
  other than it does. The causes the verdict names are the page's table, not the picture's.

Both are drawn from the code and constants alone: every build writes the same bytes.

Only the standard library draws them: no layout engine, so text is wrapped here at a
width in characters. conf.py calls :func:`write` before the build reads the pages.
"""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from devicekit._loader import _stats

if TYPE_CHECKING:
    from pathlib import Path

SVG = "http://www.w3.org/2000/svg"
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
CHAR_W = 0.56  # a character's mean width, in font sizes: where the text is wrapped

FEED, SIDE, COMPUTE = "feed thread", "side stream", "compute stream"
LANES = (FEED, SIDE, COMPUTE)
STEPS = 4  # steps n to n+3: enough for each wait to show twice

# The colours of guide/waiting-for-data's other figure: its "step" green, its "wait" orange.
GREEN, AMBER, ORANGE, BLUE, GREY = "#1b9e77", "#e6ab02", "#d95f02", "#7570b3", "#666666"
# The timeline's arrows, each a colour and a dash pattern: a batch handed on, then the two waits.
ARROWS = {"queue": (AMBER, "2 3"), "event": (ORANGE, ""), "order": (GREY, "5 3")}


def _svg(width: int, height: int, title: str) -> ET.Element:
    """An empty picture with its title (what a screen reader announces) and its arrowheads."""
    root = ET.Element(
        "svg",
        xmlns=SVG,
        width=str(width),
        height=str(height),
        viewBox=f"0 0 {width} {height}",
        role="img",
        attrib={"font-family": FONT, "font-size": "12"},
    )
    ET.SubElement(root, "title").text = title
    defs = ET.SubElement(root, "defs")
    for name, (colour, _) in ARROWS.items():
        marker = ET.SubElement(
            defs,
            "marker",
            id=f"head-{name}",
            viewBox="0 0 10 10",
            refX="9",
            refY="5",
            markerWidth="7",
            markerHeight="7",
            orient="auto-start-reverse",
        )
        ET.SubElement(marker, "path", d="M 0 0 L 10 5 L 0 10 z", fill=colour)
    ET.SubElement(root, "rect", width=str(width), height=str(height), fill="white")
    return root


def _text(
    parent: ET.Element,
    x: float,
    y: float,
    text: str,
    *,
    width: float | None = None,
    size: int = 12,
    anchor: str = "start",
    **style: str,
) -> ET.Element:
    """``text`` at (x, y), wrapped into lines of at most ``width`` pixels.

    ``style`` holds SVG attributes, an underscore for each hyphen (``font_weight``).
    """
    line_chars = max(8, int(width / (size * CHAR_W))) if width else len(text) or 1
    attributes = {name.replace("_", "-"): value for name, value in style.items()}
    element = ET.SubElement(
        parent,
        "text",
        x=f"{x:g}",
        y=f"{y:g}",
        attrib={"font-size": str(size), "text-anchor": anchor, **attributes},
    )
    for number, line in enumerate(textwrap.wrap(text, line_chars) or [""]):
        span = ET.SubElement(element, "tspan", x=f"{x:g}")
        span.set("dy", "0" if number == 0 else f"{1.25 * size:g}")
        span.text = line
    return element


def _box(
    parent: ET.Element, x: float, y: float, width: float, height: float, *, label: str, fill: str
) -> None:
    ET.SubElement(
        parent,
        "rect",
        x=f"{x:g}",
        y=f"{y:g}",
        width=f"{width:g}",
        height=f"{height:g}",
        rx="3",
        fill=fill,
        attrib={"fill-opacity": "0.85"},
    )
    _text(parent, x + width / 2, y + height / 2 + 4, label, anchor="middle", fill="white")


def _arrow(parent: ET.Element, x1: float, y1: float, x2: float, y2: float, *, kind: str) -> None:
    colour, dashes = ARROWS[kind]
    line = ET.SubElement(
        parent,
        "line",
        x1=f"{x1:g}",
        y1=f"{y1:g}",
        x2=f"{x2:g}",
        y2=f"{y2:g}",
        stroke=colour,
        attrib={
            "class": f"wait {kind}",
            "stroke-width": "1.6",
            "marker-end": f"url(#head-{kind})",
        },
    )
    if dashes:
        line.set("stroke-dasharray", dashes)


def timeline() -> str:
    """The loader's pipeline over four steps, in three lanes, as SVG text.

    In the time of step n, the feed thread reads and pins batch n+2 while the side stream
    copies batch n+1. Each step waits for its batch's copy (an event); each copy waits
    for the steps the loop queued before it came back for a batch (a stream wait).
    """
    left, slot, top, lane_h, gap = 140, 150, 44, 34, 34
    bottom = top + 3 * lane_h + 2 * gap
    width, height = left + STEPS * slot + 20, bottom + 96
    root = _svg(
        width,
        height,
        "The loader's pipeline: the feed thread pins batch n+2 while the side stream "
        "copies batch n+1 while the compute stream runs step n.",
    )
    # The three things that happen at once, framed: what the page's sentence says.
    ET.SubElement(
        root,
        "rect",
        x=str(left - 4),
        y=str(top - 26),
        width=str(slot + 6),
        height=f"{bottom - top + 32:g}",
        rx="6",
        fill="#f2f2f2",
        stroke="#bbbbbb",
    )
    _text(root, left + slot / 2, top - 10, "while step n runs", anchor="middle", fill=GREY)
    lane_y = {name: top + number * (lane_h + gap) for number, name in enumerate(LANES)}
    for name, y in lane_y.items():
        lane = ET.SubElement(root, "g", attrib={"class": "lane", "data-lane": name})
        _text(lane, 10, y + lane_h / 2 + 4, name, size=13, font_weight="bold")
        for k in range(STEPS):
            x = left + k * slot
            batch = "n" if k == 0 else f"n+{k}"
            if name == COMPUTE:
                _box(lane, x + 2, y, slot - 4, lane_h, label=f"step {batch}", fill=GREEN)
            elif name == SIDE:
                _box(lane, x + 2, y, 0.55 * slot, lane_h, label=f"copy n+{k + 1}", fill=BLUE)
            else:
                _box(lane, x + 2, y, 0.7 * slot, lane_h, label=f"read, pin n+{k + 2}", fill=AMBER)
    feed, side, compute = lane_y[FEED], lane_y[SIDE], lane_y[COMPUTE]
    waits = ET.SubElement(root, "g", attrib={"class": "waits"})
    for k in range(STEPS):
        start, boundary = left + k * slot, left + (k + 1) * slot
        if k + 1 < STEPS:
            # Batch n+k+2, pinned, waits in the feed's queue until its copy is issued.
            _arrow(
                waits, start + 2 + 0.7 * slot, feed + lane_h, boundary + 14, side - 1, kind="queue"
            )
            # Step n+k+1 reads batch n+k+1 only once its copy is done: an event.
            copied = start + 2 + 0.55 * slot
            _arrow(waits, copied, side + lane_h, boundary + 12, compute - 1, kind="event")
            # Copy n+k+2 may reuse memory that step n+k freed: it waits for that step.
            _arrow(waits, boundary - 5, compute, boundary - 5, side + lane_h + 1, kind="order")
    legend = [
        ("queue", "a pinned batch waits in the feed's queue until its copy is issued"),
        ("event", "the step waits for its batch's copy (an event recorded after the copy)"),
        ("order", "the next copy waits for the steps queued before it: no memory reused early"),
    ]
    for number, (kind, words) in enumerate(legend):
        y = bottom + 22 + 20 * number
        _arrow(root, 10, y, 40, y, kind=kind)
        _text(root, 48, y + 4, words)
    _text(
        root,
        10,
        bottom + 86,
        "Time runs to the right; the three lanes run at once; not to scale.",
        fill=GREY,
    )
    return ET.tostring(root, encoding="unicode")


def _sentence(share: float) -> str:
    """What :func:`devicekit._loader._stats.verdict` says of ``share`` of an epoch spent waiting.

    The sentence after the figures it opens with, up to the advice it may give next.
    """
    stats = _stats.LoaderStats(
        batches=10,
        wait_s=share,
        step_s=1 - share,
        elapsed_s=1.0,
        wait_fraction=share,
        finished=True,
    )
    setup = _stats.Setup("list", None, False, False, False, cpus=1)
    said = _stats.verdict(stats, setup).split("): ", 1)[1]
    return said.split(". ", 1)[0].rstrip(".") + "."


def _percent(share: float) -> str:
    return f"{share:.0%}"


def bands() -> str:
    """The verdict's three bands of the share of an epoch spent waiting, as SVG text."""
    low, high = _stats.COMPUTE_BOUND, _stats.INPUT_BOUND
    width, margin = 760, 20
    scale_w = width - 2 * margin
    root = _svg(
        width,
        230,
        f"The verdict's bands: below {_percent(low)} of the epoch spent waiting the loop is "
        f"compute-bound, from {_percent(high)} input-bound, and in between faster input "
        "could save up to the share it waited.",
    )
    _text(root, margin, 18, "Share of the epoch the loop waited for data", size=13)

    def at(share: float) -> float:
        return margin + share * scale_w

    spans = (
        ("compute", 0.0, low, GREEN, f"below {_percent(low)}", "compute-bound"),
        ("between", low, high, AMBER, f"{_percent(low)} up to {_percent(high)}", "in between"),
        ("input", high, 1.0, ORANGE, f"{_percent(high)} and above", "input-bound"),
    )
    column_w = scale_w / 3
    for number, (name, start, end, colour, span, kind) in enumerate(spans):
        band = ET.SubElement(
            root,
            "g",
            attrib={
                "class": "band",
                "data-band": name,
                "data-from": f"{start:g}",
                "data-to": f"{end:g}",
            },
        )
        ET.SubElement(
            band,
            "rect",
            x=f"{at(start):g}",
            y="44",
            width=f"{at(end) - at(start):g}",
            height="24",
            fill=colour,
        )
        # Each band's column, joined to the band by a line: a narrow band has no room to write in.
        column = margin + number * column_w
        ET.SubElement(
            band,
            "line",
            x1=f"{(at(start) + at(end)) / 2:g}",
            y1="68",
            x2=f"{column + column_w / 2:g}",
            y2="100",
            stroke=colour,
            attrib={"stroke-width": "2"},
        )
        ET.SubElement(
            band,
            "rect",
            x=f"{column + 4:g}",
            y="100",
            width=f"{column_w - 8:g}",
            height="120",
            rx="4",
            fill=colour,
            attrib={"fill-opacity": "0.12", "stroke": colour},
        )
        _text(band, column + 12, 120, f"{span}: {kind}", size=13, font_weight="bold")
        example = (start + end) / 2
        _text(
            band,
            column + 12,
            142,
            f'At {_percent(example)}: "{_sentence(example)}"',
            width=column_w - 24,
        ).set("class", "verdict")
        then = "Nothing to change." if name == "compute" else "Then it names a cause."
        _text(band, column + 12, 206, then, fill=GREY)
    for share in (0.0, low, high, 1.0):
        ET.SubElement(
            root, "line", x1=f"{at(share):g}", y1="40", x2=f"{at(share):g}", y2="72", stroke="black"
        )
        label = _text(root, at(share), 37, _percent(share), anchor="middle")
        if share in (low, high):
            label.set("class", "threshold")
    return ET.tostring(root, encoding="unicode")


def write(out: Path) -> None:
    """Both pictures, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "loader-timeline.svg").write_text(timeline(), encoding="utf-8")
    (out / "verdict-bands.svg").write_text(bands(), encoding="utf-8")
