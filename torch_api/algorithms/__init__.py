"""Bagua's algorithms (``bagua.torch_api.algorithms``): ``Algorithm`` factories over the engine's implementations."""

from __future__ import annotations

from . import async_model_average, bytegrad, decentralized, gradient_allreduce, q_adam
from .base import Algorithm, AlgorithmImpl

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "async_model_average",
    "bytegrad",
    "decentralized",
    "gradient_allreduce",
    "q_adam",
]
