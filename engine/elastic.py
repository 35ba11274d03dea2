"""The fault-tolerant training loop (:class:`ElasticTraining`); the coordinator is ``bagua-lightning lighthouse``.

A script launched once per node (``torchrun --nproc-per-node R`` on each node, every node with its own
``BAGUA_LIGHTNING_NODE_ID``, all pointing at one Lighthouse through ``TORCHFT_LIGHTHOUSE``)::

    training = ElasticTraining(model, optimizer, GradientAllReduceAlgorithm(), ElasticSampler(len(data), 32),
                               FaultTolerance(min_nodes=1))
    for epoch in range(epochs):
        for indices in training.epoch():          # this rank's share of the step, re-dealt when nodes change
            x, y = data[indices]
            loss_fn(training.model(x), y).backward()
        # the loop steps the optimizer only when every node of the step finished it

The design, its costs and its failure model are in docs/fault_tolerance.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ConfigurationError
from ..proto.plan import BucketPlan
from .algorithms.base import Algorithm
from .comm import CommContext
from .ddp import BaguaDistributedDataParallel
from .fault_tolerance import ElasticSampler, ElasticSession, FaultTolerance, Membership
from .parameters import trainable_parameters

log = logging.getLogger(__name__)

__all__ = ["ElasticTraining"]


class ElasticTraining:
    """``module`` trained with ``algorithm`` on every node alive at each step.

    Args:
        module: the model, on its device (the same initial weights on every rank are not needed: a node
            that joins takes a live peer's).
        optimizer: its optimizer; stepped by the loop only when the step commits.
        algorithm: an engine gradient algorithm (its step runs inside the node; each bucket is then averaged
            across the nodes). Others are refused with the reason.
        sampler: the epoch's indices, dealt over the live nodes.
        config: the nodes' settings (``min_nodes``, the coordinator, timeouts).
        on_commit: called with ``(indices, membership)`` after each committed step, before the sampler
            moves on (``sampler.step_indices(membership, ranks per node)`` then lists the whole step's).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, algorithm: Algorithm,
                 sampler: ElasticSampler, config: FaultTolerance | None = None, *,
                 on_commit: Callable[[list[int], Membership], None] | None = None) -> None:
        refusal = type(algorithm).fault_tolerance_refusal
        if refusal is not None:
            raise ConfigurationError(f"algorithm {algorithm.name!r} cannot train fault-tolerantly: {refusal}")
        if getattr(algorithm, "hierarchical", False):
            # inside the node is the algorithm's whole world; the nodes come after
            algorithm.hierarchical = False  # type: ignore[attr-defined]
        self.optimizer, self.sampler, self.on_commit = optimizer, sampler, on_commit
        if dist.is_initialized():
            self.local_rank, self.local_size = dist.get_rank(), dist.get_world_size()
            comm = CommContext.build(local_size=self.local_size)
        else:
            self.local_rank, self.local_size = 0, 1
            comm = CommContext(rank=0, world_size=1, local_rank=0, local_size=1)
        self.steps_redone = 0
        self.session = ElasticSession(config or FaultTolerance(), state=self.state_dict,
                                      load_state=self.load_state_dict)
        algorithm.cross_node = self.session  # type: ignore[attr-defined]
        self.model = BaguaDistributedDataParallel(module, algorithm, comm, optimizers=[optimizer])
        self._params = [p for _, p in trainable_parameters(module)]

    @property
    def algorithm(self) -> Algorithm:
        return self.model.algorithm

    def epoch(self) -> Iterator[list[int]]:
        """Yield this rank's indices for each step of the epoch; the caller runs forward and backward.

        After each yield the loop commits: the optimizer steps and the sampler moves on only when every
        node of the step finished it; otherwise the step is redone, re-dealt over the nodes now alive.
        """
        sampler = self.sampler
        while not sampler.epoch_done:
            membership = self.session.begin_step()  # heals first when this node is behind
            indices = sampler.indices(membership, self.local_rank, self.local_size)
            if indices:
                yield indices
            else:
                self._zero_backward()  # the epoch's last step is short: this rank contributes nothing
            if self.session.commit():
                self.optimizer.step()
                if self.on_commit is not None:
                    self.on_commit(indices, membership)
                sampler.advance(membership, self.local_size)
            else:
                self.steps_redone += 1
                log.warning("fault tolerance: step %d did not commit on every node; redoing it", membership.step)
            self.optimizer.zero_grad(set_to_none=False)
        sampler.next_epoch()

    def _zero_backward(self) -> None:
        """The algorithm's hooks for a backward of zero gradients (so every collective still matches)."""
        driver, algorithm = self.model.driver, self.model.algorithm
        if not driver.before_forward():
            return
        algorithm.on_backward_start(driver.step)
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
            algorithm.on_grad_ready(p)
        algorithm.on_backward_end(driver.step)

    # ------------------------------------------------------------------ what a healing node takes

    def state_dict(self) -> dict[str, Any]:
        """Everything a joining node needs from a live peer: tensors and plain values only."""
        return {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.model.driver.step,
            "plan": self.algorithm.plan.to_dict() if hasattr(self.algorithm, "plan") else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["rng"])
        self.model.driver.step = int(state["step"])
        if state.get("plan") and hasattr(self.algorithm, "plan"):
            plan = BucketPlan.from_dict(state["plan"])
            if not plan.same_layout(self.algorithm.plan):
                self.algorithm.apply_plan(plan)
        log.info("fault tolerance: healed from a live peer at step %d", self.model.driver.step)

    def close(self) -> None:
        self.session.shutdown()
        self.model.driver.teardown()
