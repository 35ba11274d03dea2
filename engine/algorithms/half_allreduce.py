"""``half_allreduce``: gradient buckets averaged in bfloat16 or float16 (half the bytes of gradient_allreduce).

torch's DDP offers the same as ``bf16_compress_hook`` / ``fp16_compress_hook``. Here the bucket is scaled by
``1 / world_size`` in its own precision *before* it is cast, and the half-precision buffer is summed: every
partial sum on the wire is then a partial average, bounded by the largest gradient value, so no world size
overflows float16's range (65504), and no value is rounded twice (torch's hooks cast first, then divide in
half precision). The result is cast back into the bucket.

Why a registered algorithm of its own and not an option of ``gradient_allreduce``: ``algorithm="auto"``
chooses among algorithms by name and hands the same keyword arguments to every candidate, so an option of
gradient_allreduce could never be measured beside plain gradient_allreduce; as its own name it is one more
candidate (``auto_candidates=[..., "half_allreduce"]``), it gets its Lightning alias
(``Trainer(strategy="bagua_half_allreduce")``) and Bagua's API class from its registration, and
gradient_allreduce keeps exactly DDP's results.

Hierarchical (the plan's ``is_hierarchical_reduce``, Bagua's meaning): the ranks of a node reduce to their
leader at full precision, the node leaders allreduce in half precision, each leader broadcasts the result
within its node at full precision; with one node nothing is cast (the node's allreduce is the reduction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError
from ..buckets import Bucket, BucketStep
from ..comm import CommContext
from ..parameters import trainable_parameters
from .base import register_algorithm
from .bucketed import GradientBucketAlgorithm
from .gradient_allreduce import allreduce_step

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...proto.plan import BucketPlan

#: The names ``dtype`` accepts, and the dtype each means.
HALF_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
#: Gradient dtypes that halve (or better) when cast to a half dtype.
WIDE_DTYPES = (torch.float32, torch.float64)


def half_dtype(value: object) -> torch.dtype:
    """The half dtype ``value`` names (a name of :data:`HALF_DTYPES` or the torch dtype); ConfigurationError else."""
    if isinstance(value, torch.dtype) and value in HALF_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in HALF_DTYPES:
        return HALF_DTYPES[value.lower()]
    raise ConfigurationError(f"half_allreduce: dtype={value!r} is not a half-precision type gradients can be sent "
                             f"in; give one of {sorted(HALF_DTYPES)} (bfloat16: float32's range; float16: 3 more "
                             "bits of mantissa).")


@register_algorithm(
    name="half_allreduce",
    description="gradients averaged in bfloat16 or float16 (half the bytes of an allreduce)",
    bagua_name="HalfPrecisionAllReduceAlgorithm",
)
class HalfPrecisionAllReduceAlgorithm(GradientBucketAlgorithm):
    """Allreduce of gradient buckets cast to a half-precision type, overlapped with backward.

    Args:
        dtype: what travels: ``"bfloat16"`` (default; float32's exponent range, 8 bits of mantissa) or
            ``"float16"`` (11 bits of mantissa, values up to 65504); a torch dtype is accepted too.
        hierarchical: full precision within each node, half precision among node leaders, broadcast within
            the node.
        average: average the gradients (True) or sum them (a sum may overflow float16).
    """

    def __init__(self, dtype: str = "bfloat16", hierarchical: bool = False, average: bool = True) -> None:
        self.dtype = half_dtype(dtype)
        super().__init__(hierarchical=hierarchical, average=average)
        self._half: dict[int, torch.Tensor] = {}  # one cast buffer per bucket index, reused every step

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        for name, p in trainable_parameters(module):
            if p.dtype not in WIDE_DTYPES:
                raise ConfigurationError(
                    f"half_allreduce: parameter {name!r} is {p.dtype}; casting it to {self.dtype} sends no fewer "
                    "bytes (or loses what an integer holds). half_allreduce compresses float32 and float64 "
                    "gradients; use gradient_allreduce for this model.")
        super().setup(module, comm, plan)

    def _buffer(self, bucket: Bucket) -> torch.Tensor:
        half = self._half.get(bucket.index)
        if half is None or half.numel() != bucket.flat.numel() or half.device != bucket.flat.device:
            half = self._half[bucket.index] = torch.empty(bucket.flat.numel(), dtype=self.dtype,
                                                          device=bucket.flat.device)
        return half

    def reduce_bucket(self, bucket: Bucket, comm: CommContext, hierarchical: bool) -> BucketStep:
        flat = bucket.flat
        if comm.world_size == 1 or (hierarchical and comm.num_nodes == 1):
            yield from allreduce_step(bucket, comm, hierarchical=hierarchical, average=self.average)
            return
        if self.average:
            flat.mul_(1.0 / comm.world_size)  # average before the cast: no partial sum exceeds a gradient
        if hierarchical and comm.local_size > 1:
            leader = comm.global_rank(comm.node_leader())
            yield dist.reduce(flat, dst=leader, group=comm.intra_group, async_op=True)
            if comm.is_leader:
                yield from self._half_sum(bucket, comm.leaders_group)
            yield dist.broadcast(flat, src=leader, group=comm.intra_group, async_op=True)
        else:
            yield from self._half_sum(bucket, comm.group)

    def _half_sum(self, bucket: Bucket, group: dist.ProcessGroup | None) -> BucketStep:
        half = self._buffer(bucket)
        half.copy_(bucket.flat)
        yield dist.all_reduce(half, op=dist.ReduceOp.SUM, group=group, async_op=True)
        bucket.flat.copy_(half)

    def apply_plan(self, plan: BucketPlan) -> None:
        self._half.clear()  # bucket sizes change: free the old buffers before the new ones grow
        super().apply_plan(plan)

    def teardown(self) -> None:
        self._half.clear()
        super().teardown()
