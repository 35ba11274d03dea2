"""Bagua's ``AsyncModelAverageAlgorithm``: the engine's ``async`` (background weight averaging).

Derived from the engine's registration (:func:`~bagua_lightning.torch_api.algorithms.base.bagua_algorithm`);
this module keeps Bagua's import path.
"""

from __future__ import annotations

from .base import bagua_algorithm

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]

AsyncModelAverageAlgorithm, AsyncModelAverageAlgorithmImpl = bagua_algorithm("async")
