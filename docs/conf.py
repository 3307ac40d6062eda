"""Sphinx configuration for the devicekit documentation."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import _inventories  # lives beside this file, found through the path above

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
]

templates_path = ["_templates"]
html_theme = "furo"
html_title = f"devicekit {release}"
exclude_patterns = ["_build"]

autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# The constructor is documented as a function, so its annotations are evaluated as a
# function's are (a class signature would show type aliases as unresolved strings).
autodoc_class_signature = "separated"
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
    ("py:class", "C"),
    ("py:class", "devicekit._transfer.T"),
    ("py:class", "devicekit._transfer.C"),
    ("py:class", "devicekit._loader.B"),  # the batch type DeviceDataLoader is generic in
    ("py:obj", "devicekit._loader.B"),
    # PyTorch documents no page for the handle its hooks return.
    ("py:class", "torch.utils.hooks.RemovableHandle"),
]

doctest_global_setup = """
import torch
import devicekit as dk
"""
