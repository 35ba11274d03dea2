"""The compressed exchange: MinMax uint8 chunks reduce-scattered and all-gathered (bytegrad, qadam).

Each rank compresses its bucket in ``world_size`` chunks, sends chunk ``i`` to rank ``i`` (the chunk's
owner), the owner decompresses what it received, sums (or averages) and recompresses, and every rank
gathers the owners' results. On Gloo the exchange is pipelined in segments; on CUDA the owner step runs
in one fused kernel (:mod:`.kernels`). Every rank calls these in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from . import kernels
from .chunk_format import HEADER_BYTES
from .comm import CommContext, _all_gather_single, _wait, all_reduce_
from .compression import (
    ChunkRanges,
    dequantise_into,
    level_parameters,
    read_header,
)

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
