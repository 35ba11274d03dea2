"""Bagua's ``QAdamAlgorithm`` and ``QAdamOptimizer``: the engine's ``qadam``.

Derived from the engine's registration (:func:`~bagua_lightning.torch_api.algorithms.base.bagua_algorithm`);
this module keeps Bagua's import path.
"""

from __future__ import annotations

from ...engine.algorithms.q_adam import QAdamOptimizer
from .base import bagua_algorithm

__all__ = ["QAdamAlgorithm", "QAdamAlgorithmImpl", "QAdamOptimizer"]

QAdamAlgorithm, QAdamAlgorithmImpl = bagua_algorithm("qadam")
