"""The Lightning front door: ``BaguaStrategy`` over the engine (:mod:`bagua_lightning.engine`), in every training rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine.algorithms.q_adam import QAdamOptimizer
from ..proto.plan import BucketPlan

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.ddp import BaguaDistributedDataParallel
    from .strategy import BaguaStrategy

__all__ = ["BaguaDistributedDataParallel", "BaguaStrategy", "BucketPlan", "QAdamOptimizer"]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    # Lightning is imported only when the strategy itself is asked for.
    if name == "BaguaStrategy":
        from .strategy import BaguaStrategy

        return BaguaStrategy
    if name == "BaguaDistributedDataParallel":
        from ..engine.ddp import BaguaDistributedDataParallel

        return BaguaDistributedDataParallel
    raise AttributeError(f"module 'bagua_lightning.strategy' has no attribute {name!r}")
