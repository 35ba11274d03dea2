"""Bagua's process groups on torch.distributed: ``new_group``, ``from_torch_group``, ``BaguaProcessGroup``.

The default group is made by :func:`~.process_group_init.init_process_group`.

A :class:`BaguaProcessGroup` is a set of global ranks with three communicators, as in Bagua:

- global: every rank of the group;
- intra-node: the group's ranks on this process's node;
- inter-node: the group's ranks whose local rank equals that of the group's first rank (the node
  leaders when the group starts at a node's local rank 0).

Each communicator is a torch process group. They are all created when the Bagua group is created,
in the same order on every rank of the job (``dist.new_group`` is a collective over the whole job),
so no rank ever waits on a group another rank did not create. A rank outside a communicator gets
:data:`CommMember.NON_COMM_MEMBER`, which every primitive treats as "nothing to do here".

Nodes: global rank ``r`` lives on node ``r // local_size`` (ranks are laid out node by node, as
torchrun, Lightning and Bagua's launcher start them).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import ConfigurationError
from ..engine.comm import CommContext
from . import env
from ._communicator import CommunicatorOps
from ._ops import all_gather_single

__all__ = [
    "BaguaCommunicator",
    "BaguaProcessGroup",
    "CommMember",
    "from_torch_group",
    "is_initialized",
    "new_group",
]

log = logging.getLogger(__name__)


class _NonMember:
    """The communicator a rank gets for a group it does not belong to."""

    def __repr__(self) -> str:
        return "CommMember.NON_COMM_MEMBER"


class CommMember:
    """Sentinels for the ``comm`` argument of the primitives (Bagua's names)."""

    WORLD: object = object()
    """The global communicator of the default group (what ``comm=None`` means)."""
    NON_COMM_MEMBER: Any = _NonMember()
    """Returned for a communicator this rank is not in; primitives given it return at once."""


class BaguaCommunicator(CommunicatorOps):
    """One communicator of a :class:`BaguaProcessGroup`: an ordered set of global ranks and its torch group.

    ``rank()`` and ``nranks()`` follow Bagua's communicator; ``src``/``dst`` arguments of the primitives
    are ranks *within* this communicator (``0 .. nranks() - 1``). Bagua's operation methods
    (``allreduce_inplace(tensor, op)``, ..., ``abort()``) come from :class:`CommunicatorOps`.

    Attributes:
        ranks: global ranks, in communicator order.
        torch_group: the torch process group, or None for a single-rank communicator (nothing to
            exchange: the primitives act locally).
        cuda_stream: the group's CUDA stream (None on CPU).
    """

    def __init__(self, ranks: list[int], torch_group: dist.ProcessGroup | None,
                 cuda_stream: torch.cuda.Stream | None = None) -> None:
        me = env.get_rank()
        if me not in ranks:
            raise ConfigurationError(f"rank {me} is not in communicator ranks {ranks}")
        if torch_group is None and len(ranks) > 1:
            raise ConfigurationError(f"a communicator of {len(ranks)} ranks {ranks} needs a torch process group")
        self.ranks = list(ranks)
        self.torch_group = torch_group
        self.cuda_stream = cuda_stream
        self._rank = self.ranks.index(me)
        self._init_ops()

    def rank(self) -> int:
        """This process's rank within the communicator."""
        return self._rank

    def nranks(self) -> int:
        """Number of ranks in the communicator."""
        return len(self.ranks)

    def global_rank(self, rank: int, what: str = "rank") -> int:
        """The global rank of communicator rank ``rank`` (a ValueError naming ``what`` when out of range)."""
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"{what}={rank} is outside this communicator's ranks 0..{len(self.ranks) - 1}")
        return self.ranks[rank]

    @property
    def backend(self) -> str:
        """``"nccl"``, ``"gloo"``, ...; the default group's backend for a single-rank communicator."""
        return str(dist.get_backend(self.torch_group))

    @property
    def device(self) -> torch.device:
        """Where this communicator's tensors live: the current CUDA device for NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        return f"BaguaCommunicator(ranks={self.ranks}, rank={self._rank})"


def _node_of(rank: int, local_size: int) -> int:
    return rank // local_size


class BaguaProcessGroup:
    """Definition of a Bagua process group: its ranks and its global, intra- and inter-node communicators.

    Create one with :func:`new_group` or :func:`from_torch_group` (every rank of the job must call them,
    in the same order); :func:`init_process_group` creates the default one.

    Args:
        ranks: global ranks of the group.
        stream: the CUDA stream Bagua ran this group's NCCL operations on (kept for Bagua's API; torch
            orders its collectives after the current stream).
        group_name: the group's name (unique in the job).
        torch_group: an existing torch process group to use as the global communicator (``from_torch_group``
            and the default group; ranks outside it pass ``GroupMember.NON_GROUP_MEMBER``); None creates one.

    Attributes:
        ranks: global ranks of the group, ascending.
        intra_ranks: the group's ranks on this rank's node.
        inter_ranks: the group's ranks with the same local rank as ``ranks[0]``.
    """

    def __init__(self, ranks: list[int], stream: torch.cuda.Stream | None, group_name: str, *,
                 torch_group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise ConfigurationError("torch.distributed is not initialised; call init_process_group() first")
        world_size = env.get_world_size()
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad or not ranks:
            raise ValueError(f"invalid ranks {list(ranks)}: need a non-empty list of ranks in [0, {world_size})")
        self.ranks = sorted(set(ranks))
        self.stream = stream
        self.group_name = group_name
        me = env.get_rank()
        local_size = env.get_local_size()
        self._local_size = local_size

        nodes: dict[int, list[int]] = {}
        for r in self.ranks:
            nodes.setdefault(_node_of(r, local_size), []).append(r)
        self._nodes = list(nodes.values())
        my_node = nodes.get(_node_of(me, local_size), [])
        self.intra_ranks = list(my_node)
        self.inter_ranks = [r for r in self.ranks if r % local_size == self.ranks[0] % local_size]
        # The engine's layout (CommContext): equal ranks per node, else flat (one rank per "node").
        sizes = {len(m) for m in self._nodes}
        self._group_local_size = sizes.pop() if len(sizes) == 1 else 1
        per_local = [[m[i] for m in self._nodes] for i in range(self._group_local_size)] \
            if self._group_local_size > 1 else []

        # Create every torch group once, in the same order on every rank.
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        everyone = tuple(self.ranks)
        if torch_group is not None:
            self._groups[everyone] = torch_group
        wanted = [everyone, *(tuple(m) for m in self._nodes), tuple(self.inter_ranks), *(tuple(m) for m in per_local)]
        for key in wanted:
            if key in self._groups:
                continue
            if len(key) == 1 and key != everyone:
                self._groups[key] = None  # nothing to exchange with oneself
            else:
                self._groups[key] = dist.new_group(list(key))
        self._comm_context: CommContext | None = None
        self._comms: dict[tuple[int, ...], BaguaCommunicator] = {}
        log.debug("Bagua process group %s of ranks %s", group_name, self.ranks)

    # Bagua's private accessors, kept for code written against them.
    def _get_intra_ranks(self) -> list[int]:
        return list(self.intra_ranks)

    def _get_inter_ranks(self) -> list[int]:
        return list(self.inter_ranks)

    @property
    def is_member(self) -> bool:
        """Whether this rank belongs to the group."""
        return env.get_rank() in self.ranks

    @property
    def torch_group(self) -> dist.ProcessGroup | None:
        """The torch process group of the global communicator (None: this rank is not a member)."""
        return self._groups[tuple(self.ranks)] if self.is_member else None

    def _communicator(self, ranks: list[int]) -> BaguaCommunicator | Any:
        if env.get_rank() not in ranks:
            return CommMember.NON_COMM_MEMBER
        key = tuple(ranks)
        if key not in self._comms:  # one object per communicator, so that abort() sticks, as in Bagua
            self._comms[key] = BaguaCommunicator(ranks, self._groups[key], self.stream)
        return self._comms[key]

    def get_global_communicator(self) -> BaguaCommunicator | Any:
        """The communicator of every rank in the group (``CommMember.NON_COMM_MEMBER`` outside it)."""
        return self._communicator(self.ranks)

    def get_intra_node_communicator(self) -> BaguaCommunicator | Any:
        """The communicator of the group's ranks on this node (``NON_COMM_MEMBER`` outside the group)."""
        return self._communicator(self.intra_ranks) if self.is_member else CommMember.NON_COMM_MEMBER

    def get_inter_node_communicator(self) -> BaguaCommunicator | Any:
        """The communicator of the group's node leaders (``NON_COMM_MEMBER`` for the other ranks)."""
        return self._communicator(self.inter_ranks)

    @property
    def comm(self) -> CommContext:
        """This group as the engine's :class:`~bagua_lightning.engine.comm.CommContext`.

        Ranks are positions in the group. With the same number of the group's ranks on every node,
        ``local_size`` is that number, ``intra_group`` this node's ranks (None with one rank per node) and
        ``inter_group`` the ranks with this local index on every node (None with one node); otherwise
        the layout is flat (``local_size`` 1).

        Raises:
            ConfigurationError: this rank is not in the group.
        """
        if not self.is_member:
            raise ConfigurationError(
                f"rank {env.get_rank()} is not in process group {self.group_name} (ranks {self.ranks}); "
                "only its members can communicate through it"
            )
        if self._comm_context is None:
            me = env.get_rank()
            rank = self.ranks.index(me)
            local = self._group_local_size
            node = next(m for m in self._nodes if me in m)
            intra = self._groups[tuple(node)] if local > 1 else None
            inter = None
            if len(self._nodes) > 1:
                inter = self._groups[tuple(self.ranks)] if local == 1 else \
                    self._groups[tuple(m[node.index(me)] for m in self._nodes)]
            group = self._groups[tuple(self.ranks)]
            self._comm_context = CommContext(
                rank=rank, world_size=len(self.ranks), local_rank=rank % local, local_size=local,
                group=group, intra_group=intra, inter_group=inter, backend=str(dist.get_backend(group)),
            )
        return self._comm_context

    def __repr__(self) -> str:
        return f"BaguaProcessGroup(name={self.group_name!r}, ranks={self.ranks})"


class _Registry:
    """The default group and the group counter (one per process, as torch.distributed keeps its own)."""

    default: BaguaProcessGroup | None = None
    count = itertools.count(1)


def is_initialized() -> bool:
    """Whether :func:`init_process_group` has run in this process."""
    return _Registry.default is not None


def _get_default_group() -> BaguaProcessGroup:
    """The default process group created by :func:`init_process_group`.

    Raises:
        RuntimeError: ``init_process_group`` has not been called.
    """
    if _Registry.default is None:
        raise RuntimeError("the default process group is not initialised; call init_process_group() first")
    return _Registry.default


def new_group(ranks: list[int] | None = None, stream: torch.cuda.Stream | None = None) -> BaguaProcessGroup:
    """Create a process group; every rank of the job must call this, in the same order, members or not.

    Args:
        ranks: global ranks of the members; None: every rank.
        stream: the CUDA stream of the group (None: the default group's).

    Returns:
        The group; its communicators are ``get_global_communicator()``, ``get_intra_node_communicator()``
        and ``get_inter_node_communicator()``.
    """
    default = _get_default_group()
    if ranks is None:
        ranks = list(range(env.get_world_size()))
    return BaguaProcessGroup(list(ranks), default.stream if stream is None else stream, str(next(_Registry.count)))


def _group_ranks_everywhere(group: Any) -> list[int]:
    """The global ranks of torch group ``group``, known on every rank (members or not): one allgather."""
    world = env.get_world_size()
    member = group not in (None, dist.GroupMember.NON_GROUP_MEMBER)
    mask = torch.zeros(world, dtype=torch.int32, device=_get_default_group().get_global_communicator().device)
    if member:
        mask[dist.get_process_group_ranks(group)] = 1
    rows = torch.empty(world, world, dtype=torch.int32, device=mask.device)
    all_gather_single(rows.view(-1), mask)
    seen = {tuple(r.nonzero().view(-1).tolist()) for r in rows.cpu() if r.any()}
    if len(seen) != 1:
        raise ConfigurationError(
            f"from_torch_group was given different groups on different ranks ({sorted(seen)}); "
            "every rank must pass the same torch group, in the same order"
        )
    return list(seen.pop())


def from_torch_group(group: Any, stream: torch.cuda.Stream | None = None) -> BaguaProcessGroup:
    """The Bagua process group of a torch process group; every rank of the job must call this.

    The global communicator reuses ``group`` itself; ranks outside it (for which ``dist.new_group``
    returned ``GroupMember.NON_GROUP_MEMBER``) pass what they got.

    Args:
        group: the torch process group (``None`` or ``dist.group.WORLD``: every rank).
        stream: the CUDA stream of the group (None: the default group's).
    """
    default = _get_default_group()
    if group is None:
        group = dist.group.WORLD
    ranks = _group_ranks_everywhere(group)
    return BaguaProcessGroup(ranks, default.stream if stream is None else stream, str(next(_Registry.count)),
                             torch_group=group)
