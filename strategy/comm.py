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

import torch.distributed as dist

from bagua_lightning.errors import ConfigurationError


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
    """

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    group: dist.ProcessGroup | None = None
    intra_group: dist.ProcessGroup | None = None
    inter_group: dist.ProcessGroup | None = None

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
        )
