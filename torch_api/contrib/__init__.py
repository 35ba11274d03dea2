"""Bagua's ``bagua.torch_api.contrib``: fused optimizer, load-balancing samplers, SyncBatchNorm, cached dataset.

The implementations live in ``bagua_lightning.engine.contrib`` and ``bagua_lightning.client.cache``
(usable with ``BaguaStrategy`` too).
"""

from .cache_loader import CacheLoader
from .cached_dataset import CachedDataset
from .fuse.optimizer import fuse_optimizer, fuse_step, is_fused_optimizer
from .fused_optimizer import FusedOptimizer
from .load_balancing_data_loader import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from .sync_batchnorm import SyncBatchNorm

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
