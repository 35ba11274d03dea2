"""Low precision decentralized SGD (Bagua's ``low_precision_decentralized``), on a ring.

Ranks sit on a ring. Every rank keeps three flat fp32 replicas per bucket: ``w``
(its own public weights), ``l`` and ``r`` (its left and right neighbours' public
weights). Neighbours hold identical copies of each other's public weights because
they only ever change by the same decompressed differences.

A communicating step runs after ``optimizer.step()`` turned the weights into
``x = w - lr * g`` (plus any purely local steps since the last communication)::

    x_half = (w + l + r) / 3 + (x - w)          # neighbourhood average plus local progress
    d      = x_half - w = x + (l + r) / 3 - 5/3 * w
    c      = MinMax-uint8 compress(d)           # sent to both neighbours; theirs received
    w += decompress(c);  l += decompress(c_left);  r += decompress(c_right)
    x      = w                                  # the model moves to its new public weights

Only compressed differences cross the network (about a quarter of the fp32 bytes),
and the weights move toward the neighbourhood average (Tang et al., DCD-PSGD). With
two ranks both neighbours are the same peer (one message each way).
``hierarchical=True`` (several nodes of several ranks) averages ``x`` within the node
on the leader, runs the ring among node leaders, then broadcasts ``x`` within the node.

Checkpoints: Lightning writes global rank 0's weights. The replicas are not saved:
they describe rank 0's neighbours, which would be wrong on any other rank. After a
restore every rank loads the same weights, so :meth:`load_state_dict` marks the
replicas stale and the next forward rebuilds them from the loaded weights with one
full-precision exchange, on every rank at the same step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from bagua_lightning.strategy.algorithms.base import Algorithm, register_algorithm
from bagua_lightning.strategy.algorithms.decentralized import check_communication_interval, check_flag
from bagua_lightning.strategy.algorithms.weights import ExchangeScope, WeightBuckets
from bagua_lightning.strategy.compression import HEADER_BYTES, compress_chunks, decompress_chunks
from bagua_lightning.strategy.topology import ring_neighbours

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from bagua_lightning.proto.plan import BucketPlan
    from bagua_lightning.strategy.comm import CommContext


def _decompress(packed: torch.Tensor) -> torch.Tensor:
    """Decompress one single-chunk ``(1, 8 + n)`` tensor into ``n`` fp32 values.

    ``decompress_chunks`` views the header bytes as float32, which needs a row
    stride divisible by 4; padding the payload with a few bytes (decoded, then
    dropped) guarantees it for any ``n``.
    """
    n = packed.shape[1] - HEADER_BYTES
    pad = -packed.shape[1] % 4
    if pad:
        packed = torch.nn.functional.pad(packed, (0, pad))
    return decompress_chunks(packed)[:n]


@register_algorithm
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD on a ring exchanging uint8-compressed weight differences.

    Args:
        hierarchical: average within each node first and run the ring among node
            leaders (takes effect with several nodes of several ranks; otherwise flat).
        communication_interval: communicate every this many optimizer steps (>= 1).
    """

    name: ClassVar[str] = "low_precision_decentralized"
    keeps_replicas_identical: ClassVar[bool] = False

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        self.hierarchical = check_flag("hierarchical", hierarchical)
        self.communication_interval = check_communication_interval(communication_interval)
        self._buckets: WeightBuckets | None = None
        self._scope: ExchangeScope | None = None
        self._weight: list[torch.Tensor] = []
        self._left: list[torch.Tensor] = []
        self._right: list[torch.Tensor] = []
        self._replicas_stale = True

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        self._module = module
        self._scope = ExchangeScope(comm=comm, hierarchical=self.hierarchical)
        self._buckets = WeightBuckets(module, plan)
        self._init_replicas()

    def communicates_at(self, step: int) -> bool:
        return step % self.communication_interval == 0

    @property
    def neighbours(self) -> tuple[int, int] | None:
        """Global ranks of the ``(left, right)`` neighbours; None for a non-leader or a single participant."""
        scope = self._require_scope()
        if scope.index is None or scope.num_participants == 1:
            return None
        left, right = ring_neighbours(scope.index, scope.num_participants)
        return scope.participants[left], scope.participants[right]

    @property
    def replicas(self) -> dict[str, list[torch.Tensor]]:
        """The flat fp32 replicas per bucket: this rank's public weights and its neighbours'."""
        return {"weight": self._weight, "left": self._left, "right": self._right}

    # --- hooks -----------------------------------------------------------------------------------

    def on_forward_start(self, step: int) -> None:
        if self._replicas_stale:
            self._init_replicas()

    def on_optimizer_step_end(self, step: int) -> None:
        if not self.communicates_at(step):
            return
        if self._replicas_stale:
            self._init_replicas()
        scope = self._require_scope()
        buckets = self._require_buckets()
        if scope.num_participants == 1 and not scope.uses_hierarchy:
            return  # a single rank has nobody to average with
        flats = [f.float() for f in buckets.flatten()]
        if scope.uses_hierarchy:
            scope.reduce_to_leader(flats)
            scope.leader_mean(flats)
        if scope.is_participant and scope.num_participants > 1:
            self._ring_step(flats)
        if scope.uses_hierarchy:
            scope.broadcast_from_leader(flats)
        buckets.copy_in(flats)

    def apply_plan(self, plan: BucketPlan) -> None:
        # Replicas are laid out per bucket: rebuild them (one full-precision exchange) for the new layout.
        self._buckets = WeightBuckets(self._module, plan)
        self._init_replicas()

    def state_dict(self) -> dict[str, Any]:
        # Replicas are per-rank and cannot be restored from rank 0's checkpoint; see the module docstring.
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._replicas_stale = True

    def teardown(self) -> None:
        self._weight, self._left, self._right = [], [], []
        self._buckets = None
        self._replicas_stale = True

    # --- communication ---------------------------------------------------------------------------

    def _ring_step(self, flats: list[torch.Tensor]) -> None:
        """One compressed exchange with both neighbours; leaves the new public weights in ``flats``."""
        diffs = [
            x + (left + right) / 3 - (5.0 / 3.0) * w
            for x, w, left, right in zip(flats, self._weight, self._left, self._right, strict=True)
        ]
        packed = [compress_chunks(d, 1) for d in diffs]
        from_left, from_right = self._exchange(packed)
        for i, own in enumerate(packed):
            self._weight[i].add_(_decompress(own))
            self._left[i].add_(_decompress(from_left[i]))
            self._right[i].add_(_decompress(from_right[i]))
            flats[i].copy_(self._weight[i])

    def _exchange(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Send ``tensors`` to both neighbours; return what the left and the right neighbour sent."""
        neighbours = self.neighbours
        if neighbours is None:
            return list(tensors), list(tensors)
        left, right = neighbours
        group = self._require_scope().group
        from_left = [torch.empty_like(t) for t in tensors]
        if left == right:  # two participants: one peer, one message each way
            ops = [dist.P2POp(dist.isend, t, left, group=group) for t in tensors]
            ops += [dist.P2POp(dist.irecv, t, left, group=group) for t in from_left]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            return from_left, from_left
        from_right = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, fl, fr in zip(tensors, from_left, from_right, strict=True):
            ops += [
                dist.P2POp(dist.isend, t, left, group=group),
                dist.P2POp(dist.isend, t, right, group=group),
                dist.P2POp(dist.irecv, fl, left, group=group),
                dist.P2POp(dist.irecv, fr, right, group=group),
            ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return from_left, from_right

    def _init_replicas(self) -> None:
        """Public weights := current weights; neighbours' replicas by one full-precision exchange.

        Collective among the participants: called at setup, after a plan change and
        after a checkpoint restore, on every rank at the same point.
        """
        scope = self._require_scope()
        flats = [f.float() for f in self._require_buckets().flatten()]
        self._weight = flats
        if scope.is_participant and scope.num_participants > 1:
            self._left, self._right = self._exchange([f.clone() for f in flats])
            self._left = [t.clone() for t in self._left]
            self._right = [t.clone() for t in self._right]
        else:
            self._left = [f.clone() for f in flats]
            self._right = [f.clone() for f in flats]
        self._replicas_stale = False

    def _require_scope(self) -> ExchangeScope:
        if self._scope is None:
            raise RuntimeError(f"algorithm {self.name!r} is used before setup()")
        return self._scope

    def _require_buckets(self) -> WeightBuckets:
        if self._buckets is None:
            raise RuntimeError(f"algorithm {self.name!r} is used before setup() or after teardown()")
        return self._buckets
