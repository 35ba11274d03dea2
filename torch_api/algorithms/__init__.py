"""Bagua's algorithms (``bagua.torch_api.algorithms``): ``Algorithm`` factories over the engine's implementations.

Every algorithm registered in the engine is also reachable here by Bagua's class name
(``algorithms.GradientAllReduceAlgorithm``), derived from its registration; the submodules keep
Bagua's import paths for the builtin ones.
"""

from __future__ import annotations

from typing import Any

from . import async_model_average, auto, bytegrad, decentralized, gradient_allreduce, q_adam
from .base import Algorithm, AlgorithmImpl, bagua_algorithms

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "async_model_average",
    "auto",
    "bytegrad",
    "decentralized",
    "gradient_allreduce",
    "q_adam",
]


def __dir__() -> list[str]:
    return sorted({*globals(), *bagua_algorithms()})


def __getattr__(name: str) -> Any:
    classes = bagua_algorithms()
    if name in classes:
        return classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
