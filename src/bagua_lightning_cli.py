"""Entry point of the ``bagua-lightning`` console script.

It lives outside the ``bagua_lightning`` package so that it can ask the package
not to register the Lightning strategy *before* the package is imported: the CLI
drives services and never needs it, and importing Lightning costs seconds.
"""

from __future__ import annotations

import os


def main() -> int:
    os.environ.setdefault("BAGUA_LIGHTNING_NO_STRATEGY", "1")
    from bagua_lightning.cli import main as cli_main

    return cli_main()
