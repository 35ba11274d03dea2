"""Keeping every rank on the same plan: one broadcast of rank 0's decision, then one agreement check.

Plans travel between ranks as :class:`BoundaryMessage` through
``broadcast_object_list`` (the mechanism the bucket engine uses for the
gradient-ready order), carrying the plan as indices into the model's tensor list.
:func:`check_agreement` then compares (plan version, layout fingerprint, model
fingerprint, apply failure) across ranks with one ``all_reduce`` and raises
:class:`~bagua_lightning.core.errors.PlanMismatchError` on every rank when they differ,
instead of letting a later collective hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...core.errors import PlanMismatchError
from ...proto.plan import BucketPlan, TensorDeclaration


@dataclass(frozen=True, slots=True)
class BoundaryMessage:
    """Rank 0's decision at a step boundary.

    Attributes:
        registered: rank 0 is registered with the service.
        completed: the service finished tuning.
        iter_base: offset of ``train_iter`` on the wire (rank 0's job start, microseconds).
        plan: the plan to apply now, as (tensor indices per bucket, bucket_size,
            hierarchical, version); None: keep the current one.
    """

    registered: bool
    completed: bool
    iter_base: int
    plan: tuple[tuple[tuple[int, ...], ...], int, bool, int] | None = None

    @staticmethod
    def pack(plan: BucketPlan, index: dict[str, int]) -> tuple[tuple[tuple[int, ...], ...], int, bool, int]:
        return (tuple(tuple(index[t.name] for t in b) for b in plan.buckets), plan.bucket_size,
                plan.is_hierarchical_reduce, plan.version)

    def unpack(self, tensors: Sequence[TensorDeclaration]) -> BucketPlan | None:
        if self.plan is None:
            return None
        buckets, size, hierarchical, version = self.plan
        return BucketPlan(buckets=tuple(tuple(tensors[i] for i in b) for b in buckets), bucket_size=size,
                          is_hierarchical_reduce=hierarchical, version=version)


def broadcast_message(message: BoundaryMessage | None, *, group: dist.ProcessGroup | None, device: torch.device,
                      world_size: int) -> BoundaryMessage:
    """Rank 0's ``message`` on every rank (a collective; other ranks pass None)."""
    if world_size == 1:
        assert message is not None
        return message
    box: list[object] = [message]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    received = box[0]
    if not isinstance(received, BoundaryMessage):
        raise PlanMismatchError(f"expected rank 0's boundary message, got {type(received).__name__}")
    return received


def broadcast_from_main(value: object, *, group: dist.ProcessGroup | None, device: torch.device,
                        world_size: int) -> object:
    """Rank 0's ``value`` (a small picklable object) on every rank; a collective."""
    if world_size == 1:
        return value
    box: list[object] = [value]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    return box[0]


def _hash63(hex_digest: str) -> int:
    return int(hex_digest[:16], 16) >> 1  # fits int64 with room for negation


def check_agreement(*, step: int, version: int, plan: BucketPlan | None, model_fingerprint: str, failure: str,
                    group: dist.ProcessGroup | None, device: torch.device, world_size: int) -> None:
    """Raise PlanMismatchError on every rank when ranks differ in plan, model or apply success (a collective)."""
    plan_hash = _hash63(plan.fingerprint()) if plan is not None else 0
    mine = [version, plan_hash, _hash63(model_fingerprint), int(bool(failure))]
    if world_size > 1:
        t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        values = t.cpu().tolist()
        highest, lowest = values[:4], [-v for v in values[4:]]
    else:
        highest = lowest = mine
    if highest != lowest:
        what = [name for name, hi, lo in zip(("plan version", "plan layout", "model (tensor list)", "apply failure"),
                                             highest, lowest, strict=True) if hi != lo]
        raise PlanMismatchError(
            f"ranks disagree at step {step} on: {', '.join(what)} (this rank: plan v{version}, fingerprint "
            f"{plan.fingerprint() if plan else None}, model {model_fingerprint}"
            f"{', apply failed: ' + failure if failure else ''}); every rank must build the same model and apply "
            "the same plan at the same step boundary")
