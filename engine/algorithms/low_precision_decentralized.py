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

from .. import kernels
from ..chunk_format import HEADER_BYTES
from ..compression import (
    add_dequantised_,
    compress_chunks,
    compressed_nbytes,
    read_header,
)
from ..topology import ring_neighbours
from .base import Algorithm, register_algorithm
from .decentralized import check_communication_interval, check_flag
from .weights import ExchangeScope, WeightBuckets

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...proto.plan import BucketPlan
    from ..comm import CommContext


def _add_decompressed(target: torch.Tensor, packed: torch.Tensor, scratch: torch.Tensor) -> None:
    """``target += decompress(packed)`` for one single-chunk ``(1, 8 + n)`` MinMax uint8 tensor.

    The decoded values (:func:`~bagua_lightning.engine.compression.decompress_chunks`'s)
    are formed in the float32 ``scratch``, then added: one float32 rounding of the sum,
    as in Bagua. Every rank applies a given message with this same function, so
    replicas stay bit-identical.
    """
    if kernels.enabled(target.device):
        kernels.add_decompressed(target, packed)  # one fused pass, no scratch
        return
    mins, maxs = read_header(packed)
    add_dequantised_(target, packed[0, HEADER_BYTES:], mins, maxs, scratch)


#: The weights of Bagua's update ``d = x + l / 3 + r / 3 - 5/3 w``.
THIRD = 1.0 / 3.0
FIVE_THIRDS = 5.0 / 3.0


def _compress_difference(
    d: torch.Tensor, left: torch.Tensor, right: torch.Tensor, w: torch.Tensor, one_peer: bool,
    out: torch.Tensor, scratch: torch.Tensor,
) -> None:
    """``d := d + l / 3 + r / 3 - 5/3 w`` (``d`` holds ``x``), compressed as one chunk into ``out``.

    Bagua's operations in Bagua's order, each product and each sum rounded to float32
    (``d += (1/3) l; d += (1/3) r; d -= (5/3) w``): no fused multiply-add, so that the
    result is Bagua's to the last bit. With one peer (``one_peer``) ``l`` is ``r`` and
    its term is added twice. ``d`` is scratch afterwards; ``scratch`` (float32 like ``d``)
    holds the products on CPU. On CUDA one fused kernel forms ``d`` and its extrema, a
    second writes the levels.
    """
    if kernels.enabled(d.device):
        kernels.weight_difference_compress(
            d, left, None if one_peer else right, w, (THIRD, THIRD, -FIVE_THIRDS), out,
        )
        return
    weight_difference_(d, left, right, w, one_peer, scratch)
    compress_chunks(d, 1, out=out, overwrite_input=True)


def weight_difference_(
    d: torch.Tensor, left: torch.Tensor, right: torch.Tensor, w: torch.Tensor, one_peer: bool, scratch: torch.Tensor
) -> None:
    """``d += (1/3) l; d += (1/3) r; d -= (5/3) w`` with torch ops, each rounded to float32 (``scratch``: products)."""
    d.add_(torch.mul(left, THIRD, out=scratch))
    if not one_peer:
        torch.mul(right, THIRD, out=scratch)
    d.add_(scratch)
    d.sub_(torch.mul(w, FIVE_THIRDS, out=scratch))


def _gather(params: list[torch.Tensor], out: torch.Tensor) -> None:
    """Copy the parameters of one weight bucket into the flat float32 ``out`` (no allocation)."""
    if all(p.dtype == torch.float32 for p in params):
        torch.cat([p.detach().reshape(-1) for p in params], out=out)
    else:
        torch.cat([p.detach().reshape(-1).float() for p in params], out=out)


class _RingBuffers:
    """Per-bucket buffers of the compressed ring exchange, reused every communicating step.

    On CPU a fresh buffer the size of a bucket costs more in page faults than the
    arithmetic on it. ``diff`` holds ``d``; ``scratch`` the products that form it, then the decoded values.
    """

    def __init__(self, numel: int, device: torch.device, one_peer: bool) -> None:
        self.diff = torch.empty(numel, dtype=torch.float32, device=device)
        self.scratch = torch.empty(numel, dtype=torch.float32, device=device)
        self.own = torch.empty(1, compressed_nbytes(numel), dtype=torch.uint8, device=device)
        self.from_left = torch.empty_like(self.own)
        self.from_right = self.from_left if one_peer else torch.empty_like(self.own)


@register_algorithm(
    name="low_precision_decentralized",
    description="compressed weight differences on a ring",
    bagua_name="LowPrecisionDecentralizedAlgorithm",
    bucket_state={"_weight": "_weight", "_left_peer_weight": "_left", "_right_peer_weight": "_right"},
)
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD on a ring exchanging uint8-compressed weight differences.

    Args:
        hierarchical: average within each node first and run the ring among node
            leaders (takes effect with several nodes of several ranks; otherwise flat).
        communication_interval: communicate every this many optimizer steps (>= 1).
    """

    keeps_replicas_identical: ClassVar[bool] = False
    fault_tolerance_refusal: ClassVar[str | None] = (
        "each rank keeps compressed replicas of its ring neighbours' weights, moved by every step's compressed "
        "differences: a step one node did not finish leaves those replicas apart from the weights they stand "
        "for, and a lost node changes the ring; use decentralized (its average crosses the nodes each step and "
        "is applied on commit) or gradient_allreduce"
    )

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        self.hierarchical = check_flag("hierarchical", hierarchical)
        self.communication_interval = check_communication_interval(communication_interval)
        self._buckets: WeightBuckets | None = None
        self._scope: ExchangeScope | None = None
        self._weight: list[torch.Tensor] = []
        self._left: list[torch.Tensor] = []
        self._right: list[torch.Tensor] = []
        self._ring_buffers: list[_RingBuffers] = []
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
        flats: list[torch.Tensor] | None = None
        if scope.uses_hierarchy:
            flats = [f.float() for f in buckets.flatten()]
            scope.reduce_to_leader(flats)
            scope.leader_mean(flats)
        if scope.is_participant and scope.num_participants > 1:
            self._ring_step(flats)
            flats = self._weight  # the model moves to its new public weights
        if flats is None:
            flats = [f.float() for f in buckets.flatten()]
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
        self._ring_buffers = []
        self._buckets = None
        self._replicas_stale = True

    # --- communication ---------------------------------------------------------------------------

    def _ring_step(self, flats: list[torch.Tensor] | None) -> None:
        """One compressed exchange with both neighbours; updates the three replicas.

        ``flats``: the weights ``x`` per bucket, or None to read them from the parameters.
        Bucket by bucket, so that sending bucket ``i`` overlaps compressing bucket ``i + 1``.
        """
        one_peer = self._left is self._right  # two participants: left and right are the same peer
        buffers = self._buffers_for(one_peer)
        groups = self._require_buckets().groups
        pending = []
        for i, (w, left, right, buf) in enumerate(zip(self._weight, self._left, self._right, buffers, strict=True)):
            # d = x + (l + r) / 3 - 5/3 w, in a reused buffer (the exchange is CPU-bound on Gloo)
            d = buf.diff
            if flats is not None:
                d.copy_(flats[i])
            else:
                _gather(groups[i], d)
            _compress_difference(d, left, right, w, one_peer, buf.own, buf.scratch)
            pending.append(self._start_exchange(buf.own, buf.from_left, buf.from_right))
        for i, works in enumerate(pending):
            for work in works:
                work.wait()
            buf = buffers[i]
            _add_decompressed(self._weight[i], buf.own, buf.scratch)
            _add_decompressed(self._left[i], buf.from_left, buf.scratch)
            if not one_peer:
                _add_decompressed(self._right[i], buf.from_right, buf.scratch)

    def _buffers_for(self, one_peer: bool) -> list[_RingBuffers]:
        sizes = [w.numel() for w in self._weight]
        if [b.diff.numel() for b in self._ring_buffers] != sizes or any(
            (b.from_left is b.from_right) != one_peer for b in self._ring_buffers
        ):
            self._ring_buffers = []  # free the old ones first
            self._ring_buffers = [_RingBuffers(n, w.device, one_peer) for n, w in zip(sizes, self._weight, strict=True)]
        return self._ring_buffers

    def _start_exchange(
        self, t: torch.Tensor, from_left: torch.Tensor | None = None, from_right: torch.Tensor | None = None
    ) -> list[dist.Work]:
        """Start sending ``t`` to both neighbours and receiving theirs into ``from_left``/``from_right``.

        With two participants both neighbours are one peer: one message each way, into
        ``from_left`` (pass the same tensor for both). Returns the works to wait for.
        """
        neighbours = self.neighbours
        if neighbours is None:
            return []
        left, right = neighbours
        group = self._require_scope().group
        assert from_left is not None and from_right is not None
        if left == right:  # two participants: one peer, one message each way
            ops = [dist.P2POp(dist.isend, t, left, group=group), dist.P2POp(dist.irecv, from_left, left, group=group)]
            return list(dist.batch_isend_irecv(ops))
        ops = [
            dist.P2POp(dist.isend, t, left, group=group),
            dist.P2POp(dist.isend, t, right, group=group),
            dist.P2POp(dist.irecv, from_left, left, group=group),
            dist.P2POp(dist.irecv, from_right, right, group=group),
        ]
        return list(dist.batch_isend_irecv(ops))

    def _init_replicas(self) -> None:
        """Public weights := current weights; neighbours' replicas by one full-precision exchange.

        Collective among the participants: called at setup, after a plan change and
        after a checkpoint restore, on every rank at the same point.
        """
        scope = self._require_scope()
        self._weight = [f.float() for f in self._require_buckets().flatten()]
        neighbours = self.neighbours
        if scope.is_participant and neighbours is not None:
            one_peer = neighbours[0] == neighbours[1]
            self._left = [torch.empty_like(w) for w in self._weight]
            # Two participants: one peer is both neighbours; one replica serves as both.
            self._right = self._left if one_peer else [torch.empty_like(w) for w in self._weight]
            works = [
                self._start_exchange(w.clone(), left, right)
                for w, left, right in zip(self._weight, self._left, self._right, strict=True)
            ]
            for work in (w for ws in works for w in ws):
                work.wait()
        else:
            self._left = [w.clone() for w in self._weight]
            self._right = [w.clone() for w in self._weight]
        self._replicas_stale = False

    def _require_scope(self) -> ExchangeScope:
        return self._set_up(self._scope)

    def _require_buckets(self) -> WeightBuckets:
        return self._set_up(self._buckets)
