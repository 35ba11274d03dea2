"""Decentralized SGD (Bagua's ``decentralized``): ranks average *weights* with peers, not gradients.

One communicating step ``t`` (D-PSGD)::

    on_forward_start   copy the weights x_t and start averaging the copy with the peers
    forward/backward   the local gradient g(x_t) is computed while the averaging runs
    on_backward_end    wait; replace the weights with the average
    optimizer.step()   x_{t+1} = avg(x_t) - lr * g(x_t)

Steps with ``step % communication_interval != 0`` are purely local SGD.

``peer_selection_mode="all"`` averages with every rank (an allreduce of the
weights); ``"shift_one"`` averages with one peer that changes every communicating
step (see :func:`bagua_lightning.engine.topology.shift_one_peer`), with
point-to-point send/recv. ``hierarchical=True`` (on several nodes with several
ranks each) averages within the node on the node leader first, runs the exchange
among node leaders, then broadcasts the result within the node.

Because each rank applies its own gradient after the averaging, parameters differ
between ranks after ``optimizer.step()`` (``keeps_replicas_identical = False``);
with ``"all"`` they are identical right after the averaging, before the step.

Checkpoints: Lightning writes the checkpoint from global rank 0, so it holds rank
0's weights. The algorithm keeps no state of its own between steps (the peer of a
step is a function of the step number), so resuming loads rank 0's weights on every
rank and continues from there, which is a valid starting point for D-PSGD.

Fault tolerance (``ElasticTraining``, ``BaguaStrategy(fault_tolerance=...)``): the exchange above runs
inside the node; the node's averaged weights are then averaged across the nodes of the step's quorum
(``cross_node``: torchft's fault-tolerant allreduce, so across nodes the mode is ``"all"``). The result is
staged, not copied in: it replaces the weights only when every node committed the step, just before the
optimizer steps, so a step a node died in leaves the weights as they were (never half-applied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError
from ..topology import (
    PeerSelectionMode,
    check_shift_one_world_size,
    shift_one_peer,
    validate_peer_selection_mode,
)
from .base import Algorithm, register_algorithm
from .weights import ExchangeScope, WeightBuckets

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...proto.plan import BucketPlan
    from ..comm import CommContext


def check_communication_interval(value: object) -> int:
    """Validate ``communication_interval`` (an int >= 1) and return it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"communication_interval must be an int >= 1 (steps between two communications), got {value!r}"
        )
    return value


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


class CrossNodeWeights(Protocol):
    """The fault-tolerant exchange among nodes, as the weight algorithms use it (``ElasticSession``)."""

    def allreduce(self, tensor: torch.Tensor) -> Any: ...

    def add_commit_listener(self, listener: Any) -> None: ...


@dataclass
class _PendingAverage:
    """Averaging launched at ``on_forward_start`` of ``step``, finished at ``on_backward_end``."""

    step: int
    flats: list[torch.Tensor]
    received: list[torch.Tensor]
    works: list[dist.Work]


@register_algorithm(
    name="decentralized",
    description="weights averaged with all ranks or one changing peer",
    bagua_name="DecentralizedAlgorithm",
    bucket_state={"_peer_weight": "peer_weights"},
)
class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD: average weights with all ranks or with one changing peer.

    Args:
        hierarchical: average within each node first and let node leaders exchange
            (takes effect with several nodes of several ranks; otherwise flat).
        peer_selection_mode: ``"all"`` (average with every rank) or ``"shift_one"``
            (one peer per communicating step; needs an even number of ranks, or of
            nodes when hierarchical).
        communication_interval: communicate every this many optimizer steps (>= 1).
    """

    keeps_replicas_identical: ClassVar[bool] = False
    fault_tolerance_refusal: ClassVar[str | None] = None
    #: Set by fault tolerance before setup: the node's averaged weights are then averaged across the nodes
    #: and applied on commit.
    cross_node: CrossNodeWeights | None = None

    def __init__(
        self,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
    ) -> None:
        self.hierarchical = check_flag("hierarchical", hierarchical)
        self.peer_selection_mode: PeerSelectionMode = validate_peer_selection_mode(peer_selection_mode)
        self.communication_interval = check_communication_interval(communication_interval)
        self._buckets: WeightBuckets | None = None
        self._scope: ExchangeScope | None = None
        self._pending: _PendingAverage | None = None
        #: The averaged weights of the latest communicating step, one flat tensor per weight bucket
        #: (Bagua's ``peer_weight``), in bucket order.
        self.peer_weights: list[torch.Tensor] = []
        #: Under fault tolerance: this step's averaged weights, applied when the step commits.
        self._staged: list[torch.Tensor] | None = None
        self._listening = False

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        self._module = module
        self._scope = ExchangeScope(comm=comm, hierarchical=self.hierarchical)
        if self.peer_selection_mode == "shift_one":
            what = "number of nodes" if self._scope.uses_hierarchy else "world size"
            check_shift_one_world_size(self._scope.num_participants, what=what)
        self._buckets = WeightBuckets(module, plan)
        self._pending = None
        self._staged = None
        if self.cross_node is not None and not self._listening:
            self.cross_node.add_commit_listener(self._on_commit)
            self._listening = True

    def communicates_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` averages weights."""
        return step % self.communication_interval == 0

    def peer_at(self, step: int) -> int | None:
        """Global rank this rank exchanges with at ``step`` under ``"shift_one"`` (None when not exchanging)."""
        scope = self._require_scope()
        if self.peer_selection_mode != "shift_one" or scope.index is None or scope.num_participants == 1:
            return None
        round_index = step // self.communication_interval
        return scope.participants[shift_one_peer(scope.index, scope.num_participants, round_index)]

    # --- hooks -----------------------------------------------------------------------------------

    def on_forward_start(self, step: int) -> None:
        if self._pending is not None:
            if self._pending.step == step:
                return  # another micro-batch of the same step (gradient accumulation)
            self._drain()  # a forward that never reached backward: finish its collectives, drop them
        if self.communicates_at(step):
            self._pending = self._launch(step)

    def on_backward_end(self, step: int) -> None:
        if self._pending is None or self._pending.step != step:
            if not self.communicates_at(step):
                return
            # No forward went through the wrapper this step (e.g. a custom training loop): average now.
            self._drain()
            self._pending = self._launch(step)
        pending, self._pending = self._pending, None
        averaged = self._finish(pending)
        if self.cross_node is not None:
            # across the nodes (a failed exchange makes the commit say no), then wait for the commit
            works = [self.cross_node.allreduce(f) for f in averaged]
            for work in works:
                work.wait()
            self._staged = averaged
            return
        self.peer_weights = averaged
        self._require_buckets().copy_in(averaged)

    def _on_commit(self, committed: bool) -> None:
        """Fault tolerance's verdict on the step: apply its averaged weights, or drop them (redone)."""
        staged, self._staged = self._staged, None
        if committed and staged is not None and self._buckets is not None:
            self.peer_weights = staged
            self._buckets.copy_in(staged)

    def apply_plan(self, plan: BucketPlan) -> None:
        self._drain()
        self._staged = None
        self._buckets = WeightBuckets(self._module, plan)

    def teardown(self) -> None:
        self._drain()
        self._buckets = None

    # --- communication ---------------------------------------------------------------------------

    def _launch(self, step: int) -> _PendingAverage:
        scope = self._require_scope()
        flats = self._require_buckets().flatten()
        if scope.uses_hierarchy:
            # The leader's exchange needs the node average first; overlap that part with forward/backward.
            return _PendingAverage(step, flats, [], scope.reduce_to_leader(flats, async_op=True))
        received, works = self._start_exchange(step, flats)
        return _PendingAverage(step, flats, received, works)

    def _finish(self, pending: _PendingAverage) -> list[torch.Tensor]:
        scope = self._require_scope()
        for work in pending.works:
            work.wait()
        flats, received = pending.flats, pending.received
        if scope.uses_hierarchy:
            scope.leader_mean(flats)
            if scope.is_participant:
                received, works = self._start_exchange(pending.step, flats)
                for work in works:
                    work.wait()
                self._combine(flats, received)
            scope.broadcast_from_leader(flats)
        else:
            self._combine(flats, received)
        return flats

    def _start_exchange(self, step: int, flats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Start the participants' exchange of ``flats``; returns (receive buffers, works)."""
        scope = self._require_scope()
        if scope.num_participants == 1:
            return [], []
        if self.peer_selection_mode == "all":
            works = [dist.all_reduce(f, group=scope.group, async_op=True) for f in flats]
            return [], [w for w in works if w is not None]
        peer = self.peer_at(step)
        received = [torch.empty_like(f) for f in flats]
        ops = []
        for f, r in zip(flats, received, strict=True):
            ops.append(dist.P2POp(dist.isend, f, peer, group=scope.group))
            ops.append(dist.P2POp(dist.irecv, r, peer, group=scope.group))
        return received, list(dist.batch_isend_irecv(ops))

    def _combine(self, flats: list[torch.Tensor], received: list[torch.Tensor]) -> None:
        scope = self._require_scope()
        if scope.num_participants == 1:
            return
        if self.peer_selection_mode == "all":
            for f in flats:
                f.div_(scope.num_participants)
        else:
            for f, r in zip(flats, received, strict=True):
                f.add_(r).div_(2)

    def _drain(self) -> None:
        """Wait for a launched averaging and drop its result (keeps collectives matched on every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish(pending)

    def _require_scope(self) -> ExchangeScope:
        return self._set_up(self._scope)

    def _require_buckets(self) -> WeightBuckets:
        return self._set_up(self._buckets)

    def state_dict(self) -> dict[str, Any]:
        # Nothing beyond the weights: the peer schedule follows from the step number.
        return {}
