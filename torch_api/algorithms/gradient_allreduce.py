"""Bagua's ``GradientAllReduceAlgorithm``: the engine's ``gradient_allreduce``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm as _Engine
from .base import Algorithm, EngineAlgorithmImpl

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(EngineAlgorithmImpl):
    """Gradients averaged (or summed) over the group, bucket by bucket, overlapped with backward.

    Args:
        process_group: the process group to work on.
        hierarchical: reduce within each node, allreduce among node leaders, broadcast within the node.
        average: average the gradients (True) or sum them.
    """

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = False, average: bool = True) -> None:
        super().__init__(process_group, _Engine(hierarchical=hierarchical, average=average))
        self.hierarchical = hierarchical
        self.average = average


class GradientAllReduceAlgorithm(Algorithm):
    """Create a GradientAllReduce algorithm (Bagua's defaults).

    Args:
        hierarchical: enable hierarchical communication (intra-node first, then among node leaders).
        average: average the gradients (True) or sum them.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        _Engine(hierarchical=hierarchical, average=average)  # validate now, not at wrap time
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, process_group: BaguaProcessGroup) -> GradientAllReduceAlgorithmImpl:
        return GradientAllReduceAlgorithmImpl(process_group, hierarchical=self.hierarchical, average=self.average)
