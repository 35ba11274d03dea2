"""What ``RegisterTensors`` declared for a model, and what identifies its session and its stored plans."""

from __future__ import annotations

from dataclasses import dataclass

from ...proto.plan import BucketPlan, TensorDeclaration, tensor_list_fingerprint
from .persistence import plan_key


@dataclass(frozen=True, slots=True)
class Registration:
    """What ``RegisterTensors`` declared for a model (``job_id`` empty: registered without a job)."""

    model_name: str
    tensors: tuple[TensorDeclaration, ...]
    whether_to_bucket: bool
    world_size: int
    nproc_per_node: int
    job_id: str = ""

    @property
    def session_key(self) -> tuple[str, str]:
        """What identifies the session: one per (job, model)."""
        return self.job_id, self.model_name

    @property
    def label(self) -> str:
        """How logs and errors name the session."""
        return f"{self.model_name!r:.200} (job {self.job_id!r:.120})" if self.job_id else f"{self.model_name!r:.200}"

    @property
    def fingerprint(self) -> str:
        return tensor_list_fingerprint(self.tensors)

    @property
    def hierarchical_allowed(self) -> bool:
        """Hierarchical reduce only differs from flat when the job spans more than one node."""
        return self.nproc_per_node < self.world_size

    @property
    def store_key(self) -> str:
        return plan_key(self.fingerprint, self.world_size, self.nproc_per_node)


def layout_key(plan: BucketPlan) -> tuple[str, bool]:
    """What tells two plans apart for the statistics: the buckets' fingerprint and hierarchical."""
    return plan.fingerprint(), plan.is_hierarchical_reduce
