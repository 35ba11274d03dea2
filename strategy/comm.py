"""Process groups and topology shared by the algorithms.

``CommContext`` is built once by the strategy after ``init_process_group``. Every
rank creates the same groups in the same order (``dist.new_group`` is a
collective call), so building it is itself safe from mismatches.

Hierarchy: ranks are laid out node by node (rank = node * local_size + local_rank),
as torchrun and Lightning launch them. ``intra_group`` holds the ranks of this
node; ``inter_group`` holds local rank ``local_rank`` of every node (for local rank
0, the node leaders). With one node, hierarchical paths reduce to the flat ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from bagua_lightning.errors import ConfigurationError
from bagua_lightning.strategy.compression import compress_chunks, decompress_chunks


@dataclass(kw_only=True)
class CommContext:
    """Process groups and ranks an algorithm communicates with.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        local_rank: rank within this node.
        local_size: ranks per node (every node has the same number).
        group: the world group (None means the default group).
        intra_group: ranks of this node.
        inter_group: the ranks with this local rank on every node (node leaders for local rank 0).
        backend: the world group's backend ("gloo", "nccl", ...); "" when unknown.
    """

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    group: dist.ProcessGroup | None = None
    intra_group: dist.ProcessGroup | None = None
    inter_group: dist.ProcessGroup | None = None
    backend: str = ""

    @property
    def is_nccl(self) -> bool:
        return self.backend == "nccl"

    def destroy_groups(self) -> None:
        """Destroy the hierarchical groups this context created (not the world group); idempotent."""
        for g in {id(g): g for g in (self.intra_group, self.inter_group) if g is not None}.values():
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):  # already destroyed, or the world group went first
                pass
        self.intra_group = self.inter_group = None

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def is_hierarchical_possible(self) -> bool:
        """True when there is more than one node and more than one rank per node."""
        return self.num_nodes > 1 and self.local_size > 1

    def node_leader(self, node: int | None = None) -> int:
        """Global rank of the leader (local rank 0) of ``node`` (default: this node)."""
        return (self.node_rank if node is None else node) * self.local_size

    @classmethod
    def build(cls, *, local_size: int, backend_group: dist.ProcessGroup | None = None) -> CommContext:
        """Create the hierarchical groups; every rank must call this in the same order."""
        if not dist.is_initialized():
            raise ConfigurationError("torch.distributed is not initialised; call init_process_group first")
        world_size = dist.get_world_size(backend_group)
        rank = dist.get_rank(backend_group)
        if local_size <= 0 or world_size % local_size != 0:
            raise ConfigurationError(
                f"world size {world_size} is not a multiple of ranks per node {local_size}; "
                "every node must run the same number of ranks"
            )
        num_nodes = world_size // local_size
        intra_group = inter_group = None
        if num_nodes > 1 and local_size > 1:
            for node in range(num_nodes):
                ranks = list(range(node * local_size, (node + 1) * local_size))
                g = dist.new_group(ranks)
                if rank in ranks:
                    intra_group = g
            for local in range(local_size):
                ranks = [node * local_size + local for node in range(num_nodes)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    inter_group = g
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=rank % local_size,
            local_size=local_size,
            group=backend_group,
            intra_group=intra_group,
            inter_group=inter_group,
            backend=str(dist.get_backend(backend_group)),
        )


# Collectives used by the algorithms. Each issues asynchronous operations and waits
# on them: with NCCL the wait only orders the *current CUDA stream* after the
# collective (the host does not block; algorithms call these under a side stream);
# with Gloo the wait blocks the calling thread (algorithms call these from their
# communication thread). Every rank must call them in the same order.


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def all_reduce_(
    tensor: torch.Tensor, comm: CommContext, *, average: bool = True, wait: bool = True
) -> dist.Work | None:
    """Flat allreduce of ``tensor`` in place over all ranks: sum, or mean when ``average``.

    ``wait=False`` returns the pending work instead of waiting on it.
    """
    if comm.world_size == 1:
        return None
    if average and comm.is_nccl:
        op = dist.ReduceOp.AVG
    else:
        op = dist.ReduceOp.SUM
        if average:
            # As DDP does: scale before a SUM (Gloo has no AVG on every torch version).
            tensor.mul_(1.0 / comm.world_size)
    work = dist.all_reduce(tensor, op=op, group=comm.group, async_op=True)
    if not wait:
        return work
    _wait(work)
    return None


def hierarchical_all_reduce_(tensor: torch.Tensor, comm: CommContext, *, average: bool = True) -> None:
    """Intra-node reduce to the leader, allreduce among node leaders, intra-node broadcast.

    With one node (or one rank per node) this is :func:`all_reduce_`.
    """
    if not comm.is_hierarchical_possible:
        all_reduce_(tensor, comm, average=average)
        return
    if average:
        tensor.mul_(1.0 / comm.world_size)
    leader = comm.node_leader()
    _wait(dist.reduce(tensor, dst=leader, group=comm.intra_group, async_op=True))
    if comm.local_rank == 0:
        _wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=comm.inter_group, async_op=True))
    _wait(dist.broadcast(tensor, src=leader, group=comm.intra_group, async_op=True))


def compressed_exchange_(
    flat: torch.Tensor, group: dist.ProcessGroup | None, group_size: int, *, scale: float = 1.0
) -> None:
    """ByteGrad's compressed reduction of ``flat`` in place over ``group`` (``group_size`` ranks).

    ``flat`` (1-D, ``numel`` divisible by ``group_size``) is cut into one chunk per
    rank; each chunk is MinMax-uint8 compressed, chunks go all-to-all, each rank
    decompresses and sums the chunk it owns (times ``scale``), recompresses it, and
    an all-gather brings every reduced chunk to every rank, which decompresses them
    into ``flat``. Every rank ends with the same values.
    """
    if flat.numel() % group_size != 0:
        raise ValueError(
            f"compressed exchange needs a length divisible by {group_size} ranks, got {flat.numel()}; "
            "pad the buffer (BucketEngine(pad_multiple=...))"
        )
    packed = compress_chunks(flat, group_size)  # (group_size, 8 + chunk)
    received = torch.empty_like(packed)
    _wait(dist.all_to_all_single(received, packed, group=group, async_op=True))
    mine = decompress_chunks(received).view(group_size, -1).sum(dim=0)
    if scale != 1.0:
        mine.mul_(scale)
    gathered = torch.empty_like(packed)
    _wait(dist.all_gather_into_tensor(gathered, compress_chunks(mine, 1), group=group, async_op=True))
    flat.copy_(decompress_chunks(gathered, dtype=flat.dtype))


def compressed_all_reduce_(
    flat: torch.Tensor, comm: CommContext, *, average: bool = True, hierarchical: bool = False
) -> None:
    """Compressed allreduce (ByteGrad) of ``flat`` in place.

    ``hierarchical`` (and more than one node): plain intra-node reduce to the leader,
    compressed exchange among node leaders, intra-node broadcast. ``flat.numel()``
    must be divisible by the number of ranks taking part in the exchange.
    """
    if comm.world_size == 1:
        return
    if hierarchical and comm.is_hierarchical_possible:
        leader = comm.node_leader()
        _wait(dist.reduce(flat, dst=leader, group=comm.intra_group, async_op=True))
        if comm.local_rank == 0:
            scale = 1.0 / comm.world_size if average else 1.0
            compressed_exchange_(flat, comm.inter_group, comm.num_nodes, scale=scale)
        _wait(dist.broadcast(flat, src=leader, group=comm.intra_group, async_op=True))
        return
    compressed_exchange_(flat, comm.group, comm.world_size, scale=1.0 / comm.world_size if average else 1.0)


def exchange_size(comm: CommContext, *, hierarchical: bool) -> int:
    """How many ranks a compressed exchange splits a buffer between (its padding multiple)."""
    return comm.num_nodes if hierarchical and comm.is_hierarchical_possible else comm.world_size
