"""Bagua's ``GradientAllReduceAlgorithm``: the engine's ``gradient_allreduce``.

Derived from the engine's registration (:func:`~bagua_lightning.torch_api.algorithms.base.bagua_algorithm`);
this module keeps Bagua's import path.
"""

from __future__ import annotations

from .base import bagua_algorithm

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]

GradientAllReduceAlgorithm, GradientAllReduceAlgorithmImpl = bagua_algorithm("gradient_allreduce")
