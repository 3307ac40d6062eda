"""The docs' pictures, drawn at build time, say what the code does, the same every build.

docs/_pictures.py draws the loader's timeline and the verdict's bands from the code;
docs/_waiting.py draws guide/waiting-for-data's figure from a committed measurement.
"""

from __future__ import annotations

import importlib.util
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from devicekit._commands._demo import SLOW_DATA_S
from devicekit._loader import _stats

DOCS = Path(__file__).parent.parent / "docs"
SVG = "{http://www.w3.org/2000/svg}"


def _load(name: str) -> ModuleType:
    # Sphinx imports it by path from docs/ (conf.py puts docs/ on the path); so do the tests.
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pictures = _load("_pictures")


@pytest.fixture(scope="module")
def waiting() -> ModuleType:
    """docs/_waiting.py, which draws with matplotlib: the docs extra's, skipped without it."""
    pytest.importorskip("matplotlib", reason="the docs extra is not installed")
    return _load("_waiting")


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
            "Then it names a cause.",
        ],
        [
            "50% and above: input-bound",
            'At 75%: "it is input-bound."',
            "Then it names a cause.",
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


def test_the_bands_picture_leaves_the_causes_to_the_page_s_list() -> None:
    # The list beside the picture names the causes; the picture does not repeat it.
    said = " ".join(_texts(_bands()))
    assert "persistent_workers" not in said
    assert "pin_memory" not in said
    page = " ".join((DOCS / "guide" / "waiting-for-data.rst").read_text(encoding="utf-8").split())
    assert "``persistent_workers=True``" in page
    assert "``pin_memory=True``" in page


def test_the_page_s_causes_state_the_code_s_figures() -> None:
    page = " ".join((DOCS / "guide" / "waiting-for-data.rst").read_text(encoding="utf-8").split())
    assert f"a worker's {_stats.HANDOVER_S * 1e6:.0f} us hand-over" in page
    assert _stats._FIRST_BATCH == 0.5  # the page: "Half the wait or more"
    assert "Half the wait or more was the first batch" in page


def test_write_puts_both_pictures_where_the_pages_read_them(tmp_path: Path) -> None:
    pictures.write(tmp_path / "_generated")
    for name in ("loader-timeline.svg", "verdict-bands.svg"):
        root = ET.parse(tmp_path / "_generated" / name).getroot()
        assert root.tag == f"{SVG}svg"
    conf = (DOCS / "conf.py").read_text(encoding="utf-8")
    assert '_pictures.write(HERE / "_generated")' in conf
    assert '_waiting.write(HERE / "_generated")' in conf


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_every_picture_is_the_same_bytes_every_build(tmp_path: Path, waiting: ModuleType) -> None:
    # Two builds, as conf.py makes them: nothing of the run (a date, a random id) gets in.
    for build in ("one", "two"):
        pictures.write(tmp_path / build)
        waiting.write(tmp_path / build)
    one, two = _files(tmp_path / "one"), _files(tmp_path / "two")
    assert sorted(one) == [
        "loader-timeline.svg",
        "verdict-bands.svg",
        "waiting-for-data.csv",
        "waiting-for-data.svg",
        "waiting-for-data.txt",
    ]
    assert one == two
    assert b"<dc:date>" not in one["waiting-for-data.svg"]


def _record(waiting: ModuleType) -> dict[str, object]:
    record: dict[str, object] = json.loads(waiting.DATA.read_text(encoding="utf-8"))
    return record


def test_the_waiting_figure_draws_the_committed_measurement(waiting: ModuleType) -> None:
    _, runs = waiting.load()
    assert [run.name for run in runs] == list(waiting.RUNS)
    assert [len(run.waits) for run in runs] == [waiting.BATCHES] * 2
    assert [len(run.steps) for run in runs] == [waiting.BATCHES] * 2
    fast, slow = (run.stats for run in runs)
    # What the page says of them: one epoch compute-bound, the other input-bound.
    assert fast.wait_fraction < _stats.COMPUTE_BOUND
    assert slow.wait_fraction >= _stats.INPUT_BOUND
    assert "it is compute-bound" in fast.verdict
    assert "it is input-bound" in slow.verdict
    # The build's sums of the stored batches judge as the loader judged when it measured.
    for run, stored in zip(runs, _record(waiting)["runs"], strict=True):  # type: ignore[call-overload]
        assert run.stats.verdict.split(": ")[:2] == stored["verdict"].split(": ")[:2]


def test_the_words_beside_the_waiting_figure_say_what_it_shows(waiting: ModuleType) -> None:
    page = " ".join((DOCS / "guide" / "waiting-for-data.rst").read_text(encoding="utf-8").split())
    [(_, alt)] = [
        image
        for image in _images(DOCS / "guide" / "waiting-for-data.rst")
        if image[0] == "/_generated/waiting-for-data.svg"
    ]
    fast, slow = (run.stats for run in waiting.load()[1])
    assert f"almost no waiting, {fast.wait_fraction:.0%} of the epoch" in alt
    assert f"waits longer than the steps, {slow.wait_fraction:.0%}" in alt
    machine = _record(waiting)["machine"]
    assert isinstance(machine, dict)
    torch_version = machine["torch"].split("+")[0]
    named = f"{machine['cpus']}-core {machine['platform']}, torch {torch_version}, one thread"
    assert machine["torch_threads"] == 1
    assert f"Measured once ({named})" in page
    assert "``docs/_data/waiting-for-data.json``" in page
    assert f"trained {waiting.BATCHES} batches on the CPU" in page
    slow_ms = f"{SLOW_DATA_S * 1e3:.0f} ms"
    assert f"{slow_ms} slower a batch (``devicekit demo --slow-data``)" in page


def test_the_waiting_figure_s_legend_covers_no_bar(waiting: ModuleType) -> None:
    shape = waiting.draw(waiting.load()[1])
    try:
        shape.canvas.draw()
        [legend] = shape.legends
        box = legend.get_window_extent()
        assert not any(box.overlaps(ax.get_window_extent()) for ax in shape.axes)
    finally:
        waiting.plt.close(shape)


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
