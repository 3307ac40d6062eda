"""The README: its snippets run as written, its commands and its list of pages are right.

Every Python snippet prints what the README shows; the Quick start is two lines, the
test one as .ci/run runs it; every page in the documentation's toctrees is linked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
# A python block, and the text block right after it when there is one: its output.
_SNIPPET = re.compile(r"```python\n(?P<code>.*?)```\n(?:\n```text\n(?P<output>.*?)```)?", re.DOTALL)
SNIPPETS = [(match["code"], match["output"]) for match in _SNIPPET.finditer(README.read_text())]


def test_the_readme_has_its_snippets() -> None:
    # A changed fence would otherwise leave nothing to run and nothing to compare.
    assert len(SNIPPETS) >= 5
    assert any(output is not None for _, output in SNIPPETS)


@pytest.mark.parametrize(
    ("code", "output"), SNIPPETS, ids=[f"snippet-{n}" for n in range(len(SNIPPETS))]
)
def test_a_snippet_runs_in_a_fresh_interpreter(
    code: str, output: str | None, tmp_path: Path, fresh_python: str
) -> None:
    # A fresh interpreter in an empty directory: what a reader gets who pastes it.
    result = subprocess.run(
        [fresh_python, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"{code}\nfailed with:\n{result.stderr[-3000:]}"
    if output is not None:
        assert result.stdout == output


ROOT = README.parent
DOCS = ROOT / "docs"
_TOCTREE = re.compile(r"^\.\. toctree::\n(?P<body>(?:[ \t]+.*\n|\n)*)", re.MULTILINE)


def _toctree_pages(page: Path) -> list[Path]:
    """The .rst pages in the toctrees of ``page`` and, in turn, of theirs."""
    pages = []
    for match in _TOCTREE.finditer(page.read_text()):
        for line in match["body"].splitlines():
            entry = line.strip()
            if not entry or entry.startswith(":"):  # options such as :maxdepth:
                continue
            # "Title <path>" entries name the page between angle brackets.
            name = re.fullmatch(r".*<(.+)>", entry)
            target = (page.parent / (name[1] if name else entry)).with_suffix(".rst")
            pages += [target, *_toctree_pages(target)]
    return pages


def test_the_readme_links_every_page_of_the_documentation() -> None:
    # A new page in a toctree must be added to the README's list too.
    pages = _toctree_pages(DOCS / "index.rst")
    assert DOCS / "migration" / "hand-written.rst" in pages  # the nested toctree is read
    linked = {ROOT / link for link in re.findall(r"\]\((docs/[^)]+\.rst)\)", README.read_text())}
    missing = [str(page.relative_to(ROOT)) for page in pages if page not in linked]
    assert not missing, f"README.md does not link the documentation's pages {missing}"


def test_every_linked_page_exists() -> None:
    for link in re.findall(r"\]\(([^)#:]+)\)", README.read_text()):
        assert (ROOT / link).exists(), f"README.md links {link}, which does not exist"


def _quick_start() -> str:
    text = README.read_text()
    start = text.index("## Quick start")
    return text[start : text.index("\n## ", start)]


def test_the_quick_start_is_two_lines() -> None:
    # One console block of two lines: the demo, then the tests.
    (block,) = re.findall(r"```console\n(.*?)```", _quick_start(), re.DOTALL)
    demo, tests = block.splitlines()
    assert demo.endswith("&& devicekit demo")
    assert tests.endswith("&& python -m pytest")
    # .ci/run runs the README's test command as written.
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_quick_start_takes_the_cpu_build_from_where_the_install_page_does() -> None:
    (block,) = re.findall(r"```console\n(.*?)```", _quick_start(), re.DOTALL)
    demo = block.splitlines()[0]
    index_url = "--index-url https://download.pytorch.org/whl/cpu"
    assert f"install torch==2.13.0 {index_url}" in (DOCS / "install.rst").read_text()
    assert demo.startswith(f"python -m pip install torch==2.13.0 {index_url} && ")
    # The GPU way is told in words, naming what to leave out of that same line.
    assert f"leave `{index_url}` out of the\nfirst line" in _quick_start()


def test_every_install_in_the_readme_names_the_torch_version() -> None:
    # A bare torch would let pip take the newest release, with GBs of CUDA packages.
    text = README.read_text()
    lines = [
        line
        for block in re.findall(r"```console\n(.*?)```", text, re.DOTALL)
        for line in block.splitlines()
    ]
    assert lines
    for line in lines:
        if "pip install" in line:
            assert "torch==2.13.0" in line, line


def test_the_docs_give_the_readme_s_two_lines_where_each_belongs() -> None:
    # The demo's line starts a user's quick start; the tests' line, a contributor's page.
    (block,) = re.findall(r"```console\n(.*?)```", _quick_start(), re.DOTALL)
    demo, tests = block.splitlines()
    quick_start = (DOCS / "quickstart.rst").read_text()
    contributing = (DOCS / "contributing.rst").read_text()
    assert f"   $ {demo}\n" in quick_start
    assert f"   $ {tests}\n" in contributing
    assert "pytest" not in quick_start
