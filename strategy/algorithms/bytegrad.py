"""Bagua's ``bytegrad``: gradient buckets reduced with MinMax uint8 compression."""

from __future__ import annotations

import torch.distributed as dist

from bagua_lightning.proto.plan import BucketPlan
from bagua_lightning.strategy.algorithms.base import register_algorithm
from bagua_lightning.strategy.algorithms.bucketed import GradientBucketAlgorithm
from bagua_lightning.strategy.buckets import Bucket
from bagua_lightning.strategy.comm import CommContext, ExchangeBuffers, compressed_all_reduce_


@register_algorithm
class ByteGradAlgorithm(GradientBucketAlgorithm):
    """A compressed reduce-scatter + all-gather of each gradient bucket.

    Each bucket is split into one chunk per rank, every chunk compressed to uint8
    with its own min/max and sent all-to-all; the owner of a chunk decompresses and
    reduces it, recompresses it, and an all-gather hands every reduced chunk to every
    rank (see :func:`~bagua_lightning.strategy.comm.compressed_exchange_`). About 4x
    fewer bytes than a float32 allreduce; the error per value is at most half a
    quantisation level of its chunk, twice (before and after the reduction).

    Args:
        hierarchical: plain reduce within each node first; only node leaders exchange
            compressed chunks; then broadcast within the node (flat with one node).
        average: average the gradients (True) or sum them.
    """

    name = "bytegrad"

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        super().__init__(hierarchical=hierarchical, average=average)
        # Send/receive buffers per bucket index, reused every step (reshaped when a plan changes).
        self._buffers: dict[int, ExchangeBuffers] = {}

    def pad_multiple(self, comm: CommContext, plan: BucketPlan) -> int:
        # Flat and hierarchical chunkings both fit a multiple of the world size.
        return comm.world_size

    def reduce_bucket(
        self, bucket: Bucket, comm: CommContext, hierarchical: bool, defer: bool
    ) -> dist.Work | None:
        buffers = self._buffers.setdefault(bucket.index, ExchangeBuffers())
        compressed_all_reduce_(bucket.flat, comm, average=self.average, hierarchical=hierarchical,
                               buffers=buffers)
        return None

    def apply_plan(self, plan: BucketPlan) -> None:
        self._buffers.clear()  # bucket sizes change: free the old buffers before the new ones grow
        super().apply_plan(plan)

    def teardown(self) -> None:
        self._buffers.clear()
        super().teardown()
