"""Bagua's ``moe.experts``."""

from ....strategy.contrib.moe.experts import Experts

__all__ = ["Experts"]
