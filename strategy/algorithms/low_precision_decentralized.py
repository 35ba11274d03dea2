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
from bagua_lightning.strategy.compression import HEADER_BYTES, LEVELS, compress_chunks
from bagua_lightning.strategy.topology import ring_neighbours

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from bagua_lightning.proto.plan import BucketPlan
    from bagua_lightning.strategy.comm import CommContext


def _add_decompressed(target: torch.Tensor, packed: torch.Tensor) -> None:
    """``target += decompress(packed)`` for one single-chunk ``(1, 8 + n)`` MinMax uint8 tensor.

    Same quantisation as :func:`~bagua_lightning.strategy.compression.decompress_chunks`
    (``q * (max - min) / 255 + min``), fused into two passes over ``target``. Every rank
    applies a given message with this same function, so replicas stay bit-identical.
    """
    header = packed[0, :HEADER_BYTES].clone().view(torch.float32)  # clone: the row may be misaligned
    lo, hi = header[0], header[1]
    target.addcmul_(packed[0, HEADER_BYTES:], (hi - lo) / LEVELS).add_(lo)


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
            flats = self._weight  # the model moves to its new public weights
        if scope.uses_hierarchy:
            scope.broadcast_from_leader(flats)  # the leader sends its replica (a broadcast source is read-only)
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
        """One compressed exchange with both neighbours; updates the three replicas.

        Bucket by bucket, so that sending bucket ``i`` overlaps compressing bucket ``i + 1``.
        """
        one_peer = self._left is self._right  # two participants: left and right are the same peer
        pending = []
        for x, w, left, right in zip(flats, self._weight, self._left, self._right, strict=True):
            # d = x + (l + r) / 3 - 5/3 w, in place to spare memory passes (it is CPU-bound on Gloo)
            d = torch.add(x, left, alpha=2.0 / 3.0) if one_peer else torch.add(left, right).div_(3).add_(x)
            d.add_(w, alpha=-5.0 / 3.0)
            own = compress_chunks(d, 1)
            del d
            pending.append((own, *self._start_exchange(own)))
        for i, (own, from_left, from_right, works) in enumerate(pending):
            for work in works:
                work.wait()
            _add_decompressed(self._weight[i], own)
            _add_decompressed(self._left[i], from_left)
            if not one_peer:
                _add_decompressed(self._right[i], from_right)

    def _start_exchange(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[dist.Work]]:
        """Start sending ``t`` to both neighbours; returns (from left, from right, works to wait for)."""
        neighbours = self.neighbours
        if neighbours is None:
            return t, t, []
        left, right = neighbours
        group = self._require_scope().group
        from_left = torch.empty_like(t)
        if left == right:  # two participants: one peer, one message each way
            ops = [dist.P2POp(dist.isend, t, left, group=group), dist.P2POp(dist.irecv, from_left, left, group=group)]
            return from_left, from_left, list(dist.batch_isend_irecv(ops))
        from_right = torch.empty_like(t)
        ops = [
            dist.P2POp(dist.isend, t, left, group=group),
            dist.P2POp(dist.isend, t, right, group=group),
            dist.P2POp(dist.irecv, from_left, left, group=group),
            dist.P2POp(dist.irecv, from_right, right, group=group),
        ]
        return from_left, from_right, list(dist.batch_isend_irecv(ops))

    def _init_replicas(self) -> None:
        """Public weights := current weights; neighbours' replicas by one full-precision exchange.

        Collective among the participants: called at setup, after a plan change and
        after a checkpoint restore, on every rank at the same point.
        """
        scope = self._require_scope()
        self._weight = [f.float() for f in self._require_buckets().flatten()]
        neighbours = self.neighbours
        if scope.is_participant and neighbours is not None:
            exchanges = [self._start_exchange(w.clone()) for w in self._weight]
            for _, _, works in exchanges:
                for work in works:
                    work.wait()
            self._left = [from_left for from_left, _, _ in exchanges]
            # Two participants: one peer is both neighbours; one replica serves as both.
            self._right = self._left if neighbours[0] == neighbours[1] else [r for _, r, _ in exchanges]
        else:
            self._left = [w.clone() for w in self._weight]
            self._right = [w.clone() for w in self._weight]
        self._replicas_stale = False

    def _require_scope(self) -> ExchangeScope:
        if self._scope is None:
            raise RuntimeError(f"algorithm {self.name!r} is used before setup()")
        return self._scope

    def _require_buckets(self) -> WeightBuckets:
        if self._buckets is None:
            raise RuntimeError(f"algorithm {self.name!r} is used before setup() or after teardown()")
        return self._buckets
