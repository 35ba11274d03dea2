"""What :class:`~bagua_lightning.client.autotune.AutotuneClient` returns, and the messages it builds.

The service's answers become these frozen records (never proto messages leave the client), and the plain
values a caller passes (dataclasses, or dicts in Bagua's shapes) become request messages here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..proto.autotune.v1 import autotune_pb2 as pb
from ..proto.plan import BucketPlan, BucketTimingRecord, TensorDeclaration


@dataclass(frozen=True, slots=True)
class AlgorithmSelection:
    """What ``algorithm="auto"`` measured and kept (``AlgorithmSelection`` in the proto).

    Attributes:
        chosen: the candidate kept.
        step_ms: each candidate's step time in milliseconds (median, slowest rank), in measured order.
        reason: one line saying why.
        step: the training step every rank switched at.
        job_id: the job that measured it.
    """

    chosen: str
    step_ms: tuple[tuple[str, float], ...]
    reason: str
    step: int
    job_id: str = ""


@dataclass(frozen=True, slots=True)
class PlanAnswer:
    """The service's answer to AskHyperparameters.

    Attributes:
        plan: the plan to use from the asked iteration on (identical for every rank).
        completed: True once tuning finished; the plan is then final.
        selection: (registrations) what ``algorithm="auto"`` measured for this model and placement, by this
            job or the one whose plan it starts from; None when none.
    """

    plan: BucketPlan
    completed: bool
    selection: AlgorithmSelection | None = None


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """One model the service holds (see ``ModelSummary`` in the proto; scores in samples/s or -ms)."""

    model_name: str
    tensors: int
    total_bytes: int
    world_size: int
    nproc_per_node: int
    plan_version: int
    completed: bool
    samples: int
    reports_accepted: int
    reports_ignored: int
    best_score: float | None
    idle_s: float
    tuner: str
    layouts_tracked: int
    job_id: str = ""
    fingerprint: str = ""
    algorithm: str = ""
    reshapes: int = 0


@dataclass(frozen=True, slots=True)
class JobShape:
    """One shape a job ran in (``JobShape`` in the proto): its registration, or a re-registration with another
    world size or ranks per node.

    Attributes:
        world_size: ranks of the job.
        nproc_per_node: ranks per node.
        registered_at: Unix time of the registration, seconds.
        plan_version: the version of the plan the shape started on.
        started_from: ``"shared"`` (the shape's shared best plan), ``"resumed"`` or ``"default"``.
        shared_key: the shared plan's store key when it started from one, else "".
    """

    world_size: int
    nproc_per_node: int
    registered_at: float
    plan_version: int
    started_from: str
    shared_key: str = ""


@dataclass(frozen=True, slots=True)
class SharedPlan:
    """The best plan the service knows for one shape of a model (``SharedPlanSummary`` in the proto)."""

    key: str
    model_name: str
    job_id: str
    world_size: int
    nproc_per_node: int
    score: float
    completed: bool
    buckets: int
    saved_at: float = 0.0
    reports: int = 0
    samples: int = 0


def shared_plan_of(p: Any) -> SharedPlan:
    """A ``SharedPlanSummary`` message as a :class:`SharedPlan`."""
    return SharedPlan(**{name: getattr(p, name) for name in SharedPlan.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class SampleSummary:
    """One measured plan: its layout in bytes per bucket and what it scored (speed in samples/s per rank)."""

    index: int
    plan_version: int
    bucket_size: int
    is_hierarchical_reduce: bool
    bucket_bytes: tuple[int, ...]
    speed: float
    score: float
    exposed_ms: float
    reports: int
    train_iter: int


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """DescribeModel's answer: the summary, the current and best plans, every measured plan, the selection."""

    summary: ModelSummary
    current: BucketPlan
    best: BucketPlan | None
    samples: tuple[SampleSummary, ...]
    selection: AlgorithmSelection | None = None
    shapes: tuple[JobShape, ...] = ()


def summary_of(m: Any) -> ModelSummary:
    """A ``ModelSummary`` message as a :class:`ModelSummary`."""
    return ModelSummary(model_name=m.model_name, tensors=m.tensors, total_bytes=m.total_bytes,
                        world_size=m.world_size, nproc_per_node=m.nproc_per_node, plan_version=m.plan_version,
                        completed=m.completed, samples=m.samples, reports_accepted=m.reports_accepted,
                        reports_ignored=m.reports_ignored, best_score=m.best_score if m.has_best else None,
                        idle_s=m.idle_s, tuner=m.tuner, layouts_tracked=m.layouts_tracked, job_id=m.job_id,
                        fingerprint=m.fingerprint, algorithm=m.algorithm, reshapes=m.reshapes)


def shapes_of(reply: Any) -> tuple[JobShape, ...]:
    """A ``DescribeModelResponse``'s shapes, oldest first."""
    return tuple(JobShape(**{name: getattr(s, name) for name in JobShape.__dataclass_fields__}) for s in reply.shapes)


def selection_of(reply: Any) -> AlgorithmSelection | None:
    """The reply's ``algorithm_selection`` (None when unset)."""
    if not reply.HasField("algorithm_selection"):
        return None
    a = reply.algorithm_selection
    return AlgorithmSelection(chosen=a.chosen, step_ms=tuple((c.algorithm, c.step_ms) for c in a.candidates),
                              reason=a.reason, step=a.step, job_id=a.job_id)


def tensor_to_proto(value: TensorDeclaration | Mapping[str, Any]) -> Any:
    """A ``TensorDeclaration`` message from the dataclass or a dict in Bagua's shape."""
    t = TensorDeclaration.coerce(value)
    return pb.TensorDeclaration(name=t.name, num_elements=t.num_elements, dtype=t.dtype)


def plan_of(value: BucketPlan | Mapping[str, Any]) -> BucketPlan:
    """A plan from the dataclass or a dict in Bagua's shape (:meth:`BucketPlan.to_dict`)."""
    if isinstance(value, BucketPlan):
        return value
    if isinstance(value, Mapping):
        return BucketPlan.from_dict(value)
    raise TypeError(f"hyperparameters must be a BucketPlan or a dict in Bagua's shape, got {type(value).__name__}")


def timing_to_proto(value: BucketTimingRecord | Mapping[str, Any]) -> Any:
    """A ``BucketTiming`` message from a ``BucketTimingRecord`` or a dict of its fields."""
    if isinstance(value, BucketTimingRecord):
        value = value.to_dict()
    if isinstance(value, Mapping):
        unknown = set(value) - {"bucket_index", "bytes", "ready_ms", "comm_ms", "wait_ms", "comm_ms_max",
                                "wait_ms_max"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in bucket timing {dict(value)!r}; expected "
                             "bucket_index, bytes, ready_ms, comm_ms, wait_ms (comm_ms_max, wait_ms_max)")
        return pb.BucketTiming(**value)
    raise TypeError(f"a bucket timing must be a BucketTimingRecord or a dict, got {type(value).__name__}")


def span_to_proto(value: Mapping[str, Any]) -> Any:
    """An ``ExecutionSpan`` message from a dict (Bagua's span shape)."""
    if isinstance(value, Mapping):
        return pb.ExecutionSpan(**value)
    raise TypeError(f"a span must be a dict, got {type(value).__name__}")
