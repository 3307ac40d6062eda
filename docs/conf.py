"""Sphinx configuration for the devicekit documentation."""

from __future__ import annotations

import contextlib
import doctest
import sys
import typing
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import _doctor_findings  # lives beside this file, found through the path above
import _inventories  # likewise
import _pictures  # likewise
import _waiting  # likewise

import devicekit

project = "devicekit"
author = "The devicekit authors"
copyright = "2026, The devicekit authors"  # Sphinx's own name for it
release = devicekit.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.intersphinx",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

templates_path = ["_templates"]
html_theme = "furo"
html_title = f"devicekit {release}"
exclude_patterns = ["_build"]

autosummary_generate = True
# One parameter list per object, with the types in it: the class's own docstring
# documents the constructor's arguments, and autodoc merges the annotations of
# __init__ into that list (never a second list, never "Return type: None").
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_typehints_format = "short"
autodoc_class_signature = "mixed"
autoclass_content = "class"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Offline copies first (see _inventories.py), the real inventories when they are missing.
_local = _inventories.write_all(HERE / "_build" / "inventories")
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", (str(_local["python"]), None)),
    "torch": ("https://docs.pytorch.org/docs/stable", (str(_local["torch"]), None)),
    "hypothesis": (
        "https://hypothesis.readthedocs.io/en/latest",
        (str(_local["hypothesis"]), None),
    ),
}

nitpicky = True
nitpick_ignore = [
    # Type variables in signatures: the generic data type and the decorated callable.
    ("py:class", "T"),
    ("py:class", "F"),
    ("py:class", "devicekit._core._transfer.T"),
    ("py:class", "devicekit._core._kinds.F"),
    ("py:class", "devicekit._loader._loader.B"),  # the batch type DeviceDataLoader is generic in
    ("py:obj", "devicekit._loader._loader.B"),
    # PyTorch documents no page for the handle its hooks return.
    ("py:class", "torch.utils.hooks.RemovableHandle"),
    # Nor for torch.OutOfMemoryError (stand_in's memory= raises it).
    ("py:class", "torch.OutOfMemoryError"),
]

# No doctest_global_setup and no testsetup blocks: every page shows its own imports, so
# what the doctest build runs is what a reader pastes (tests/test_docs.py keeps it so).
# Sphinx ignores an exception's message by default; the messages are what these pages
# show, so they are compared too.
doctest_default_flags = doctest.ELLIPSIS | doctest.DONT_ACCEPT_TRUE_FOR_1

# The copy button takes the code without its prompts and without the output lines.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True

# Long lines (error messages, outputs) wrap instead of scrolling sideways.
html_static_path = ["_static"]
html_css_files = ["wrap.css"]


def _evaluate_annotations(app: Any, obj: Any, bound_method: bool) -> None:
    """Give autodoc the constructor's annotations as types, not as strings.

    The package's modules use ``from __future__ import annotations``. autodoc evaluates
    a function's string annotations, but not those of ``__init__`` when it merges them
    into the class's parameter list; there "DeviceLike | None" would stay a name no
    reader can look up. Evaluated, it reads ``device | str | int | None``.
    """
    function = getattr(obj, "__init__", None) if isinstance(obj, type) else obj
    if getattr(function, "__module__", "").startswith("devicekit"):
        with contextlib.suppress(Exception):  # leave what cannot be evaluated as it is
            function.__annotations__ = typing.get_type_hints(function)


# Records devicekit makes and users only read: their pages list the fields, and a
# constructor signature of every field (LoaderStats has two dozen) is noise.
_READ_ONLY_RECORDS = frozenset({"devicekit.LoaderStats"})


def _no_protocol_signature(  # noqa: PLR0917  # the event passes these seven positionally
    app: Any, what: str, name: str, obj: Any, options: Any, signature: Any, annotation: Any
) -> tuple[str, Any] | None:
    """No constructor signature where nobody calls it: a protocol, a record only read.

    A protocol is implemented, never called: ``Backend(*args, **kwargs)`` misleads.
    """
    if what == "class" and (getattr(obj, "_is_protocol", False) or name in _READ_ONLY_RECORDS):
        return "", annotation
    return None


def _measure_waiting(app: Any) -> None:
    """guide/waiting-for-data's figure (from _data/), guide/why-cpu's findings.

    Also the loader's two drawn pictures: its timeline and the verdict's bands.
    """
    _waiting.write(HERE / "_generated")
    _pictures.write(HERE / "_generated")
    _doctor_findings.write(HERE / "_generated")


def setup(app: Any) -> None:
    """Connect the hooks above."""
    app.connect("builder-inited", _measure_waiting)
    app.connect("autodoc-before-process-signature", _evaluate_annotations)
    app.connect("autodoc-process-signature", _no_protocol_signature)
