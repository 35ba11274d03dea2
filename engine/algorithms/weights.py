"""Shared pieces of the weight-averaging algorithms (decentralized, low precision decentralized, async).

These algorithms communicate *weights*, not gradients, so they do not use the
gradient buckets of :mod:`bagua_lightning.engine.buckets`; they group the
trainable parameters with the same :class:`~bagua_lightning.proto.plan.BucketPlan`
(one dtype per bucket, plan order) into flat copies they can send, and copy results
back. Parameters stay ordinary tensors; a flat copy costs one memcpy per step, far
less than the communication it feeds.

:class:`ExchangeScope` answers "who takes part in the peer exchange" for the flat
path (every rank) and the hierarchical one (node leaders exchange on behalf of their
node: intra-node average to the leader first, intra-node broadcast after).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _unflatten_dense_tensors

from ...proto.plan import BucketPlan
from ..comm import CommContext
from ..parameters import check_plan, trainable_parameters


class WeightBuckets:
    """Trainable parameters of ``module`` grouped by ``plan`` into buckets of one dtype and device.

    ``plan`` is checked against the model here, the one check on a weight algorithm's way
    (:class:`~bagua_lightning.core.errors.PlanMismatchError` unless it covers exactly the trainable
    parameters); None: one bucket per dtype/device, in ``named_parameters`` order, so every rank with the
    same model and plan builds the same layout.
    """

    def __init__(self, module: nn.Module, plan: BucketPlan | None = None) -> None:
        trainable = trainable_parameters(module)  # experts and ignored names stay local
        if plan is not None:
            check_plan(plan, trainable)
        named = dict(trainable)
        groups: list[list[torch.Tensor]] = []
        used: set[str] = set()
        for names in plan.tensor_names if plan is not None else []:
            present = [n for n in names if n in named and n not in used]
            used.update(present)
            # A plan bucket holds one dtype; split further only if devices differ.
            groups.extend(_split_by_kind([named[n] for n in present]))
        rest = [p for n, p in named.items() if n not in used]
        groups.extend(_split_by_kind(rest))
        self.groups: list[list[torch.Tensor]] = [g for g in groups if g]

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def numel(self) -> int:
        return sum(p.numel() for g in self.groups for p in g)

    @property
    def device(self) -> torch.device:
        """Device of the first parameter (CPU for a model without trainable parameters)."""
        return self.groups[0][0].device if self.groups else torch.device("cpu")

    def flatten(self) -> list[torch.Tensor]:
        """A fresh flat copy of every bucket's current weights (never a view of a parameter)."""
        with torch.no_grad():
            # torch.cat always allocates; _flatten_dense_tensors returns a *view* for a one-tensor bucket.
            return [torch.cat([p.detach().reshape(-1) for p in g]) for g in self.groups]

    def copy_in(self, flats: Sequence[torch.Tensor]) -> None:
        """Overwrite the parameters with the flat buffers (one per bucket, as :meth:`flatten` returns)."""
        with torch.no_grad():
            for group, flat in zip(self.groups, flats, strict=True):
                torch._foreach_copy_(group, list(_unflatten_dense_tensors(flat.to(group[0].dtype), group)))

    def add_in(self, deltas: Sequence[torch.Tensor]) -> None:
        """Add the flat ``deltas`` to the parameters in place."""
        with torch.no_grad():
            for group, delta in zip(self.groups, deltas, strict=True):
                torch._foreach_add_(group, list(_unflatten_dense_tensors(delta.to(group[0].dtype), group)))


def _split_by_kind(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        kinds.setdefault((p.dtype, p.device), []).append(p)
    return list(kinds.values())


@dataclass(frozen=True)
class ExchangeScope:
    """Who exchanges weights with whom, for the flat or the hierarchical path.

    Attributes:
        comm: the job's process groups.
        hierarchical: the algorithm's ``hierarchical`` flag (Bagua's meaning): with
            several ranks per node, weights are averaged within the node on its leader,
            the leaders run the exchange, and the leader broadcasts within the node.
            With one node there is a single leader and no exchange: every rank of the
            node ends with the node average.
    """

    comm: CommContext
    hierarchical: bool

    @property
    def uses_hierarchy(self) -> bool:
        return self.hierarchical and self.comm.local_size > 1

    @property
    def participants(self) -> list[int]:
        """Global ranks taking part in the peer exchange: every rank, or the node leaders."""
        if self.uses_hierarchy:
            return [self.comm.global_rank(self.comm.node_leader(node)) for node in range(self.comm.num_nodes)]
        return self.comm.global_ranks

    @property
    def num_participants(self) -> int:
        return self.comm.num_nodes if self.uses_hierarchy else self.comm.world_size

    @property
    def index(self) -> int | None:
        """This rank's position among :attr:`participants`, or None for a non-leader."""
        if not self.uses_hierarchy:
            return self.comm.rank
        return self.comm.node_rank if self.comm.is_leader else None

    @property
    def is_participant(self) -> bool:
        return self.index is not None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """Process group of the exchange (for a participant): the world, or the leaders' group."""
        return self.comm.leaders_group if self.uses_hierarchy else self.comm.group

    def reduce_to_leader(self, flats: Sequence[torch.Tensor], *, async_op: bool = False) -> list[dist.Work]:
        """Sum ``flats`` of this node on its leader (hierarchical path only); divide with :meth:`leader_mean`."""
        leader = self.comm.global_rank(self.comm.node_leader())
        works = [dist.reduce(f, dst=leader, group=self.comm.node_group, async_op=async_op) for f in flats]
        return [w for w in works if w is not None]

    def leader_mean(self, flats: Sequence[torch.Tensor]) -> None:
        """Turn the sums :meth:`reduce_to_leader` left on the leader into the node average."""
        if self.comm.is_leader:
            for f in flats:
                f.div_(self.comm.local_size)

    def broadcast_from_leader(self, flats: Sequence[torch.Tensor]) -> None:
        """Give every rank of the node its leader's ``flats`` (hierarchical path only)."""
        leader = self.comm.global_rank(self.comm.node_leader())
        for f in flats:
            dist.broadcast(f, src=leader, group=self.comm.node_group)
