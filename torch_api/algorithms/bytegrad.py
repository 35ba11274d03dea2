"""Bagua's ``ByteGradAlgorithm``: the engine's ``bytegrad`` (MinMax uint8 compressed gradient exchange).

Derived from the engine's registration (:func:`~bagua_lightning.torch_api.algorithms.base.bagua_algorithm`);
this module keeps Bagua's import path.
"""

from __future__ import annotations

from .base import bagua_algorithm

__all__ = ["ByteGradAlgorithm", "ByteGradAlgorithmImpl"]

ByteGradAlgorithm, ByteGradAlgorithmImpl = bagua_algorithm("bytegrad")
