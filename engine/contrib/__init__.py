"""Bagua's contrib, rebuilt: fused optimizer, load-balancing samplers, SyncBatchNorm, mixture of experts.

Usable on their own, with ``BaguaStrategy`` and through ``bagua_lightning.torch_api.contrib`` /
``bagua_lightning.torch_api.model_parallel.moe``.
"""

from .fused_optimizer import fuse_optimizer, fuse_step, is_fused_optimizer
from .load_balancing import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from .moe import MoE, is_moe_param
from .sync_batchnorm import SyncBatchNorm

__all__ = [
    "LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler", "MoE", "SyncBatchNorm",
    "fuse_optimizer", "fuse_step", "is_fused_optimizer", "is_moe_param",
]
