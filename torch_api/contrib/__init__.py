"""Bagua's ``bagua.torch_api.contrib``: fused optimizer, load-balancing samplers, SyncBatchNorm.

The implementations live in ``bagua_lightning.strategy.contrib`` (usable with ``BaguaStrategy`` too).
"""

from .fuse.optimizer import fuse_optimizer, fuse_step, is_fused_optimizer
from .load_balancing_data_loader import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from .sync_batchnorm import SyncBatchNorm

__all__ = [
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "SyncBatchNorm",
    "fuse_optimizer",
    "fuse_step",
    "is_fused_optimizer",
]
