"""One fault-tolerant step, as every front door takes it: begin (quorum, heal, deal), train, end (commit-or-redo).

:class:`ElasticSteps` is the one implementation of the per-step protocol of docs/fault_tolerance.md; the
three front doors drive it:

* :class:`~bagua_lightning.engine.elastic.ElasticTraining` (the engine's own loop);
* ``BaguaStrategy(fault_tolerance=...)`` (Lightning: the train loader begins the step, the strategy's
  ``optimizer_step`` ends it; :mod:`bagua_lightning.strategy.fault_tolerant`);
* ``model.with_bagua(..., fault_tolerance=...)`` (``torch_api``: :class:`ElasticBatchSampler` begins the
  step, ``optimizer.step()`` ends it).

Each step:

1. :meth:`ElasticSteps.begin` joins the step's quorum (a node that is behind first heals from a live
   peer, through the ``state``/``load_state`` the front door gave) and deals this rank's share of the
   epoch's next indices (:class:`~bagua_lightning.engine.fault_tolerance.ElasticSampler`);
2. the front door runs forward and backward: the algorithm's bucket step inside the node, then each bucket
   averaged across the quorum's nodes (:meth:`ElasticSteps.prepare` made the algorithm do so). A rank whose
   share is empty (the epoch's last, short step) runs :func:`zero_backward` instead, so that every
   collective still matches;
3. :meth:`ElasticSteps.end` asks whether every node finished the step: only then does the optimizer step
   and the sampler move on; otherwise nothing is applied and the next :meth:`~ElasticSteps.begin` re-deals
   the same indices over the nodes alive then.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import ConfigurationError
from ..proto.plan import BucketPlan
from .algorithms.base import Algorithm
from .ddp import AlgorithmDriver
from .fault_tolerance import ElasticSampler, ElasticSession, FaultTolerance, Membership
from .parameters import trainable_parameters

log = logging.getLogger(__name__)

__all__ = ["Commit", "ElasticBatchSampler", "ElasticSteps", "check_algorithm", "fault_tolerance_refusal", "load_node_state", "node_state",
           "zero_backward"]


def fault_tolerance_refusal(algorithm: type[Algorithm]) -> str | None:
    """The one sentence that refuses ``algorithm`` under fault tolerance (None when it can train so)."""
    refusal = algorithm.fault_tolerance_refusal
    if refusal is None:
        return None
    return f"algorithm {algorithm.name!r} cannot train fault-tolerantly: {refusal}"


def check_algorithm(algorithm: type[Algorithm]) -> None:
    """Raise :class:`ConfigurationError` with :func:`fault_tolerance_refusal`'s reason, at construction."""
    refusal = fault_tolerance_refusal(algorithm)
    if refusal is not None:
        raise ConfigurationError(refusal)


@dataclass(frozen=True, slots=True)
class Commit:
    """A committed step: this rank's indices, the whole step's (every node and rank), and its nodes."""

    indices: list[int]
    step_indices: list[int]
    membership: Membership


class ElasticSteps:
    """One node's fault-tolerant steps: the session with the other nodes, the sampler, commit-or-redo.

    Args:
        config: the nodes' settings (``min_nodes``, the coordinator, timeouts).
        state: everything a healing node takes from a live peer (tensors and plain values).
        load_state: loads what ``state`` gave, on a node that heals.
        local_rank: this rank within the node.
        local_size: the node's ranks.
        sampler: the epoch's indices (may be set later, before the first :meth:`begin`).
        on_commit: called with ``(indices, membership)`` after each committed step, before the sampler moves.
    """

    def __init__(self, config: FaultTolerance, *, state: Callable[[], dict[str, Any]],
                 load_state: Callable[[dict[str, Any]], None], local_rank: int, local_size: int,
                 sampler: ElasticSampler | None = None,
                 on_commit: Callable[[list[int], Membership], None] | None = None) -> None:
        self.local_rank, self.local_size = local_rank, local_size
        self._sampler = sampler
        self.on_commit = on_commit
        self.min_nodes = config.min_nodes
        self.steps_redone = 0
        self.membership: Membership | None = None  # the open step's (None between steps)
        self.indices: list[int] = []
        self.last_commit: Commit | None = None  # the latest committed step's
        self.session = ElasticSession(config, state=state, load_state=load_state)

    @property
    def sampler(self) -> ElasticSampler:
        if self._sampler is None:
            raise ConfigurationError("fault tolerance: no ElasticSampler deals this node's data yet; give one "
                                     "before the first step")
        return self._sampler

    @sampler.setter
    def sampler(self, sampler: ElasticSampler) -> None:
        self._sampler = sampler

    def prepare(self, algorithm: Algorithm) -> None:
        """Make ``algorithm`` (not set up yet) average each bucket across the nodes after its in-node step.

        Raises:
            ConfigurationError: the algorithm cannot train fault-tolerantly (the reason named).
        """
        check_algorithm(type(algorithm))
        if getattr(algorithm, "hierarchical", False):
            # inside the node is the algorithm's whole world; the nodes come after
            algorithm.hierarchical = False  # type: ignore[attr-defined]
        algorithm.cross_node = self.session  # type: ignore[attr-defined]

    @property
    def open(self) -> bool:
        """True between :meth:`begin` and :meth:`end`."""
        return self.membership is not None

    @property
    def epoch_done(self) -> bool:
        return self.sampler.epoch_done

    def begin(self) -> list[int]:
        """Join the step's quorum (healing first when behind) and deal this rank's share (possibly empty)."""
        if self.open:
            raise ConfigurationError(
                "fault tolerance: a new step began before the last one ended: every batch needs its "
                "optimizer step first (a DataLoader with num_workers > 0 fetches batches ahead: use "
                "num_workers=0; the elastic sampler fetches in the main process)")
        membership = self.session.begin_step()
        self.indices = self.sampler.indices(membership, self.local_rank, self.local_size)
        self.membership = membership
        return self.indices

    def end(self, step: Callable[[], object]) -> bool:
        """Commit the open step: run ``step`` (the optimizer's) and move the sampler on only when every node
        of the quorum finished it; otherwise apply nothing (the next :meth:`begin` redoes it)."""
        membership = self.membership
        if membership is None:
            raise ConfigurationError("fault tolerance: the optimizer stepped outside a step; take each batch "
                                     "from the elastic sampler, then step once")
        self.membership = None
        if not self.session.commit():
            self.steps_redone += 1
            log.warning("fault tolerance: step %d did not commit on every node; redoing it", membership.step)
            return False
        step()
        self.last_commit = Commit(self.indices, self.sampler.step_indices(membership, self.local_size), membership)
        if self.on_commit is not None:
            self.on_commit(self.indices, membership)
        self.sampler.advance(membership, self.local_size)
        return True

    def steps_bound(self) -> int:
        """At most this many committed steps are left in the epoch (no fewer than ``min_nodes`` nodes train
        a step); a front door that needs an epoch length uses it."""
        sampler = self.sampler
        per_step = self.min_nodes * self.local_size * sampler.batch_size
        return max(1, math.ceil((sampler.num_samples - sampler.position) / per_step))

    def shutdown(self) -> None:
        self.session.shutdown()


def zero_backward(driver: AlgorithmDriver) -> None:
    """The algorithm's hooks for a backward of zero gradients (so every collective of the step still matches)."""
    algorithm = driver.algorithm
    if not driver.before_forward():
        return
    algorithm.on_backward_start(driver.step)
    for _, p in trainable_parameters(driver.module):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
        algorithm.on_grad_ready(p)
    algorithm.on_backward_end(driver.step)


# ---------------------------------------------------------------------------- what a healing node takes


def node_state(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], sampler: ElasticSampler,
               driver: AlgorithmDriver) -> dict[str, Any]:
    """What every front door's healing state holds: tensors and plain values only."""
    algorithm = driver.algorithm
    return {
        "model": module.state_dict(),
        "optimizers": [o.state_dict() for o in optimizers],
        "sampler": sampler.state_dict(),
        "rng": torch.get_rng_state(),
        "step": driver.step,
        "plan": algorithm.plan.to_dict() if hasattr(algorithm, "plan") else {},
    }


def load_node_state(state: dict[str, Any], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                    sampler: ElasticSampler, driver: AlgorithmDriver) -> None:
    """Load what :func:`node_state` gave (on a node that heals)."""
    module.load_state_dict(state["model"])
    for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["rng"])
    driver.step = int(state["step"])
    algorithm = driver.algorithm
    if state.get("plan") and hasattr(algorithm, "plan"):
        plan = BucketPlan.from_dict(state["plan"])
        if not plan.same_layout(algorithm.plan):
            algorithm.apply_plan(plan)


# ---------------------------------------------------------------------------- a DataLoader's batch sampler


class ElasticBatchSampler(torch.utils.data.Sampler[list[int]]):
    """A ``DataLoader``'s ``batch_sampler`` that begins each step as the loader asks for its batch.

    Each batch is this rank's share of one step, dealt when the loader asks for it (so after the previous
    step's optimizer step): ``DataLoader(data, batch_sampler=...)`` with ``num_workers=0`` (workers would
    fetch ahead, before the quorum is known: refused with the fix). A rank whose share of the epoch's last,
    short step is empty yields nothing for it: ``on_empty`` runs that step (zero gradients, then the commit).
    ``len()`` is an upper bound (:meth:`ElasticSteps.steps_bound`): the epoch may end earlier, when more
    nodes train.
    """

    def __init__(self, steps: ElasticSteps, on_empty: Callable[[], None]) -> None:
        self.steps, self.on_empty = steps, on_empty

    def __len__(self) -> int:
        return self.steps.steps_bound()

    def __iter__(self) -> Iterator[list[int]]:
        steps = self.steps
        while not steps.epoch_done:
            indices = steps.begin()
            if indices:
                yield indices
                if steps.open:
                    raise ConfigurationError(
                        "fault tolerance: the next batch was asked for before optimizer.step() of this one: step "
                        "once per batch, with num_workers=0 (workers fetch ahead, before the step's quorum)")
            else:
                self.on_empty()
        steps.sampler.next_epoch()
