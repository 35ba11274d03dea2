"""Bagua's ``QAdamAlgorithm`` and ``QAdamOptimizer``: the engine's ``qadam``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...engine.algorithms.q_adam import QAdamAlgorithm as _Engine
from ...engine.algorithms.q_adam import QAdamOptimizer, QAdamOptimizerError
from .base import Algorithm, EngineAlgorithmImpl

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = ["QAdamAlgorithm", "QAdamAlgorithmImpl", "QAdamOptimizer"]


def _check(optimizer: object) -> QAdamOptimizer:
    if not isinstance(optimizer, QAdamOptimizer):
        raise QAdamOptimizerError(
            f"QAdamAlgorithm needs the model's QAdamOptimizer, got {type(optimizer).__name__}; build one with "
            "QAdamOptimizer(model.parameters(), ...) and pass it to with_bagua too"
        )
    return optimizer


class QAdamAlgorithmImpl(EngineAlgorithmImpl):
    """Gradient allreduce during warm-up, then the compressed exchange of Adam's first moment.

    Args:
        process_group: the process group to work on.
        q_adam_optimizer: the model's :class:`QAdamOptimizer` (also passed to ``with_bagua``).
        hierarchical: reduce within the node first; only node leaders exchange.
    """

    def __init__(self, process_group: BaguaProcessGroup, q_adam_optimizer: QAdamOptimizer,
                 hierarchical: bool = True) -> None:
        super().__init__(process_group, _Engine(hierarchical=hierarchical))
        self.optimizer = _check(q_adam_optimizer)
        self.hierarchical = hierarchical


class QAdamAlgorithm(Algorithm):
    """Create a QAdam algorithm.

    Args:
        q_adam_optimizer: a QAdamOptimizer initialised with the model's parameters.
        hierarchical: enable hierarchical communication.
    """

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True) -> None:
        self.optimizer = _check(q_adam_optimizer)
        _Engine(hierarchical=hierarchical)
        self.hierarchical = hierarchical

    def reify(self, process_group: BaguaProcessGroup) -> QAdamAlgorithmImpl:
        return QAdamAlgorithmImpl(process_group, self.optimizer, hierarchical=self.hierarchical)
