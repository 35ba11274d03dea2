"""Bagua's ``AsyncModelAverageAlgorithm``: the engine's ``async`` (background weight averaging)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ...engine.algorithms.async_model_average import AsyncModelAverageAlgorithm as _Engine
from .base import Algorithm, EngineAlgorithmImpl

if TYPE_CHECKING:  # pragma: no cover
    from ..process_group import BaguaProcessGroup

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]


class AsyncModelAverageAlgorithmImpl(EngineAlgorithmImpl):
    """Gradient allreduce during warm-up, then weights averaged every ``sync_interval_ms`` in the background.

    Args:
        process_group: the process group to work on.
        peer_selection_mode: ``"all"`` (the only mode, as in Bagua).
        sync_interval_ms: milliseconds between two averaging rounds.
        warmup_steps: steps of gradient allreduce before averaging starts (0: none).
    """

    engine: _Engine

    def __init__(self, process_group: BaguaProcessGroup, peer_selection_mode: str = "all",
                 sync_interval_ms: int = 500, warmup_steps: int = 0) -> None:
        super().__init__(process_group, _Engine(peer_selection_mode=peer_selection_mode,
                                                sync_interval_ms=sync_interval_ms, warmup_steps=warmup_steps))
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def abort(self, bagua_module: nn.Module) -> None:
        """Stop background averaging; call on every rank after training (a no-op when already stopped)."""
        self.engine.abort(bagua_module)

    def resume(self, bagua_module: nn.Module) -> None:
        """Restart background averaging stopped by :meth:`abort`; call on every rank before training."""
        self.engine.resume(bagua_module)


class AsyncModelAverageAlgorithm(Algorithm):
    """Create an asynchronous model averaging algorithm (Bagua's defaults).

    Args:
        peer_selection_mode: ``"all"``: every rank's weights are averaged in each round.
        sync_interval_ms: milliseconds between two model synchronizations.
        warmup_steps: steps of gradient allreduce before averaging starts; 0 disables warm-up.
    """

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0) -> None:
        _Engine(peer_selection_mode=peer_selection_mode, sync_interval_ms=sync_interval_ms, warmup_steps=warmup_steps)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def reify(self, process_group: BaguaProcessGroup) -> AsyncModelAverageAlgorithmImpl:
        return AsyncModelAverageAlgorithmImpl(process_group, peer_selection_mode=self.peer_selection_mode,
                                              sync_interval_ms=self.sync_interval_ms, warmup_steps=self.warmup_steps)

    def abort(self, bagua_module: nn.Module) -> None:
        """Stop background averaging of ``bagua_module`` (as its ``bagua_algorithm.abort``)."""
        bagua_module.bagua_algorithm.abort(bagua_module)  # type: ignore[operator, union-attr]

    def resume(self, bagua_module: nn.Module) -> None:
        """Resume background averaging of ``bagua_module`` (as its ``bagua_algorithm.resume``)."""
        bagua_module.bagua_algorithm.resume(bagua_module)  # type: ignore[operator, union-attr]
