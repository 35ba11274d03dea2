"""Registers ``"bagua"`` and one ``"bagua_<algorithm>"`` alias per algorithm in Lightning's strategy registry.

Lightning 2.x no longer knows Bagua by itself.
"""

from __future__ import annotations


def register_bagua_strategy() -> None:
    """Make ``Trainer(strategy="bagua")`` and ``"bagua_bytegrad"``, ... resolve to :class:`BaguaStrategy`; idempotent."""
    import sys

    from lightning.pytorch.strategies import StrategyRegistry

    loading = sys.modules.get(f"{__package__}.strategy")
    if loading is not None and not hasattr(loading, "BaguaStrategy"):
        # strategy.py itself imported Lightning (whose import registers us): it registers at its end.
        return
    from .strategy import BaguaStrategy

    if BaguaStrategy.strategy_name not in StrategyRegistry:
        BaguaStrategy.register_strategies(StrategyRegistry)
