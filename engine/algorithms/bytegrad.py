"""Bagua's ``bytegrad``: gradient buckets reduced with MinMax uint8 compression."""

from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist

from ...proto.plan import BucketPlan
from ..buckets import Bucket
from ..comm import CommContext
from ..compressed_comm import ExchangeBuffers, compressed_all_reduce_, compressed_exchange_stages
from .base import register_algorithm
from .bucketed import GradientBucketAlgorithm


@register_algorithm(
    name="bytegrad",
    description="gradients reduced with MinMax uint8 compression",
    bagua_name="ByteGradAlgorithm",
)
class ByteGradAlgorithm(GradientBucketAlgorithm):
    """A compressed reduce-scatter + all-gather of each gradient bucket.

    Each bucket is split into one chunk per rank, every chunk compressed to uint8
    with its own min/max and sent all-to-all; the owner of a chunk decompresses and
    reduces it, recompresses it, and an all-gather hands every reduced chunk to every
    rank (see :func:`~bagua_lightning.engine.compressed_comm.compressed_exchange_`). About 4x
    fewer bytes than a float32 allreduce; the error per value is at most half a
    quantisation level of its chunk, twice (before and after the reduction).

    On CPU (Gloo) the exchanges of consecutive buckets overlap: a bucket's reduced
    chunks are decompressed while the next bucket's compressed chunks are on the wire,
    the last one at the end of backward. Its recorded communication time therefore
    ends when its reduced chunk is sent, not when it is decompressed.

    Args:
        hierarchical: plain reduce within each node first; only node leaders exchange
            compressed chunks; then broadcast within the node (flat with one node).
        average: average the gradients (True) or sum them.
    """


    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        super().__init__(hierarchical=hierarchical, average=average)
        # Send/receive buffers per bucket index, reused every step (reshaped when a plan changes).
        self._buffers: dict[int, ExchangeBuffers] = {}
        # CPU: the previous bucket's exchange, waiting for its last stage (decompression).
        self._pending: Iterator[None] | None = None

    def pad_multiple(self, comm: CommContext, plan: BucketPlan) -> int:
        # Flat and hierarchical chunkings both fit a multiple of the world size; hierarchical on one
        # node compresses nothing, so its buckets are laid out exactly as gradient_allreduce's.
        return 1 if plan.is_hierarchical_reduce and comm.num_nodes == 1 else comm.world_size

    def reduce_bucket(
        self, bucket: Bucket, comm: CommContext, hierarchical: bool, defer: bool
    ) -> dist.Work | None:
        buffers = self._buffers.setdefault(bucket.index, ExchangeBuffers())
        flat = bucket.flat
        if flat.device.type != "cpu" or (hierarchical and comm.local_size > 1) or comm.world_size == 1:
            self._drain()
            compressed_all_reduce_(flat, comm, average=self.average, hierarchical=hierarchical, buffers=buffers)
            return None
        # Gloo: keep the wire busy across buckets. This bucket's compressed chunks go out while the
        # previous bucket's reduced chunks are decompressed; this bucket's own decompression waits
        # for the next bucket (or the end of backward). Every rank runs the same order.
        scale = 1.0 / comm.world_size if self.average else 1.0
        stages = compressed_exchange_stages(flat, comm.group, comm.world_size, scale=scale, buffers=buffers)
        next(stages)  # all-to-all issued
        self._drain()
        next(stages)  # all-gather issued
        self._pending = stages
        return None

    def _drain(self) -> None:
        """Finish the pending exchange: decompress its result into its bucket."""
        pending, self._pending = self._pending, None
        if pending is not None:
            for _ in pending:
                pass

    def on_backward_end(self, step: int) -> None:
        super().on_backward_end(step)  # waits for the communication thread
        self._drain()  # the last bucket; gradients are final before backward() returns

    def apply_plan(self, plan: BucketPlan) -> None:
        self._buffers.clear()  # bucket sizes change: free the old buffers before the new ones grow
        super().apply_plan(plan)

    def teardown(self) -> None:
        self._pending = None  # after a failure: never block on a half-done exchange
        self._buffers.clear()
        super().teardown()
