"""Who the job is and what it carries across a restart: the job id and the checkpointed tuning state.

* **Job id.** Every job has its own tuning session on the service, keyed by a job id that
  all ranks share. Rank 0 picks it (:func:`launcher_job_id`, else the checkpoint's, else a
  new random one) and broadcasts it, so ranks never disagree even where the environment
  differs between hosts.
* **State.** :class:`AutotuneState` is what goes into a Lightning checkpoint: the job id, the
  plan in use (as tensor names) and how far tuning got. A resumed job applies that plan at
  start and registers with it, so it continues its session (same job id, service still
  holding it) or starts a new one from it.
"""

from __future__ import annotations

import os
import unicodedata
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...core.errors import ConfigurationError
from ...proto.plan import BucketPlan, TensorDeclaration

MAX_MODEL_NAME_CHARS = 200  # the service's default --max-name-bytes is larger; names stay readable in `ls`
MAX_JOB_ID_CHARS = 128
#: Environment variables that name the job, in order of preference: ours, torchrun's run id (the same
#: for every restart of an elastic job), SLURM's job id (kept by a requeued job).
JOB_ID_VARIABLES = ("BAGUA_LIGHTNING_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
STATE_FORMAT = 1  # version of the checkpointed state's layout


def check_name(what: str, value: object, max_chars: int) -> str:
    """``value`` when it is a usable name (1 to ``max_chars`` printable characters), else ConfigurationError."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > max_chars:
        raise ConfigurationError(f"{what} is {len(value)} characters long ({value[:40]!r}...), more than "
                                 f"{max_chars}; use a shorter name")
    bad = next((c for c in value if unicodedata.category(c).startswith("C")), None)
    if bad is not None:
        raise ConfigurationError(f"{what} {value[:80]!r} holds the control character {bad!r}; use printable "
                                 "characters")
    return value


def launcher_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The job id the launcher gives (see :data:`JOB_ID_VARIABLES`), or None.

    torchrun sets ``TORCHELASTIC_RUN_ID`` to ``"none"`` when no ``--rdzv-id`` was given:
    that names no job. A SLURM job step adds its step id (two ``srun`` steps of one
    allocation are two jobs). An id that is not a usable name is skipped.
    """
    env = os.environ if environ is None else environ
    for variable in JOB_ID_VARIABLES:
        value = env.get(variable, "").strip()
        if not value or value.lower() == "none":
            continue
        if variable == "TORCHELASTIC_RUN_ID":
            value = f"torchrun-{value}"
        elif variable == "SLURM_JOB_ID":
            step = env.get("SLURM_STEP_ID", "").strip()
            value = f"slurm-{value}" + (f".{step}" if step else "")
        try:
            return check_name(f"job id from {variable}", value, MAX_JOB_ID_CHARS)
        except ConfigurationError:
            continue
    return None


def new_job_id() -> str:
    """A fresh random job id (rank 0 makes it when nothing names the job)."""
    return f"job-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True, slots=True)
class AutotuneState:
    """The tuning state a checkpoint keeps (every rank holds the same one: it comes from broadcasts).

    Attributes:
        job_id: the job's id on the service.
        model_name: the name the model was tuned under.
        model_fingerprint: the tensor list's fingerprint; a checkpoint of another model is ignored.
        plan: the plan in use, as tensor names per bucket; None: the strategy's default plan.
        bucket_size: the plan's bucket size in bytes.
        hierarchical: the plan's hierarchical flag.
        version: the plan's version on the service (-1: the default plan).
        completed: tuning had completed (the plan is final).
        plans_applied: plans applied so far in the job (tuning progress).
    """

    job_id: str
    model_name: str
    model_fingerprint: str
    plan: tuple[tuple[str, ...], ...] | None
    bucket_size: int
    hierarchical: bool
    version: int
    completed: bool
    plans_applied: int

    @classmethod
    def of(cls, *, job_id: str, model_name: str, model_fingerprint: str, plan: BucketPlan | None, version: int,
           completed: bool, plans_applied: int) -> AutotuneState:
        return cls(job_id=job_id, model_name=model_name, model_fingerprint=model_fingerprint,
                   plan=tuple(tuple(b) for b in plan.tensor_names) if plan is not None and version >= 0 else None,
                   bucket_size=plan.bucket_size if plan is not None else 0,
                   hierarchical=bool(plan and plan.is_hierarchical_reduce), version=version, completed=completed,
                   plans_applied=plans_applied)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (a checkpoint loads with ``weights_only=True``)."""
        return {"format": STATE_FORMAT, "job_id": self.job_id, "model_name": self.model_name,
                "model_fingerprint": self.model_fingerprint,
                "plan": [list(b) for b in self.plan] if self.plan is not None else None,
                "bucket_size": self.bucket_size, "hierarchical": self.hierarchical, "version": self.version,
                "completed": self.completed, "plans_applied": self.plans_applied}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> AutotuneState:
        """Parse a checkpoint's state; ValueError naming what is wrong."""
        try:
            if value.get("format") != STATE_FORMAT:
                raise ValueError(f"format {value.get('format')!r} is not {STATE_FORMAT}")
            plan = value["plan"]
            return cls(job_id=check_name("job_id", value["job_id"], MAX_JOB_ID_CHARS),
                       model_name=str(value["model_name"]), model_fingerprint=str(value["model_fingerprint"]),
                       plan=tuple(tuple(str(n) for n in b) for b in plan) if plan is not None else None,
                       bucket_size=int(value["bucket_size"]), hierarchical=bool(value["hierarchical"]),
                       version=int(value["version"]), completed=bool(value["completed"]),
                       plans_applied=int(value["plans_applied"]))
        except (KeyError, TypeError, ConfigurationError) as exc:
            raise ValueError(f"the checkpoint's autotune state is malformed ({type(exc).__name__}: {exc})") from None

    def bucket_plan(self, tensors: Sequence[TensorDeclaration]) -> BucketPlan | None:
        """The saved plan over ``tensors`` (the model's declarations); None without one. ValueError when it
        names a tensor the model lacks or misses one."""
        if self.plan is None:
            return None
        by_name = {t.name: t for t in tensors}
        try:
            buckets = tuple(tuple(by_name[n] for n in b) for b in self.plan)
        except KeyError as exc:
            raise ValueError(f"the saved plan names tensor {exc} which the model does not have") from None
        if sum(len(b) for b in buckets) != len(by_name):
            raise ValueError(f"the saved plan covers {sum(len(b) for b in buckets)} of the model's {len(by_name)} "
                             "tensors")
        return BucketPlan(buckets=buckets, bucket_size=self.bucket_size or 1, is_hierarchical_reduce=self.hierarchical,
                          version=max(self.version, 0))
