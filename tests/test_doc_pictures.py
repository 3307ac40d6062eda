"""The loader's pictures, drawn at build time (docs/_pictures.py), say what the code does."""

from __future__ import annotations

import importlib.util
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from devicekit._loader import _stats

DOCS = Path(__file__).parent.parent / "docs"
SVG = "{http://www.w3.org/2000/svg}"


def _load_pictures() -> ModuleType:
    # Sphinx imports it by path from docs/ (conf.py puts docs/ on the path); so do the tests.
    spec = importlib.util.spec_from_file_location("_pictures", DOCS / "_pictures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pictures = _load_pictures()


def _words(element: ET.Element) -> str:
    """An SVG text element's lines (its tspans), joined as one sentence."""
    return " ".join(" ".join(element.itertext()).split())


def _texts(root: ET.Element, where: str = ".//") -> list[str]:
    return [_words(text) for text in root.iterfind(f"{where}{SVG}text")]


def test_the_timeline_is_an_svg_picture_with_a_title() -> None:
    root = ET.fromstring(pictures.timeline())
    assert root.tag == f"{SVG}svg"
    title = root.find(f"{SVG}title")
    assert title is not None
    assert title.text == (
        "The loader's pipeline: the feed thread pins batch n+2 while the side stream "
        "copies batch n+1 while the compute stream runs step n."
    )


def test_the_timeline_has_three_lanes_with_the_right_labels_and_work() -> None:
    root = ET.fromstring(pictures.timeline())
    lanes = root.findall(f".//{SVG}g[@class='lane']")
    assert [lane.get("data-lane") for lane in lanes] == [
        "feed thread",
        "side stream",
        "compute stream",
    ]
    feed, side, compute = (_texts(lane) for lane in lanes)
    assert feed == [
        "feed thread",
        "read, pin n+2",
        "read, pin n+3",
        "read, pin n+4",
        "read, pin n+5",
    ]
    assert side == ["side stream", "copy n+1", "copy n+2", "copy n+3", "copy n+4"]
    assert compute == ["compute stream", "step n", "step n+1", "step n+2", "step n+3"]


def test_the_timeline_draws_both_waits_between_every_two_steps() -> None:
    root = ET.fromstring(pictures.timeline())
    waits = root.find(f".//{SVG}g[@class='waits']")
    assert waits is not None
    kinds = [line.get("class", "") for line in waits.iter(f"{SVG}line")]
    between = pictures.STEPS - 1
    assert sorted(kinds) == sorted(
        ["wait event"] * between + ["wait order"] * between + ["wait queue"] * between
    )
    legend = " ".join(_texts(root))
    assert "the step waits for its batch's copy (an event recorded after the copy)" in legend
    assert "the next copy waits for the steps queued before it: no memory reused early" in legend


def _bands() -> ET.Element:
    return ET.fromstring(pictures.bands())


def _thresholds(root: ET.Element) -> list[str]:
    return [_words(text) for text in root.iter(f"{SVG}text") if text.get("class") == "threshold"]


def test_the_bands_are_cut_at_the_code_s_thresholds() -> None:
    root = _bands()
    cuts = [f"{_stats.COMPUTE_BOUND:.0%}", f"{_stats.INPUT_BOUND:.0%}"]
    assert _thresholds(root) == cuts
    bands = root.findall(f"{SVG}g[@class='band']")
    assert [(band.get("data-from"), band.get("data-to")) for band in bands] == [
        ("0", f"{_stats.COMPUTE_BOUND:g}"),
        (f"{_stats.COMPUTE_BOUND:g}", f"{_stats.INPUT_BOUND:g}"),
        (f"{_stats.INPUT_BOUND:g}", "1"),
    ]


def test_each_band_quotes_the_verdict_the_code_writes_there() -> None:
    bands = _bands().findall(f"{SVG}g[@class='band']")
    said = [_texts(band) for band in bands]
    assert said == [
        [
            "below 10%: compute-bound",
            'At 5%: "it is compute-bound, so faster input would not make it faster."',
            "Nothing to change.",
        ],
        [
            "10% up to 50%: in between",
            'At 30%: "faster input could save up to 30% of it."',
            "Then the first cause below.",
        ],
        [
            "50% and above: input-bound",
            'At 75%: "it is input-bound."',
            "Then the first cause below.",
        ],
    ]


def test_a_threshold_moved_in_the_code_moves_the_picture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stats, "COMPUTE_BOUND", 0.2)
    monkeypatch.setattr(_stats, "INPUT_BOUND", 0.6)
    root = _bands()
    assert _thresholds(root) == ["20%", "60%"]
    middle = root.find(f"{SVG}g[@data-band='between']")
    assert middle is not None
    assert _texts(middle)[:2] == [
        "20% up to 60%: in between",
        'At 40%: "faster input could save up to 40% of it."',  # verdict() read 0.2 too
    ]
    compute = root.find(f"{SVG}g[@data-band='compute']")
    assert compute is not None
    assert _texts(compute)[0] == "below 20%: compute-bound"


def test_the_causes_take_their_figures_from_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    causes = " ".join(" ".join(row) for row in pictures.causes())
    assert "about 450 us" in causes
    assert "The first batch was 50% or more of the wait" in causes
    monkeypatch.setattr(_stats, "HANDOVER_S", 1e-3)
    monkeypatch.setattr(_stats, "_FIRST_BATCH", 0.7)
    causes = " ".join(_texts(_bands()))
    assert "about 1000 us" in causes
    assert "The first batch was 70% or more of the wait" in causes


def test_write_puts_both_pictures_where_the_pages_read_them(tmp_path: Path) -> None:
    pictures.write(tmp_path / "_generated")
    for name in ("loader-timeline.svg", "verdict-bands.svg"):
        root = ET.parse(tmp_path / "_generated" / name).getroot()
        assert root.tag == f"{SVG}svg"
    conf = (DOCS / "conf.py").read_text(encoding="utf-8")
    assert '_pictures.write(HERE / "_generated")' in conf


_IMAGE = re.compile(r"^(?P<indent> *)\.\. (?:image|figure):: (?P<target>\S+)\n", re.MULTILINE)


def _images(page: Path) -> list[tuple[str, str]]:
    """(target, alt text) of each image and figure on ``page``; alt "" where it has none."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _IMAGE.finditer(text):
        indent = len(match.group("indent"))
        options = []
        for line in text[match.end() :].splitlines():
            if not line.strip() or len(line) - len(line.lstrip()) <= indent:
                break
            options.append(line.strip())
        alt = ""
        for number, option in enumerate(options):
            if option.startswith(":alt:"):
                rest = _continued(options[number + 1 :])
                alt = " ".join([option.removeprefix(":alt:").strip(), *rest])
        found.append((match.group("target"), alt))
    return found


def _continued(lines: list[str]) -> list[str]:
    """The lines that continue an option's value: up to the next option."""
    kept = []
    for line in lines:
        if line.startswith(":"):
            break
        kept.append(line)
    return kept


def test_the_pages_show_the_pictures_with_alt_text() -> None:
    timeline = _images(DOCS / "background" / "loader-pipeline.rst")
    bands = _images(DOCS / "guide" / "waiting-for-data.rst")
    assert [target for target, _ in timeline] == ["/_generated/loader-timeline.svg"]
    assert "/_generated/verdict-bands.svg" in [target for target, _ in bands]
    for _, alt in timeline + bands:
        assert len(alt.split()) >= 12, alt  # a sentence that says what the picture shows
    assert "feed thread" in timeline[0][1]
    assert "side stream" in timeline[0][1]
    assert "compute stream" in timeline[0][1]


def test_every_picture_in_the_docs_has_alt_text() -> None:
    pages = [page for page in DOCS.rglob("*.rst") if "_build" not in page.parts]
    missing = [
        f"{page.relative_to(DOCS)}: {target}"
        for page in pages
        for target, alt in _images(page)
        if not alt
    ]
    assert len(pages) > 10
    assert missing == []


def test_the_loader_guide_leaves_the_mechanics_to_the_background_page() -> None:
    guide = (DOCS / "guide" / "loader.rst").read_text(encoding="utf-8")
    assert "How the copy hides behind compute: :doc:`../background/loader-pipeline`." in guide
    assert "record_stream" not in guide
    assert "──" not in guide  # the ASCII pipeline, drawn now as the timeline


def test_the_guide_s_words_beside_the_bands_state_the_code_s_thresholds() -> None:
    # The picture is drawn from the code; the prose and the alt text beside it must agree.
    page = " ".join((DOCS / "guide" / "waiting-for-data.rst").read_text(encoding="utf-8").split())
    low, high = f"{_stats.COMPUTE_BOUND:.0%}", f"{_stats.INPUT_BOUND:.0%}"
    assert f"Below {low}, the loop is *compute-bound*" in page
    assert f"From {high}, it is *input-bound*" in page
    assert f"cut into three bands at {low} and {high}" in page
