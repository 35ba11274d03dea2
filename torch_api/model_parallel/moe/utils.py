"""Bagua's ``moe.utils``."""

from ....engine.contrib.moe.utils import is_moe_param

__all__ = ["is_moe_param"]
