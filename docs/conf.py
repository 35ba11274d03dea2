"""Sphinx configuration of bagua-lightning's documentation site (built by ``.ci/docs``).

Sphinx with MyST: the tools Lightning's and PyTorch's sites are built with, and autodoc renders Bagua's
names (``bagua_lightning.torch_api.algorithms.bytegrad.ByteGradAlgorithm``) from their docstrings.
The pages are the Markdown files of this folder; the API reference, the CLI page and the gRPC page are
generated from the docstrings, the argparse parser and the proto's comments at build time.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

import bagua_lightning  # noqa: E402  (the installed package: docs of what is importable)

project = "bagua-lightning"
author = "bagua-lightning developers"
copyright = "bagua-lightning developers, Apache-2.0"
release = version = bagua_lightning.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinxarg.ext",
    "bagua_docs",
]

# Markdown pages; README.md of the repository is not one of them (it links into this site).
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "README.md"]
# Pages named in a toctree that are left out while they do not exist (bagua_docs drops their entry): pages
# being written beside this site.
bagua_optional_docs = ["fault_tolerance", "compressors", "peer_watch"]
# A short type name in a signature
# (`BaguaProcessGroup`, defined once, re-exported by several modules) finds several targets: the first is
# right, so Sphinx's "more than one target" notes are not errors; nor is a code block that its lexer cannot
# parse (a JSON example with `...`): it is shown without colours.
suppress_warnings = ["ref.python", "misc.highlighting_failure"]

# Command lines are the subject: `--fresh` stays two hyphens, quotes stay straight.
smartquotes = False

myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline", "attrs_block"]
# GitHub's anchors (`deployment.md#many-machines`), so links that work on GitHub work here.
myst_heading_anchors = 4

# Autodoc: Google-style docstrings, members in source order, signatures with their types.
autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Docstrings name types such as ``torch.Tensor`` and ``nn.Module``; without network access intersphinx
# resolves nothing, so unresolved Python references are not warnings (nitpicky stays off).
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

html_theme = "furo"
html_title = f"bagua-lightning {release}"
html_static_path = ["_static"]
html_css_files = ["bagua.css"]
html_theme_options = {
    "source_repository": "https://github.com/bagua-lightning/bagua-lightning",
    "source_branch": "main",
    "source_directory": "docs/",
}
html_show_sourcelink = False
# A link to a file of the repository (`../client/cache/keys.py`) goes to that file on GitHub.
bagua_repository_url = "https://github.com/bagua-lightning/bagua-lightning/blob/main/"
