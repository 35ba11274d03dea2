"""Bagua's ``ByteGradAlgorithm``: the engine's ``bytegrad`` (MinMax uint8 compressed gradient exchange)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...engine.algorithms.bytegrad import ByteGradAlgorithm as _Engine
from .base import Algorithm, EngineAlgorithmImpl

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = ["ByteGradAlgorithm", "ByteGradAlgorithmImpl"]


class ByteGradAlgorithmImpl(EngineAlgorithmImpl):
    """Gradient buckets reduced with a compressed scatter-gather.

    Args:
        process_group: the process group to work on.
        hierarchical: full-precision reduce within each node, compressed exchange among node
            leaders only, broadcast within the node (nothing is compressed with one node).
        average: average the gradients (True) or sum them.
    """

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True, average: bool = True) -> None:
        super().__init__(process_group, _Engine(hierarchical=hierarchical, average=average))
        self.hierarchical = hierarchical
        self.average = average


class ByteGradAlgorithm(Algorithm):
    """Create a ByteGrad algorithm (Bagua's defaults).

    Args:
        hierarchical: enable hierarchical communication.
        average: average the gradients (True) or sum them.
    """

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        _Engine(hierarchical=hierarchical, average=average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, process_group: BaguaProcessGroup) -> ByteGradAlgorithmImpl:
        return ByteGradAlgorithmImpl(process_group, hierarchical=self.hierarchical, average=self.average)
