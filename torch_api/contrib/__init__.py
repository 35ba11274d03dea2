"""Bagua's ``bagua.torch_api.contrib``: fused optimizer, load-balancing samplers, SyncBatchNorm, cached dataset.

The implementations live in ``bagua_lightning.engine.contrib`` and ``bagua_lightning.client.cache``
(usable with ``BaguaStrategy`` too).
"""

from typing import TYPE_CHECKING, Any

from .fuse.optimizer import fuse_optimizer, fuse_step, is_fused_optimizer
from .fused_optimizer import FusedOptimizer
from .load_balancing_data_loader import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from .sync_batchnorm import SyncBatchNorm

if TYPE_CHECKING:
    from .cache_loader import CacheLoader
    from .cached_dataset import CachedDataset


def __getattr__(name: str) -> Any:
    # The cache (redis-py, and through it OpenTelemetry: ~0.4 s) loads when first asked for, not with every
    # rank that imports torch_api.
    if name == "CacheLoader":
        from .cache_loader import CacheLoader

        return CacheLoader
    if name == "CachedDataset":
        from .cached_dataset import CachedDataset

        return CachedDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "CacheLoader", "CachedDataset"})


__all__ = [
    "CacheLoader",
    "CachedDataset",
    "FusedOptimizer",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "SyncBatchNorm",
    "fuse_optimizer",
    "fuse_step",
    "is_fused_optimizer",
]
