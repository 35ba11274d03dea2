"""Bagua's ``bagua.torch_api.contrib.fuse.optimizer`` (implementation: ``engine/contrib/fused_optimizer.py``)."""

from ....engine.contrib.fused_optimizer import (
    calculate_mutual_groups,
    fuse_optimizer,
    fuse_step,
    is_fused_optimizer,
)

__all__ = ["calculate_mutual_groups", "fuse_optimizer", "fuse_step", "is_fused_optimizer"]
