"""Bagua's ``bagua.torch_api.contrib.fuse``."""

from .optimizer import fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]
