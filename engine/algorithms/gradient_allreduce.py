"""Bagua's ``gradient_allreduce``: gradients summed or averaged over all ranks, bucket by bucket."""

from __future__ import annotations

from ..buckets import Bucket, BucketStep
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

    def one_collective(self) -> bool:
        return self.cross_node is None and not self.engine.plan.is_hierarchical_reduce

    def reduce_bucket(self, bucket: Bucket, comm: CommContext, hierarchical: bool) -> BucketStep:
        return allreduce_step(bucket, comm, hierarchical=hierarchical, average=self.average)


def allreduce_step(bucket: Bucket, comm: CommContext, *, hierarchical: bool, average: bool) -> BucketStep:
    """The bucket step of a full-precision allreduce: one asynchronous collective, or the hierarchical three."""
    if hierarchical:
        hierarchical_all_reduce_(bucket.flat, comm, average=average)
        return
    yield all_reduce_(bucket.flat, comm, average=average, wait=False)
