"""Every example in the documentation runs as shown, pasted into a fresh interpreter."""

from __future__ import annotations

import doctest
import itertools
import re
import textwrap
import warnings
from pathlib import Path

import pytest

import devicekit
import devicekit.testing
from devicekit._core import _kinds

from .helpers import require_package

DOCS = Path(__file__).parent.parent / "docs"


def test_no_page_hides_setup_from_its_reader() -> None:
    # Sphinx would run a hidden setup before the examples; the reader never sees it.
    hidden = re.compile(r"^\.\. (testsetup|testcleanup)::|^doctest_global_setup", re.MULTILINE)
    pages = [*DOCS.rglob("*.rst"), DOCS / "conf.py"]
    offenders = [
        str(page.relative_to(DOCS))
        for page in pages
        if "_build" not in page.parts and "generated" not in page.parts
        if hidden.search(page.read_text(encoding="utf-8"))
    ]
    assert len(pages) > 10  # the pages were found
    assert offenders == []


def _docstring_examples() -> list[doctest.DocTest]:
    """The examples of what the API pages show: the public names and their members, once each.

    --doctest-modules leaves these to this file (tests/conftest.py), so each runs once.
    """
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: list[doctest.DocTest] = []
    for module in (devicekit, devicekit.testing):
        found += [test for test in finder.find(module) if test.examples]
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj):  # functions and classes; a class brings its members
                found += finder.find(obj, f"{module.__name__}.{name}", module=False)
    # The errors, whose __module__ is devicekit, are found both in the module and by name.
    once: dict[str | None, doctest.DocTest] = {}
    for test in found:
        if test.examples:
            once.setdefault(test.docstring, test)
    return list(once.values())


EXAMPLES = _docstring_examples()


def test_the_docstrings_have_examples() -> None:
    assert len(EXAMPLES) > 30


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name for test in EXAMPLES])
def test_a_docstring_example_needs_nothing_but_its_own_imports(example: doctest.DocTest) -> None:
    # pytest's doctests run with the module's globals, where torch and the module's own
    # names are at hand; a reader's interpreter has none of them.
    example.globs = {"__name__": "__main__"}
    # pytest's own flags (ELLIPSIS, its default doctest_optionflags): whitespace compared as
    # --doctest-modules compares it, which leaves these examples to this test.
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failures: list[str] = []
    runner.run(example, out=failures.append)
    assert runner.failures == 0, "".join(failures)


# Each section of a page runs on its own after the page's introduction (the text before
# its first section, where a page sets up what all its sections use): a reader who
# jumps to a section and pastes it gets what the page shows.

_SECTION = re.compile(r"^[^\n]+\n-{3,}\n", re.MULTILINE)
_BLOCK = re.compile(
    r"^\.\. (doctest|testcode)::[^\n]*\n((?:[ \t]+:[^\n]*\n)*)\n((?:(?:[ \t]+[^\n]*)?\n)+)",
    re.MULTILINE,
)


def _pages() -> list[Path]:
    return [
        page
        for page in sorted(DOCS.rglob("*.rst"))
        if "_build" not in page.parts and "generated" not in page.parts
    ]


def _sections() -> list[tuple[str, str, str]]:
    """(page and section number, introduction, section) for every section with code."""
    found = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        starts = [match.start() for match in _SECTION.finditer(text)]
        bounds = [0, *starts, len(text)]
        parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
        found += [
            (f"{page.relative_to(DOCS)}#{number}", parts[0], part)
            for number, part in enumerate(parts[1:], 1)
            if _BLOCK.search(part)
        ]
    return found


def _run_blocks(text: str, name: str) -> list[str]:
    """Run the doctest and testcode blocks of ``text`` in order, in one fresh namespace."""
    globs: dict[str, object] = {"__name__": "__main__"}
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    failures: list[str] = []
    for kind, options, body in _BLOCK.findall(text):
        code = textwrap.dedent(body)
        if kind == "testcode":
            if ":hide:" not in options:  # a hidden one cleans up after the page
                exec(compile(code, name, "exec"), globs)
            continue
        test = doctest.DocTestParser().get_doctest(code, globs, name, name, 0)
        test.globs = globs  # not the copy a DocTest makes: the blocks share one namespace
        runner.run(test, out=failures.append, clear_globs=False)
    return failures


SECTIONS = _sections()

# What the pages import beyond the ``test`` extra: the ``interop`` extra's packages and the
# ``bench`` extra's peers that the migration guides run.
_OPTIONAL = ("transformers", "tensordict", "torch_geometric", "accelerate", "lightning_fabric")
_IMPORTED = re.compile(r"^\s*(?:>>> |\.\.\. )?(?:from|import) (\w+)", re.MULTILINE)


def test_the_sections_were_found() -> None:
    assert len(SECTIONS) > 40


# A section that runs a command as a process of its own is in the slow tier
# (tests/conftest.py), marked here since its code, not the test's, starts Python.
_STARTS_PYTHON = re.compile(r"\bsys\.executable\b")


@pytest.mark.parametrize(
    ("name", "intro", "section"),
    [
        pytest.param(
            *section,
            id=section[0],
            marks=[pytest.mark.slow] if _STARTS_PYTHON.search(section[1] + section[2]) else [],
        )
        for section in SECTIONS
    ],
)
def test_a_section_runs_on_its_own_after_its_page_s_introduction(
    name: str, intro: str, section: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for package in set(_IMPORTED.findall(intro + section)) & set(_OPTIONAL):
        require_package(package)
    monkeypatch.chdir(tmp_path)  # what a page writes lands here
    for variable in ("DEVICEKIT_DEVICE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DEVICEKIT_CLAIM_DIR"):
        monkeypatch.delenv(variable, raising=False)
    registered = set(_kinds._rules)
    try:
        failures = _run_blocks(intro + section, name)
    finally:  # a reader's session ends with the page, and the rules it registered with it
        for cls in set(_kinds._rules) - registered:
            devicekit.unregister_transfer(cls)
    assert failures == [], "".join(failures)[-3000:]


def test_every_block_of_code_pastes_into_the_interactive_interpreter() -> None:
    # There a blank line ends an indented block: one inside a class or a function body
    # breaks the paste (the next indented line is an IndentationError).
    broken = []
    for page in _pages():
        for kind, _, body in _BLOCK.findall(page.read_text(encoding="utf-8")):
            lines = textwrap.dedent(body).rstrip("\n").splitlines()
            for number, line in enumerate(lines[:-1]):
                following = next((later for later in lines[number + 1 :] if later.strip()), "")
                if kind == "testcode" and not line.strip() and following[:1] in (" ", "\t"):
                    broken.append(f"{page.relative_to(DOCS)}: before {following.strip()!r}")
    assert broken == []


def test_the_sections_that_need_optional_packages_are_found() -> None:
    # Those are skipped where the package is missing: a miss here would fail CI's first run.
    needs = {
        name: set(_IMPORTED.findall(intro + section)) & set(_OPTIONAL)
        for name, intro, section in SECTIONS
    }
    assert {"transformers", "torch_geometric"} <= set.union(*needs.values())
    assert needs["migration/accelerate.rst#1"] == {"accelerate"}
    assert needs["migration/fabric.rst#3"] == {"lightning_fabric"}


# The pages a user reads to get started and to do a task (not the contributors' pages).
USER_PAGES = sorted(
    [
        DOCS / "quickstart.rst",
        DOCS / "tutorial.rst",
        DOCS / "concepts.rst",
        DOCS / "cheatsheet.rst",
        DOCS / "install.rst",
        DOCS / "faq.rst",
        *(DOCS / "guide").glob("*.rst"),
        *(DOCS / "migration").glob("*.rst"),
    ]
)
# The pages read from top to bottom: the user pages, the landing page, the background
# (which may name devicekit's internals) and the contributors' page. Not the references
# (API, command line, variables, glossary) or the changelog, which are looked things up in.
READ_PAGES = sorted(
    [
        *USER_PAGES,
        DOCS / "index.rst",
        DOCS / "contributing.rst",
        *(path for path in (DOCS / "background").glob("*.rst") if path.stem != "glossary"),
    ]
)


def _page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


@pytest.mark.parametrize("page", READ_PAGES, ids=_page_id)
def test_a_page_has_a_title_and_a_first_paragraph_of_prose(page: Path) -> None:
    lines = page.read_text(encoding="utf-8").splitlines()
    title, underline = lines[0], lines[1]
    assert title.strip()
    assert set(underline) == {"="}
    assert len(underline) >= len(title)
    first = lines[3] if lines[2] == "" else ""
    assert first.strip()
    assert not first.startswith((".. ", "   ", ">>>"))  # prose, before any block


@pytest.mark.parametrize("page", USER_PAGES, ids=_page_id)
def test_a_user_page_names_no_private_name(page: Path) -> None:
    # devicekit's internals are explained on the background pages, never in a guide.
    text = page.read_text(encoding="utf-8")
    assert "devicekit._" not in text  # a private module or name
    assert "devicekit/_" not in text  # a private module's file


_ADMONITION = re.compile(r"\.\. (note|warning|tip|seealso)::")
_UNDERLINE = re.compile(r"([=\-~^])\1+")


def prose(text: str) -> list[str]:
    """The paragraphs and list items of a page's prose: no titles, code or directives.

    A directive's body (code, tables, pictures, toctrees) is left out, an admonition's is
    prose; inline code and a role count as one word, a link as its text.
    """
    lines: list[str] = []
    skipped_from: int | None = None  # the indentation of the block being left out
    for line in text.splitlines():
        indent, stripped = len(line) - len(line.lstrip()), line.strip()
        if skipped_from is not None and (not stripped or indent > skipped_from):
            continue
        if skipped_from is not None:
            lines.append("")  # what follows a block starts a paragraph
        skipped_from = None
        if _UNDERLINE.fullmatch(stripped):
            lines.pop()  # the title above it
        elif stripped.startswith("..") and not _ADMONITION.match(stripped):
            skipped_from = indent
        else:
            if stripped.endswith("::"):
                skipped_from = indent  # a literal block follows
            item = re.match(r"(- |\* |#\. )", stripped)
            if item:  # a list item reads as a paragraph of its own
                lines.append("")
                stripped = stripped[item.end() :]
            lines.append(_ADMONITION.sub("", stripped).rstrip(":"))
    text = " ".join(line or "\n" for line in lines)
    text = re.sub(r"``[^`]+``|:\w+:`[^`<]*<[^`]*>`|`[^`<]+<[^`]*>`_+", "code", text)
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return [paragraph.strip() for paragraph in text.split("\n") if paragraph.strip()]


def sentences(paragraphs: list[str]) -> list[list[str]]:
    """Each sentence as its words, from full stop to full stop (a colon ends none)."""
    return [
        sentence.split()
        for paragraph in paragraphs
        for sentence in re.split(r"(?<=[.?!])\s+|(?<=[.?!][)\"'])\s+", paragraph)
        if sentence.strip()
    ]


def test_prose_leaves_code_titles_and_directives_out() -> None:
    page = textwrap.dedent(
        """\
        Title
        =====

        One ``to_device(x)`` call, see :doc:`the guide <guide/loader>`: done. (Really.) Yes.

        .. doctest::

           >>> import torch

        - An item::

             literal

        .. note:: Read this.
        """
    )
    assert prose(page) == ["One code call, see code: done. (Really.) Yes.", "An item", "Read this."]
    assert sentences(prose(page)) == [
        ["One", "code", "call,", "see", "code:", "done."],
        ["(Really.)"],
        ["Yes."],
        ["An", "item"],
        ["Read", "this."],
    ]


# About 1,000 words of prose a page (code not counted): a page read in one sitting.
MOST_WORDS = 1_000
# No sentence over 40 words: the longest a reader follows without going back.
LONGEST_SENTENCE = 40


@pytest.mark.parametrize("page", READ_PAGES, ids=_page_id)
def test_a_page_is_read_in_one_sitting(page: Path) -> None:
    words = sum(len(paragraph.split()) for paragraph in prose(page.read_text(encoding="utf-8")))
    assert words <= MOST_WORDS, f"{_page_id(page)} has {words} words of prose"


# The references and the changelog are looked things up in: long, but in short sentences too.
REFERENCE_PAGES = sorted(
    [DOCS / "api.rst", DOCS / "changelog.rst", *(DOCS / "reference").glob("*.rst")]
)


@pytest.mark.parametrize("page", READ_PAGES + REFERENCE_PAGES, ids=_page_id)
def test_no_sentence_runs_over_forty_words(page: Path) -> None:
    paragraphs = prose(page.read_text(encoding="utf-8"))
    long = [" ".join(words) for words in sentences(paragraphs) if len(words) > LONGEST_SENTENCE]
    assert long == [], f"{_page_id(page)} has sentences over {LONGEST_SENTENCE} words"


# Words as a reader meets them: counted on the rendered text (Sphinx's text builder), code,
# tables and examples included, since a reader reads those too.
RENDERED_MOST_WORDS = 1_000
# All the narrative pages together: what a newcomer may read through in an afternoon.
NARRATIVE_MOST_WORDS = 25_000


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Each rendered page's words, by its name under docs (``guide/loader``), built once."""
    # The docs extra's Sphinx; a run without it (nox -s tests) skips the counts.
    build = pytest.importorskip("sphinx.cmd.build", reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("text")
    # In this process: the fast tier starts no interpreter (tests/conftest.py). Sphinx's
    # own deprecations are not the docs' warnings, which the -W build checks.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert build.build_main(["-q", "-b", "text", str(DOCS), str(out)]) == 0
    return {
        page.relative_to(out).with_suffix("").as_posix(): sum(
            1 for token in page.read_text("utf-8").split() if _A_WORD.search(token)
        )
        for page in out.rglob("*.txt")
    }


# A word holds a letter or a digit: a text table's borders ("|", "+-----+"), list bullets
# and prompts (">>>") are drawing, not words, or a table would cost more than a list.
_A_WORD = re.compile(r"\w")


# The pages a newcomer reads first, and the tutorial, concepts page and cheat sheet once
# they exist.
_FIRST_PAGES = ("quickstart", "faq", "tutorial", "concepts", "cheatsheet")
RENDERED_USER_PAGES = sorted(
    [
        *(name for name in _FIRST_PAGES if (DOCS / f"{name}.rst").exists()),
        *(page.relative_to(DOCS).with_suffix("").as_posix() for page in DOCS.glob("guide/*.rst")),
        *(
            page.relative_to(DOCS).with_suffix("").as_posix()
            for page in DOCS.glob("migration/*.rst")
        ),
    ]
)


def _narrative(name: str) -> bool:
    """Every page but the API's: ``api`` and the pages generated under api/ and _generated/."""
    return name != "api" and not name.startswith(("api/generated/", "_generated/"))


@pytest.mark.parametrize("name", RENDERED_USER_PAGES)
def test_a_user_page_renders_under_a_thousand_words(name: str, rendered: dict[str, int]) -> None:
    assert rendered[name] < RENDERED_MOST_WORDS, f"{name} renders {rendered[name]} words"


def test_the_narrative_docs_render_at_most_25000_words(rendered: dict[str, int]) -> None:
    assert "guide/loader" in rendered  # the build was read
    assert "api/generated/devicekit.to_device" in rendered  # and the API pages left out:
    pages = {name: words for name, words in rendered.items() if _narrative(name)}
    total = sum(pages.values())
    longest = ", ".join(
        f"{name} {words}" for name, words in sorted(pages.items(), key=lambda item: -item[1])[:5]
    )
    assert total <= NARRATIVE_MOST_WORDS, (
        f"the narrative docs render {total:,} words, over {NARRATIVE_MOST_WORDS:,}; "
        f"the longest: {longest}"
    )
