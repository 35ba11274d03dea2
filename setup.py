"""Package discovery for the one import root, ``bagua_lightning``.

``pyproject.toml`` maps each top-level folder to a subpackage (``[tool.setuptools] package-dir``);
this file lists every package below those folders (each folder with an ``__init__.py``), so a new
subpackage needs no edit here or there.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _packages() -> list[str]:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: set[str] = set()
    for name, folder in package_dir.items():
        if not name:
            continue
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    return sorted(found)


setup(packages=_packages())
