"""Bagua's contrib, rebuilt: fused optimizer, load-balancing samplers, SyncBatchNorm, mixture of experts.

Usable on their own, with ``BaguaStrategy`` and through ``bagua_lightning.torch_api.contrib``.
"""

from .fused_optimizer import fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]
