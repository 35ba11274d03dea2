"""Bagua's older import path of the fused optimizer (``bagua.torch_api.fuse_optimizer``)."""

from .contrib.fused_optimizer import FusedOptimizer

__all__ = ["FusedOptimizer"]
