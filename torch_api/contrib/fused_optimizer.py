"""The fused optimizer under its module name (implementation: ``strategy/contrib/fused_optimizer.py``)."""

from ...strategy.contrib.fused_optimizer import fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]
