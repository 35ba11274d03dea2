"""Trainer side: BaguaStrategy, its algorithms and bucket machinery (runs in every training rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bagua_lightning.proto.plan import BucketPlan
from bagua_lightning.strategy.algorithms.q_adam import QAdamOptimizer

if TYPE_CHECKING:  # pragma: no cover
    from bagua_lightning.strategy.ddp import BaguaDistributedDataParallel
    from bagua_lightning.strategy.strategy import BaguaStrategy

__all__ = ["BaguaDistributedDataParallel", "BaguaStrategy", "BucketPlan", "QAdamOptimizer"]


def __getattr__(name: str) -> Any:
    # Lightning is imported only when the strategy itself is asked for.
    if name == "BaguaStrategy":
        from bagua_lightning.strategy.strategy import BaguaStrategy

        return BaguaStrategy
    if name == "BaguaDistributedDataParallel":
        from bagua_lightning.strategy.ddp import BaguaDistributedDataParallel

        return BaguaDistributedDataParallel
    raise AttributeError(f"module 'bagua_lightning.strategy' has no attribute {name!r}")
