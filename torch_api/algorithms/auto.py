"""``AutoAlgorithm``: the engine's ``auto`` (measure candidate algorithms in flight, keep the fastest).

Derived from the engine's registration (:func:`~bagua_lightning.torch_api.algorithms.base.bagua_algorithm`)::

    from bagua_lightning.torch_api.algorithms import AutoAlgorithm

    algorithm = AutoAlgorithm(candidates=["gradient_allreduce", "bytegrad"], warmup_steps=3, trial_steps=10)
    model = model.with_bagua([optimizer], algorithm)
    ...  # train; after len(candidates) * (warmup_steps + trial_steps) steps:
    algorithm.selection.chosen, algorithm.selection.step_ms, algorithm.selection.reason()
"""

from __future__ import annotations

from .base import bagua_algorithm

__all__ = ["AutoAlgorithm", "AutoAlgorithmImpl"]

AutoAlgorithm, AutoAlgorithmImpl = bagua_algorithm("auto")
