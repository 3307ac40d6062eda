"""Every example in the documentation runs as shown, pasted into a fresh interpreter."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

import devicekit
import devicekit.testing

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
    """The examples of what the API pages show: the public names and their members."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: list[doctest.DocTest] = []
    for module in (devicekit, devicekit.testing):
        found += [test for test in finder.find(module) if test.examples]
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj):  # functions and classes; a class brings its members
                found += finder.find(obj, f"{module.__name__}.{name}", module=False)
    return [test for test in found if test.examples]


EXAMPLES = _docstring_examples()


def test_the_docstrings_have_examples() -> None:
    assert len(EXAMPLES) > 30


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name for test in EXAMPLES])
def test_a_docstring_example_needs_nothing_but_its_own_imports(example: doctest.DocTest) -> None:
    # pytest's doctests run with the module's globals, where torch and the module's own
    # names are at hand; a reader's interpreter has none of them.
    example.globs = {"__name__": "__main__"}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures: list[str] = []
    runner.run(example, out=failures.append)
    assert runner.failures == 0, "".join(failures)
