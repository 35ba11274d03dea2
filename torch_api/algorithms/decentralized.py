"""Bagua's ``DecentralizedAlgorithm`` and ``LowPrecisionDecentralizedAlgorithm``: the engine's implementations.

``model.bagua_buckets[i]`` exposes the engine's state under Bagua's names:
``_peer_weight`` (decentralized: the averaged weights of the latest communicating
step) and ``_weight``, ``_left_peer_weight``, ``_right_peer_weight`` (low precision:
this rank's and its ring neighbours' public weights), each a flat tensor in the
bucket's tensor order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ...engine.algorithms.decentralized import DecentralizedAlgorithm as _Decentralized
from ...engine.algorithms.low_precision_decentralized import (
    LowPrecisionDecentralizedAlgorithm as _LowPrecision,
)
from .base import Algorithm, EngineAlgorithmImpl

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = [
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
]


class DecentralizedAlgorithmImpl(EngineAlgorithmImpl):
    """Decentralized SGD: weights averaged with all ranks or one changing peer.

    Args:
        process_group: the process group to work on.
        hierarchical: average within the node first; node leaders exchange; broadcast within the node.
        peer_selection_mode: ``"all"`` or ``"shift_one"``.
        communication_interval: optimizer steps between two communications.
    """

    bucket_state: ClassVar[dict[str, str]] = {"_peer_weight": "peer_weights"}

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1) -> None:
        super().__init__(process_group, _Decentralized(hierarchical=hierarchical,
                                                       peer_selection_mode=peer_selection_mode,
                                                       communication_interval=communication_interval))
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval


class DecentralizedAlgorithm(Algorithm):
    """Create a Decentralized SGD algorithm (Bagua's defaults).

    Args:
        hierarchical: enable hierarchical communication.
        peer_selection_mode: ``"all"`` (average with every rank) or ``"shift_one"`` (one peer per step).
        communication_interval: number of iterations between two communication steps.
    """

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1) -> None:
        _Decentralized(hierarchical=hierarchical, peer_selection_mode=peer_selection_mode,
                       communication_interval=communication_interval)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> DecentralizedAlgorithmImpl:
        return DecentralizedAlgorithmImpl(process_group, hierarchical=self.hierarchical,
                                          peer_selection_mode=self.peer_selection_mode,
                                          communication_interval=self.communication_interval)


class LowPrecisionDecentralizedAlgorithmImpl(EngineAlgorithmImpl):
    """Decentralized SGD on a ring, exchanging MinMax uint8 compressed weight differences.

    Args:
        process_group: the process group to work on.
        hierarchical: average within the node first; node leaders run the ring; broadcast within the node.
        communication_interval: optimizer steps between two communications.
    """

    bucket_state: ClassVar[dict[str, str]] = {
        "_weight": "_weight", "_left_peer_weight": "_left", "_right_peer_weight": "_right",
    }

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True,
                 communication_interval: int = 1) -> None:
        super().__init__(process_group, _LowPrecision(hierarchical=hierarchical,
                                                      communication_interval=communication_interval))
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Create a Low Precision Decentralized SGD algorithm (Bagua's defaults).

    Args:
        hierarchical: enable hierarchical communication.
        communication_interval: number of iterations between two communication steps.
    """

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        _LowPrecision(hierarchical=hierarchical, communication_interval=communication_interval)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> LowPrecisionDecentralizedAlgorithmImpl:
        return LowPrecisionDecentralizedAlgorithmImpl(process_group, hierarchical=self.hierarchical,
                                                      communication_interval=self.communication_interval)
