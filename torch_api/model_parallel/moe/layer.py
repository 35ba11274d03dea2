"""Bagua's ``moe.layer``."""

from ....strategy.contrib.moe.layer import MoE

__all__ = ["MoE"]
