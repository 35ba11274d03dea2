"""Bagua's ``gradient_allreduce``: gradients summed or averaged over all ranks, bucket by bucket."""

from __future__ import annotations

import torch.distributed as dist

from ..buckets import Bucket
from ..comm import CommContext, all_reduce_, hierarchical_all_reduce_
from .base import register_algorithm
from .bucketed import GradientBucketAlgorithm


@register_algorithm(
    name="gradient_allreduce",
    description="bucketed gradient allreduce (like DDP)",
    bagua_name="GradientAllReduceAlgorithm",
)
class GradientAllReduceAlgorithm(GradientBucketAlgorithm):
    """Allreduce of gradient buckets, overlapped with backward (what DDP does).

    Args:
        hierarchical: reduce within each node to its leader, allreduce among leaders,
            broadcast within the node (flat with one node).
        average: average the gradients (True) or sum them.
    """


    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        super().__init__(hierarchical=hierarchical, average=average)

    def single_collective(self, hierarchical: bool) -> bool:
        return not hierarchical

    def reduce_bucket(
        self, bucket: Bucket, comm: CommContext, hierarchical: bool, defer: bool
    ) -> dist.Work | None:
        if hierarchical:
            hierarchical_all_reduce_(bucket.flat, comm, average=self.average)
            return None
        return all_reduce_(bucket.flat, comm, average=self.average, wait=not defer)
