"""``model.with_bagua(optimizers, algorithm, fault_tolerance=FaultTolerance(...))``: the engine's
fault-tolerant steps (:class:`~bagua_lightning.engine.elastic_step.ElasticSteps`) behind Bagua's API.

A script launched once per node (``torchrun --nproc-per-node R`` each, its own ``BAGUA_LIGHTNING_NODE_ID``,
one Lighthouse in ``TORCHFT_LIGHTHOUSE``)::

    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm(), fault_tolerance=FaultTolerance())
    loader = DataLoader(dataset, batch_sampler=model.bagua_batch_sampler(len(dataset), batch_size=32))
    for epoch in range(epochs):
        for x, y in loader:                # each batch begins a step: this rank's share, re-dealt as nodes change
            loss_fn(model(x), y).backward()
            optimizer.step()               # steps only when every node finished the step; else it is redone
            optimizer.zero_grad()

The batch sampler begins each step as the loader asks for the batch (so the loader must not fetch ahead:
``num_workers=0``); ``optimizer.step()`` commits it. A step that does not commit is skipped (logged) and
the sampler deals the same indices again at the next batch. A rank with nothing to train in the epoch's
last, short step gets no batch: the sampler runs that step itself (zero gradients, the commit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ConfigurationError
from ..engine.elastic_step import (
    ElasticBatchSampler,
    ElasticSteps,
    load_node_state,
    node_state,
    zero_backward,
)
from ..engine.fault_tolerance import ElasticSampler, FaultTolerance

if TYPE_CHECKING:  # pragma: no cover
    from ..engine.algorithms.base import Algorithm
    from ..engine.ddp import AlgorithmDriver

log = logging.getLogger(__name__)

__all__ = ["ElasticModule", "FaultTolerance"]


class ElasticModule:
    """One wrapped module's fault-tolerant steps: its optimizer's ``step`` commits, its batch sampler begins.

    Args:
        module: the module ``with_bagua`` wraps.
        optimizers: its optimizer (exactly one: a step commits once).
        engine: the engine algorithm, not set up yet (refused with the reason when it cannot train so).
        config: the nodes' settings.
    """

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], engine: Algorithm,
                 config: FaultTolerance) -> None:
        if not isinstance(config, FaultTolerance):
            raise ConfigurationError(f"fault_tolerance must be a FaultTolerance, got {config!r}; e.g. "
                                     "with_bagua([optimizer], algorithm, fault_tolerance=FaultTolerance())")
        if len(optimizers) != 1:
            raise ConfigurationError(f"with_bagua(fault_tolerance=...) commits one optimizer step per step; got "
                                     f"{len(optimizers)} optimizers: pass exactly one")
        self.module, self.optimizer = module, optimizers[0]
        self._driver: AlgorithmDriver | None = None
        rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.steps = ElasticSteps(config, state=self.state_dict, load_state=self.load_state_dict,
                                  local_rank=rank, local_size=size)
        self.steps.prepare(engine)
        self._step = self.optimizer.step
        self.optimizer.step = self._committing_step  # type: ignore[method-assign]

    def bind(self, driver: AlgorithmDriver) -> None:
        """The driver ``with_bagua`` built (after :meth:`ElasticSteps.prepare`)."""
        self._driver = driver

    @property
    def driver(self) -> AlgorithmDriver:
        if self._driver is None:
            raise ConfigurationError("with_bagua(fault_tolerance=...) needs a rank of the process group")
        return self._driver

    def batch_sampler(self, num_samples: int, batch_size: int, *, seed: int = 0,
                      shuffle: bool = True) -> ElasticBatchSampler:
        """A ``DataLoader`` batch sampler dealing ``num_samples`` indices, ``batch_size`` per rank and step, over
        the nodes alive at each step (the same ``seed`` on every node); ``len()`` is an upper bound."""
        if self.steps.open:
            raise ConfigurationError("bagua_batch_sampler() was called during a step; call it before training")
        self.steps.sampler = ElasticSampler(num_samples, batch_size, seed=seed, shuffle=shuffle)
        return ElasticBatchSampler(self.steps, self._empty_step)

    def _committing_step(self, closure: Callable[[], Any] | None = None) -> Any:
        result: list[Any] = [None]

        def step() -> None:
            result[0] = self._step(closure) if closure is not None else self._step()

        self.steps.end(step)
        return result[0]

    def _empty_step(self) -> None:
        """This rank's share of the step is empty: zero gradients through the hooks, then the commit."""
        zero_backward(self.driver)
        self.steps.end(self._step)
        self.optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return node_state(self.module, [self.optimizer], self.steps.sampler, self.driver)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_node_state(state, self.module, [self.optimizer], self.steps.sampler, self.driver)
        log.info("fault tolerance: healed from a live peer at step %d", self.driver.step)

    def close(self) -> None:
        """Leave the job and give the optimizer its own ``step`` back."""
        self.steps.shutdown()
        if self.optimizer.__dict__.get("step") == self._committing_step:
            del self.optimizer.step
