"""Bagua's ``moe.utils``."""

from ....strategy.contrib.moe.utils import is_moe_param

__all__ = ["is_moe_param"]
