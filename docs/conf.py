"""Sphinx configuration of the ampfuse manual (``make docs``: MyST markdown pages, the Python API
reference from the docstrings, warnings as errors)."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import ampfuse  # noqa: E402  (autodoc documents the built package)

project = "ampfuse"
author = "the ampfuse developers"
copyright = "the ampfuse developers"
release = ampfuse.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_generated"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# No network at build time: cross-references to torch stay plain text.
intersphinx_mapping: dict = {}
nitpicky = False

html_theme = "alabaster"
html_title = f"ampfuse {release}"
html_static_path: list[str] = []
