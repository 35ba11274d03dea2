"""Bagua's ``moe.layer``."""

from ....engine.contrib.moe.layer import MoE

__all__ = ["MoE"]
