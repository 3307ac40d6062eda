"""Every Python snippet in the README runs as written, and prints what the README shows."""

from __future__ import annotations

import re
import subprocess
import sys
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
    code: str, output: str | None, tmp_path: Path
) -> None:
    # A fresh interpreter in an empty directory: what a reader gets who pastes it.
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"{code}\nfailed with:\n{result.stderr[-3000:]}"
    if output is not None:
        assert result.stdout == output
