"""Process groups and topology shared by the algorithms.

``CommContext`` is built once by the strategy after ``init_process_group``. Every
rank creates the same groups in the same order (``dist.new_group`` is a
collective call), so building it is itself safe from mismatches.

Hierarchy: ranks are laid out node by node (rank = node * local_size + local_rank),
as torchrun and Lightning launch them. ``intra_group`` holds the ranks of this
node; ``inter_group`` holds local rank ``local_rank`` of every node (for local rank
0, the node leaders). Hierarchical has Bagua's meaning on any number of nodes:
reduce within the node at full precision, run the algorithm's inter-node step
among node leaders (nothing to do with one node), broadcast within the node. With
one node ``intra_group`` is the world group; with one rank per node ``inter_group`` is.

Ranks inside a context are positions in its world group; :meth:`CommContext.global_rank`
turns them into the global ranks torch.distributed's ``src``/``dst``/peer arguments take.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core.errors import ConfigurationError

logger = logging.getLogger(__name__)
_exit_cleanup_registered = False
# Set by a front door that tears torch.distributed down at exit itself (torch_api's init_process_group
# makes the ranks leave together through the store); the handler below then leaves it to that one.
exit_teardown_owned_elsewhere = False


def destroy_process_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits, while it can still run Python; idempotent.

    Left to interpreter finalization, Gloo's worker threads can still hold finished work whose tensors
    reference Python objects; freeing them then needs the GIL of an interpreter being torn down, and the
    process dies with SIGABRT ("terminate called without an active exception") after training succeeded,
    so a launcher reports the job as failed. Destroying the groups from an ``atexit`` handler, as torch
    asks programs to do before they exit, releases them in order. Registered by every
    :class:`CommContext`, so both front doors (``BaguaStrategy``, ``torch_api``) get it.
    """
    global _exit_cleanup_registered
    if not _exit_cleanup_registered:
        atexit.register(_destroy_all_groups)
        _exit_cleanup_registered = True


def _destroy_all_groups() -> None:
    if exit_teardown_owned_elsewhere or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as exc:  # already destroyed elsewhere, or a backend that refuses
        logger.debug("destroying the process groups at exit failed: %s", exc)


@dataclass(kw_only=True)
class CommContext:
    """Process groups and ranks an algorithm communicates with.

    Attributes:
        rank: rank in the world group (the global rank for the default group).
        world_size: number of ranks.
        local_rank: rank within this node.
        local_size: ranks per node (every node has the same number).
        group: the world group (None means the default group).
        intra_group: ranks of this node.
        inter_group: the ranks with this local rank on every node (node leaders for local rank 0).
        backend: the world group's backend ("gloo", "nccl", ...); "" when unknown.
        side_contexts: contexts :meth:`side_context` created, by purpose.
    """

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    group: dist.ProcessGroup | None = None
    intra_group: dist.ProcessGroup | None = None
    inter_group: dist.ProcessGroup | None = None
    backend: str = ""
    side_contexts: dict[str, CommContext] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        destroy_process_groups_at_exit()

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

    @property
    def is_leader(self) -> bool:
        """True on local rank 0 (the rank that takes part in a hierarchical algorithm's inter-node step)."""
        return self.local_rank == 0

    def node_leader(self, node: int | None = None) -> int:
        """Rank (in this context) of the leader (local rank 0) of ``node`` (default: this node)."""
        return (self.node_rank if node is None else node) * self.local_size

    def global_rank(self, rank: int) -> int:
        """The global rank of ``rank`` of this context's world group (what ``src``/``dst`` take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    @property
    def global_ranks(self) -> list[int]:
        """Global ranks of this context's world group, in group order."""
        return [self.global_rank(r) for r in range(self.world_size)]

    def side_context(self, purpose: str, *, backend: str | None = None) -> CommContext:
        """A context with the same ranks on process groups of its own, one per ``purpose``.

        Gloo orders the collectives of one group by the order the calls are made: a
        background thread issuing collectives on the group the main thread uses
        (SyncBatchNorm during backward) could interleave them differently on two ranks.
        The engine's communication thread (``"thread"``) and the asynchronous averaging
        thread (``"async"``) therefore work on groups of their own. The first call for a
        purpose creates them (every member calls it at the same point; non-members never
        do); later calls return the same context. The groups live as long as the process
        group they clone: torch would give a group created after a destroyed one its name,
        and with it the destroyed group's rendezvous keys.
        """
        key = f"{purpose}/{backend or self.backend}"
        side = self.side_contexts.get(key)
        if side is not None:
            return side
        if self.world_size == 1:
            side = CommContext(rank=self.rank, world_size=1, local_rank=0, local_size=1, backend=self.backend)
        else:
            ranks = self.global_ranks

            def make(members: list[int]) -> dist.ProcessGroup:
                return dist.new_group(members, backend=backend or self.backend or None,
                                      use_local_synchronization=True)

            group = make(ranks)
            intra = inter = None
            if self.is_hierarchical_possible:
                node = self.node_rank
                intra = make(ranks[node * self.local_size:(node + 1) * self.local_size])
                inter = make([ranks[n * self.local_size + self.local_rank] for n in range(self.num_nodes)])
            side = CommContext(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                               local_size=self.local_size, group=group, intra_group=intra, inter_group=inter,
                               backend=str(dist.get_backend(group)))
        self.side_contexts[key] = side
        return side

    @property
    def node_group(self) -> dist.ProcessGroup | None:
        """The ranks of this node: ``intra_group``, or the world group when every rank is on one node."""
        return self.group if self.num_nodes == 1 else self.intra_group

    @property
    def leaders_group(self) -> dist.ProcessGroup | None:
        """The node leaders' group (for a leader): ``inter_group``, or the world group with one rank per node."""
        return self.group if self.local_size == 1 else self.inter_group

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


# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning per call site) for all_gather_single; older
# releases (the GPU machine has 2.11) may not have the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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

    With one node (the reduce within the node is the whole reduction) or one rank per
    node (only the leaders' step is left) this is :func:`all_reduce_`.
    """
    if not comm.is_hierarchical_possible:
        all_reduce_(tensor, comm, average=average)
        return
    if average:
        tensor.mul_(1.0 / comm.world_size)
    leader = comm.global_rank(comm.node_leader())
    _wait(dist.reduce(tensor, dst=leader, group=comm.intra_group, async_op=True))
    if comm.is_leader:
        _wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=comm.inter_group, async_op=True))
    _wait(dist.broadcast(tensor, src=leader, group=comm.intra_group, async_op=True))
