"""Bagua's ``moe.experts``."""

from ....engine.contrib.moe.experts import Experts

__all__ = ["Experts"]
