"""Bagua's contrib under the strategy's path: the engine's implementations, plus the Lightning glue.

``bagua_lightning.strategy.contrib`` is the documented import path; the implementations live in
:mod:`bagua_lightning.engine.contrib` (``torch_api`` re-exports them under Bagua's paths too), and
:mod:`.lightning` adapts a ``Trainer`` to them.
"""

from ...engine.contrib import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
    MoE,
    SyncBatchNorm,
    fuse_optimizer,
    fuse_step,
    is_fused_optimizer,
    is_moe_param,
    moe,
)

__all__ = [
    "LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler", "MoE", "SyncBatchNorm",
    "fuse_optimizer", "fuse_step", "is_fused_optimizer", "is_moe_param", "moe",
]
