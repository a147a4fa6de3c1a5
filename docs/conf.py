"""Sphinx configuration of distbench's docs: MyST markdown pages, the furo theme, and references generated from
the code (_ext/distbench_docs.py). CI builds it strictly: `sphinx-build -W --keep-going -n -b html docs OUT`."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE / "_ext")]

from distbench import __version__  # noqa: E402

project = "distbench"
author = "the distbench authors"
copyright = "the distbench authors"
release = version = __version__

extensions = ["myst_parser", "distbench_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# Strict: every reference must resolve (with -n), headings get anchors pages can link to (`page.md#a-heading`).
nitpicky = True
# Commands are quoted in prose too: `--lanes` must stay two hyphens, not become an en dash.
smartquotes = False
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]

html_theme = "furo"
html_title = f"distbench {release}"
html_copy_source = False
