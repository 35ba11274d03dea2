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
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import ConfigurationError
from . import kernels
from .compression import (
    HEADER_BYTES,
    ChunkRanges,
    dequantise_into,
    level_parameters,
    read_header,
)

logger = logging.getLogger(__name__)
_exit_cleanup_registered = False


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
    if not (dist.is_available() and dist.is_initialized()):
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


# Gloo (CPU) pipelines each compressed exchange in segments of this many elements per chunk:
# segment s + 1 is compressed while segment s is on the wire, and received segments are
# decompressed while later ones arrive. With NCCL the exchange is one collective per phase.
PIPELINE_SEGMENT_ELEMENTS = 1 << 18


def _segment_bounds(n: int, device: torch.device) -> list[tuple[int, int]]:
    """``(start, stop)`` of each pipeline segment of an ``n``-element chunk."""
    if device.type == "cuda" or n <= PIPELINE_SEGMENT_ELEMENTS:
        return [(0, n)]
    count = -(-n // PIPELINE_SEGMENT_ELEMENTS)
    edges = [n * i // count for i in range(count + 1)]
    return list(itertools.pairwise(edges))


class ExchangeBuffers:
    """The send and receive buffers of one compressed exchange, kept between steps.

    An algorithm holds one per bucket and passes it to :func:`compressed_all_reduce_`;
    on CPU a fresh buffer the size of a bucket costs more in page faults than the
    compression itself. Buffers are reallocated when the bucket's shape changes.

    On the wire, chunk ``i`` is its 8-byte header and its levels, cut into segments
    (:data:`PIPELINE_SEGMENT_ELEMENTS`); segment ``s`` of every chunk is one contiguous
    ``(chunks, width)`` block of the buffer, the first one led by the headers.
    """

    def __init__(self) -> None:
        self._key: tuple[int, int, torch.device] | None = None
        self._segments: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._scratch: torch.Tensor | None = None
        self._ints: torch.Tensor | None = None

    def segments(
        self, rows: int, bounds: list[tuple[int, int]], device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(send, receive)`` uint8 views per segment, each of shape ``(rows, width)``."""
        n = bounds[-1][1]
        if self._key != (rows, n, device) or len(self._segments) != len(bounds):
            self._segments = []  # free the old buffers first
            send = torch.empty(rows * (HEADER_BYTES + n), dtype=torch.uint8, device=device)
            recv = torch.empty_like(send)
            offset = 0
            for s, (a, b) in enumerate(bounds):
                width = b - a + (HEADER_BYTES if s == 0 else 0)
                size = rows * width
                self._segments.append((send[offset : offset + size].view(rows, width),
                                       recv[offset : offset + size].view(rows, width)))
                offset += size
            self._key = (rows, n, device)
        return self._segments

    def int16_scratch(self, numel: int, device: torch.device) -> torch.Tensor | None:
        """CPU: an int16 tensor of ``numel`` elements for the float -> uint8 cast; None elsewhere."""
        if device.type != "cpu":
            return None
        s = self._ints
        if s is None or s.numel() != numel:
            self._ints = s = torch.empty(numel, dtype=torch.int16)
        return s

    def float_scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        """A float32 tensor of ``numel`` elements (for buckets that are not float32)."""
        s = self._scratch
        if s is None or s.numel() != numel or s.device != device:
            self._scratch = s = torch.empty(numel, dtype=torch.float32, device=device)
        return s


def _levels(block: torch.Tensor, first: bool) -> torch.Tensor:
    """The levels of a segment block (the first segment starts with the headers)."""
    return block[:, HEADER_BYTES:] if first else block


def _sum_levels(
    levels: torch.Tensor,
    mins: torch.Tensor,
    maxs: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """``out = scale * sum_i decode(levels[i])`` (``levels``: uint8 ``(rows, m)``), nothing allocated.

    Each row is decoded as :func:`dequantise_into` decodes it (into ``out`` or ``scratch``),
    the rows are summed in row order and the sum scaled, every step a float32 rounding:
    the fused owner step (``kernels.reduce_compressed``) computes the same values.
    Every row is cast to float32 once before the arithmetic: a uint8 operand (or, on CPU,
    a 0-dim tensor scalar) inside the arithmetic would be several times slower.
    """
    scales, lowers = level_parameters(mins, maxs)
    s_t = scales.view(-1)
    on_cpu = levels.device.type == "cpu"  # Python floats there: most 0-dim tensor operands are unvectorised
    low: list[float] | torch.Tensor = lowers.view(-1).tolist() if on_cpu else lowers.view(-1)
    out.copy_(levels[0]).add_(low[0]).div_(float(s_t[0]) if on_cpu else s_t[0])
    for i in range(1, levels.shape[0]):
        # out + (level + lower) / scale: the quotient and the sum each rounded once, in one pass
        out.addcdiv_(scratch.copy_(levels[i]).add_(low[i]), s_t[i])
    if scale != 1.0:
        out.mul_(scale)


def compressed_exchange_(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    group_size: int,
    *,
    scale: float = 1.0,
    buffers: ExchangeBuffers | None = None,
) -> None:
    """ByteGrad's compressed reduction of ``flat`` in place over ``group`` (``group_size`` ranks).

    ``flat`` (1-D, ``numel`` divisible by ``group_size``) is cut into one chunk per
    rank; each chunk is MinMax-uint8 compressed with its own min/max, chunks go
    all-to-all, each rank decompresses and sums the chunk it owns (times ``scale``),
    recompresses it with the sum's min/max, and an all-gather brings every reduced
    chunk to every rank, which decompresses them into ``flat``. Every rank ends with
    the same values.

    On Gloo both phases are pipelined in segments (see :data:`PIPELINE_SEGMENT_ELEMENTS`):
    the bytes and the values are those of the unsegmented exchange. ``flat`` serves as
    scratch space on the way (a float32 bucket is compressed in place, its own chunk
    holds the sum), so nothing is allocated when ``buffers`` (reused between steps) is given.
    """
    for _ in compressed_exchange_stages(flat, group, group_size, scale=scale, buffers=buffers):
        pass


def compressed_exchange_stages(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    group_size: int,
    *,
    scale: float = 1.0,
    buffers: ExchangeBuffers | None = None,
) -> Iterator[None]:
    """:func:`compressed_exchange_` in stages, so a caller can interleave the exchanges of several buffers.

    The generator pauses twice: once every compressed chunk is on its way (all-to-all
    issued), and once the reduced chunk is on its way (all-gather issued); running it
    to the end decompresses the result into ``flat``. Every rank must advance its
    exchanges in the same order (their collectives are issued in that order).
    """
    if flat.numel() % group_size != 0:
        raise ValueError(
            f"compressed exchange needs a length divisible by {group_size} ranks, got {flat.numel()}; "
            "pad the buffer (BucketEngine(pad_multiple=...))"
        )
    buffers = buffers if buffers is not None else ExchangeBuffers()
    if _kernels_for(flat.device) and flat.dtype in kernels.DTYPES:
        yield from _fused_exchange_stages(flat, group, group_size, scale=scale, buffers=buffers)
        return
    n = flat.numel() // group_size
    bounds = _segment_bounds(n, flat.device)
    blocks = buffers.segments(group_size, bounds, flat.device)
    work = flat if flat.dtype == torch.float32 else buffers.float_scratch(flat.numel(), flat.device).copy_(flat)
    chunks = work.view(group_size, n)
    me = dist.get_rank(group)

    ints = buffers.int16_scratch(max(b - a for a, b in bounds), flat.device)

    # 1. Every chunk with its own min/max; each segment leaves as soon as it is compressed.
    ranges = ChunkRanges.of(chunks)
    ranges.write_header(blocks[0][0][:, :HEADER_BYTES])
    sent = []
    for s, ((a, b), (send, recv)) in enumerate(zip(bounds, blocks, strict=True)):
        ranges.quantise_into(chunks[:, a:b], _levels(send, s == 0), overwrite_input=True,  # chunks are spent
                             scratch=ints)
        sent.append(dist.all_to_all_single(recv, send, group=group, async_op=True))
    yield

    # 2. The owner sums its chunk from every rank as the segments arrive.
    mine = chunks[me]
    scratch = chunks[(me + 1) % group_size] if group_size > 1 else torch.empty_like(mine)
    for s, ((a, b), (_, recv), pending) in enumerate(zip(bounds, blocks, sent, strict=True)):
        pending.wait()
        if s == 0:
            mins, maxs = (t.clone() for t in read_header(recv))
        _sum_levels(_levels(recv, s == 0), mins, maxs, scale, mine[a:b], scratch[a:b])

    # 3. The sum, recompressed with its own min/max, goes to every rank segment by segment.
    own = ChunkRanges.of(mine.view(1, -1))
    own.write_header(blocks[0][0][me : me + 1, :HEADER_BYTES])
    gathered = []
    for s, ((a, b), (send, recv)) in enumerate(zip(bounds, blocks, strict=True)):
        row = send[me : me + 1]  # this segment's all-to-all is done: the row is free
        own.quantise_into(mine[a:b].view(1, -1), _levels(row, s == 0), overwrite_input=True, scratch=ints)
        gathered.append(_all_gather_single(recv, row, group=group, async_op=True))
    yield

    # 4. Every rank decompresses every reduced chunk into the bucket as the segments arrive.
    out = flat.view(group_size, n)
    for s, ((a, b), (_, recv), pending) in enumerate(zip(bounds, blocks, gathered, strict=True)):
        pending.wait()
        if s == 0:
            mins, maxs = (t.clone() for t in read_header(recv))
        if work is flat:
            dequantise_into(_levels(recv, s == 0), mins, maxs, out[:, a:b])
        else:
            dequantise_into(_levels(recv, s == 0), mins, maxs, chunks[:, a:b])
            out[:, a:b].copy_(chunks[:, a:b])


def _kernels_for(device: torch.device) -> bool:
    """True when the compressed exchange on ``device`` runs on the fused kernels (CUDA with Triton)."""
    return device.type == "cuda" and kernels.enabled(device)


def _fused_exchange_stages(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    group_size: int,
    *,
    scale: float,
    buffers: ExchangeBuffers,
) -> Iterator[None]:
    """:func:`compressed_exchange_stages` on the fused kernels: one collective per phase, no float temporaries.

    Compress every chunk of ``flat`` (fp32, bf16 or fp16) into the send buffer; after the
    all-to-all, the owner step decompresses, sums and recompresses its chunk from the
    received bytes straight into its own send row (:func:`kernels.reduce_compressed`);
    after the all-gather every chunk is decompressed into ``flat``. Values and bytes
    are the CPU path's up to the order of the owner's float32 sum.
    """
    n = flat.numel() // group_size
    send, recv = buffers.segments(group_size, [(0, n)], flat.device)[0]
    kernels.compress(flat.detach().contiguous().view(-1), group_size, send)
    pending = dist.all_to_all_single(recv, send, group=group, async_op=True)
    yield
    pending.wait()
    me = dist.get_rank(group)
    row = send[me : me + 1]  # the all-to-all is done: the row is free
    kernels.reduce_compressed(recv, scale, row)
    pending = _all_gather_single(recv, row, group=group, async_op=True)
    yield
    pending.wait()
    if flat.is_contiguous():
        kernels.decompress(recv, flat.view(-1))
    else:
        flat.copy_(kernels.decompress(recv, torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device)))


def compressed_all_reduce_(
    flat: torch.Tensor,
    comm: CommContext,
    *,
    average: bool = True,
    hierarchical: bool = False,
    buffers: ExchangeBuffers | None = None,
) -> None:
    """Compressed allreduce (ByteGrad) of ``flat`` in place.

    ``hierarchical`` (Bagua's meaning): plain intra-node reduce to the leader,
    compressed exchange among node leaders, intra-node broadcast; with one node
    nothing is compressed (a full-precision allreduce within the node), with one
    rank per node the exchange runs among all ranks. ``flat.numel()`` must be
    divisible by the number of ranks taking part in the exchange. ``buffers``: see
    :class:`ExchangeBuffers` (one per bucket, reused every step).
    """
    if comm.world_size == 1:
        return
    if hierarchical and comm.num_nodes == 1:
        all_reduce_(flat, comm, average=average)
        return
    if hierarchical and comm.is_hierarchical_possible:
        leader = comm.global_rank(comm.node_leader())
        _wait(dist.reduce(flat, dst=leader, group=comm.intra_group, async_op=True))
        if comm.is_leader:
            scale = 1.0 / comm.world_size if average else 1.0
            compressed_exchange_(flat, comm.inter_group, comm.num_nodes, scale=scale, buffers=buffers)
        _wait(dist.broadcast(flat, src=leader, group=comm.intra_group, async_op=True))
        return
    compressed_exchange_(flat, comm.group, comm.world_size, scale=1.0 / comm.world_size if average else 1.0,
                         buffers=buffers)


def exchange_size(comm: CommContext, *, hierarchical: bool) -> int:
    """How many ranks a compressed exchange splits a buffer between (its padding multiple)."""
    if hierarchical and comm.num_nodes == 1:
        return 1  # nothing is compressed within a node
    return comm.num_nodes if hierarchical and comm.is_hierarchical_possible else comm.world_size
