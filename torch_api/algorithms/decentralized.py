"""Bagua's ``DecentralizedAlgorithm`` and ``LowPrecisionDecentralizedAlgorithm``: the engine's implementations.

Derived from the engine's registrations (:func:`~bagua_lightning.torch_api.algorithms.base.bagua_algorithm`);
this module keeps Bagua's import path. ``model.bagua_buckets[i]`` exposes the engine's state under
Bagua's names: ``_peer_weight`` (decentralized: the averaged weights of the latest communicating
step) and ``_weight``, ``_left_peer_weight``, ``_right_peer_weight`` (low precision: this rank's and
its ring neighbours' public weights), each a flat tensor in the bucket's tensor order.
"""

from __future__ import annotations

from .base import bagua_algorithm

__all__ = [
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
]

DecentralizedAlgorithm, DecentralizedAlgorithmImpl = bagua_algorithm("decentralized")
LowPrecisionDecentralizedAlgorithm, LowPrecisionDecentralizedAlgorithmImpl = bagua_algorithm(
    "low_precision_decentralized")
