"""Registers ``"bagua"`` and one ``"bagua_<algorithm>"`` alias per algorithm in Lightning's strategy registry.

Lightning 2.x no longer knows Bagua by itself. The package root calls :func:`register_bagua_strategy`
once ``lightning.pytorch`` is imported; ``strategy.py`` registers itself when it is the module that
imported Lightning.
"""

from __future__ import annotations

import sys


def register_bagua_strategy() -> None:
    """Make ``Trainer(strategy="bagua")`` and ``"bagua_bytegrad"``, ... resolve to ``BaguaStrategy``; idempotent."""
    loading = sys.modules.get(f"{__package__}.strategy")
    if loading is not None and not hasattr(loading, "BaguaStrategy"):
        # strategy.py is importing Lightning (whose import calls us): it registers at its end.
        return
    # Imported here, not at the top: importing this module must stay free of Lightning until it is loaded.
    from .strategy import BaguaStrategy

    BaguaStrategy.ensure_registered()
