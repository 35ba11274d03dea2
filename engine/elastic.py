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

from .algorithms.base import Algorithm
from .autotune.controller import AutotuneSettings
from .autotune.elastic import ElasticAutotune
from .comm import CommContext
from .ddp import BaguaDistributedDataParallel
from .elastic_step import ElasticSteps, check_algorithm, load_node_state, node_state, zero_backward
from .fault_tolerance import ElasticSampler, FaultTolerance, Membership

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
        autotune: True (the service at ``$BAGUA_LIGHTNING_AUTOTUNE_SERVICE``, else the services file's) or an
            ``AutotuneSettings``: the bucket plan is tuned by the autotune service and follows the nodes
            (each membership change re-registers the job's shape; :mod:`.autotune.elastic`).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, algorithm: Algorithm,
                 sampler: ElasticSampler, config: FaultTolerance | None = None, *,
                 on_commit: Callable[[list[int], Membership], None] | None = None,
                 autotune: AutotuneSettings | bool = False) -> None:
        check_algorithm(type(algorithm))  # before anything starts
        self.optimizer, self.sampler = optimizer, sampler
        if dist.is_initialized():
            self.local_rank, self.local_size = dist.get_rank(), dist.get_world_size()
            comm = CommContext.build(local_size=self.local_size)
        else:
            self.local_rank, self.local_size = 0, 1
            comm = CommContext(rank=0, world_size=1, local_rank=0, local_size=1)
        self.autotune: ElasticAutotune | None = None
        # the per-step protocol every front door shares (engine/elastic_step.py)
        self.steps = ElasticSteps(config or FaultTolerance(), state=self.state_dict, load_state=self.load_state_dict,
                                  local_rank=self.local_rank, local_size=self.local_size, sampler=sampler,
                                  on_commit=on_commit)
        self.session = self.steps.session
        self.steps.prepare(algorithm)
        self.model = BaguaDistributedDataParallel(module, algorithm, comm, optimizers=[optimizer])
        if autotune is not False:
            self.autotune = ElasticAutotune.attach(autotune, self.model, self.session)

    @property
    def algorithm(self) -> Algorithm:
        return self.model.algorithm

    @property
    def steps_redone(self) -> int:
        """Steps that did not commit on every node and were redone."""
        return self.steps.steps_redone

    def epoch(self) -> Iterator[list[int]]:
        """Yield this rank's indices for each step of the epoch; the caller runs forward and backward.

        After each yield the loop commits: the optimizer steps and the sampler moves on only when every
        node of the step finished it; otherwise the step is redone, re-dealt over the nodes now alive.
        """
        steps = self.steps
        while not steps.epoch_done:
            indices = steps.begin()  # heals first when this node is behind
            if self.autotune is not None:
                assert steps.membership is not None
                self.autotune.on_step(steps.membership, len(indices))
            if indices:
                yield indices
            else:
                zero_backward(self.model.driver)  # the epoch's last step is short: this rank contributes nothing
            committed = steps.end(self.optimizer.step)
            self.optimizer.zero_grad(set_to_none=False)
            if self.autotune is not None:
                self.autotune.end_step(committed)  # a plan the step carried, once it committed
        self.sampler.next_epoch()

    # ------------------------------------------------------------------ what a healing node takes

    def state_dict(self) -> dict[str, Any]:
        """Everything a joining node needs from a live peer: tensors and plain values only."""
        return {
            **node_state(self.model.module, [self.optimizer], self.sampler, self.model.driver),
            "autotune": self.autotune.state_dict() if self.autotune is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_node_state(state, self.model.module, [self.optimizer], self.sampler, self.model.driver)
        if state.get("autotune") and self.autotune is not None:
            self.autotune.load_state_dict(state["autotune"])
        log.info("fault tolerance: healed from a live peer at step %d", self.model.driver.step)

    def close(self) -> None:
        if self.autotune is not None:
            self.autotune.close()
        self.session.shutdown()
        self.model.driver.teardown()
