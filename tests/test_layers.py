"""The package's parts and their layers: which folder may import which, checked on the source.

docs/contributing.rst draws the same layers. Every import of every module counts, at module
level or inside a function (a lazy import is still an arrow), except those only a type
checker runs (under ``if TYPE_CHECKING:``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "devicekit"

# What each part may import, besides itself: the parts below it.
BELOW: dict[str, frozenset[str]] = {
    "_base": frozenset(),
    "_core": frozenset({"_base"}),
    "_select": frozenset({"_base"}),
    "_loader": frozenset({"_base", "_core"}),
    "_checks": frozenset({"_base", "_core"}),
    "_files": frozenset({"_base", "_core"}),
    "_memory": frozenset({"_base", "_core"}),
    "_doctor": frozenset({"_base", "_select"}),
}
BELOW["_commands"] = frozenset(BELOW) - {"_commands"}
BELOW["testing"] = frozenset(BELOW) - {"testing", "_commands"}
FACE = "the face"  # devicekit/__init__.py, cli.py, __main__.py: may import every part


def part_of(module: str) -> str:
    """``devicekit._core._tree`` -> ``_core``; the face's modules -> :data:`FACE`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in BELOW) else FACE


def module_name(path: Path, package: Path) -> str:
    relative = path.relative_to(package.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(source: str, module: str) -> list[tuple[str, int]]:
    """Every devicekit name ``module``'s source imports, with its line.

    ``from devicekit._core import _tree`` names ``devicekit._core._tree``; ``import
    devicekit`` names ``devicekit``. The package imports nothing relatively.
    """
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}:{node.lineno} imports relatively"
            found.extend((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return [(name, line) for name, line in found if name.split(".")[0] == "devicekit"]


def violations(sources: dict[str, str]) -> list[str]:
    """Each import of ``sources`` (module name -> source) that breaks the layers, in words."""
    found = []
    for module, source in sorted(sources.items()):
        here = part_of(module)
        if here == FACE:
            continue  # the face stands above every part
        for imported, line in imports(source, module):
            there = part_of(imported)
            where = f"{module}:{line} imports {imported}"
            if there == here:
                continue
            if there == FACE:
                found.append(f"{where}, of the face above")
            elif there not in BELOW[here]:
                found.append(f"{where}: {here} is not above {there}")
            elif imported.split(".")[2] in _modules_of(sources, there):
                found.append(
                    f"{where} past {there}'s face: import the name from devicekit.{there}, "
                    "whose __init__ exports what the layers above use"
                )
    return found


def _modules_of(sources: dict[str, str], part: str) -> set[str]:
    """The names of ``part``'s modules: ``_tree`` for ``devicekit._core._tree``."""
    inside = (name for name in sources if name.count(".") == 2 and part_of(name) == part)
    return {name.split(".")[2] for name in inside}


def circles(sources: dict[str, str]) -> list[list[str]]:
    """The import circles among ``sources``' modules, each as the modules on it."""
    graph = {
        module: {
            target
            for name, _ in imports(source, module)
            for target in (name, name.rpartition(".")[0])
            if target in sources and target != module
        }
        for module, source in sources.items()
    }
    graph = {module: targets - {_face_of(module)} for module, targets in graph.items()}
    found, done, path = [], set(), []

    def visit(module: str) -> None:
        if module in path:
            found.append(path[path.index(module) :])
            return
        if module in done:
            return
        path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return found


def _face_of(module: str) -> str:
    """A folder's modules are imported by its own face: that arrow is not a circle's."""
    return module.rpartition(".")[0]


def package_sources() -> dict[str, str]:
    return {
        module_name(path, PACKAGE): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_every_folder_is_a_part_with_a_face() -> None:
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir()} - {"__pycache__"}
    assert folders == set(BELOW)
    for part in BELOW:
        assert (PACKAGE / part / "__init__.py").is_file(), part
    loose = sorted(path.name for path in PACKAGE.glob("_*.py") if path.name != "__init__.py")
    assert loose == ["__main__.py"]  # no private module left beside the face


def test_no_module_imports_a_part_above_its_own_nor_past_a_part_s_face() -> None:
    assert violations(package_sources()) == []


def test_the_imports_run_in_no_circle() -> None:
    assert circles(package_sources()) == []


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        (
            "devicekit._core._tree",
            "from devicekit._select import DeviceManager",
            (
                "devicekit._core._tree:1 imports devicekit._select.DeviceManager: _core is not "
                "above _select"
            ),
        ),
        (
            "devicekit._select._manager",
            "def fallback():\n    from devicekit._doctor import _findings",
            (
                "devicekit._select._manager:2 imports devicekit._doctor._findings: _select is "
                "not above _doctor"
            ),
        ),
        (
            "devicekit._loader._loader",
            "from devicekit._core._tree import walk",
            "devicekit._loader._loader:1 imports devicekit._core._tree.walk past _core's face",
        ),
        (
            "devicekit._base._units",
            "from devicekit import DeviceManager",
            "devicekit._base._units:1 imports devicekit.DeviceManager, of the face above",
        ),
    ],
    ids=["core on select", "a lazy import upward", "past a face", "the face"],
)
def test_a_planted_import_is_found(module: str, line: str, expected: str) -> None:
    sources = package_sources()
    sources[module] = line + "\n" + sources[module]
    found = violations(sources)
    assert [message for message in found if message.startswith(expected)] != [], found
    assert len(found) == 1, found


def test_a_planted_circle_is_found() -> None:
    sources = package_sources()
    sources["devicekit._base._units"] = (
        "from devicekit._base._current import current_device\n" + sources["devicekit._base._units"]
    )
    sources["devicekit._base._current"] = (
        "from devicekit._base._units import count\n" + sources["devicekit._base._current"]
    )
    found = circles(sources)
    assert any({"devicekit._base._units", "devicekit._base._current"} <= set(c) for c in found)


def test_a_type_checker_s_import_is_no_arrow() -> None:
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from devicekit._select import X\n"
    )
    assert imports(source, "devicekit._core._tree") == []
