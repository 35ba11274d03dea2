"""What ``RegisterTensors`` declared for a model, and what identifies its session and its stored plans."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from ...proto.plan import BucketPlan, TensorDeclaration, tensor_list_fingerprint
from .errors import FailedPreconditionError, InvalidArgumentError
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

    def check_same_model(self, other: Registration) -> None:
        """Raise FailedPreconditionError when ``other`` declares another model under this name."""
        mine = self
        if other.fingerprint != mine.fingerprint:
            raise FailedPreconditionError(
                f"model_name {mine.label} is already registered with a different tensor_list "
                f"({len(mine.tensors)} tensors, fingerprint {mine.fingerprint}; got {len(other.tensors)} "
                f"tensors, fingerprint {other.fingerprint}); use a new model_name for a different model")
        if other.whether_to_bucket != mine.whether_to_bucket:
            raise FailedPreconditionError(
                f"model_name {mine.label} is already registered with whether_to_bucket="
                f"{mine.whether_to_bucket!r}, got {other.whether_to_bucket!r}; use a new model_name")

    def same_shape(self, other: Registration) -> bool:
        """Whether ``other`` has this world size and ranks per node."""
        mine = self
        return (other.world_size, other.nproc_per_node) == (mine.world_size, mine.nproc_per_node)

    def check_same_registration(self, other: Registration) -> None:
        """Raise FailedPreconditionError when ``other`` re-registers this model differently."""
        mine = self
        self.check_same_model(other)
        for name in ("world_size", "nproc_per_node"):
            if getattr(other, name) != getattr(mine, name):
                raise FailedPreconditionError(
                    f"model_name {mine.model_name!r} is already registered with {name}="
                    f"{getattr(mine, name)!r}, got {getattr(other, name)!r}; use a new model_name per job setup")


def layout_key(plan: BucketPlan) -> tuple[str, bool]:
    """What tells two plans apart for the statistics: the buckets' fingerprint and hierarchical."""
    return plan.fingerprint(), plan.is_hierarchical_reduce


def canonical_plan(plan: BucketPlan, names: Mapping[str, TensorDeclaration], model_name: str) -> BucketPlan:
    """``plan`` over the model's own declarations ``names`` (so plans share them); InvalidArgumentError
    when it names a tensor the model did not register or does not cover every registered one."""
    buckets = []
    for bucket in plan.buckets:
        mine = []
        for t in bucket:
            own = names.get(t.name)
            if own != t:
                raise InvalidArgumentError(f"the plan holds tensor {t.to_dict()} which model {model_name!r} did not "
                                           "register; report the plan the service handed back")
            mine.append(own)
        buckets.append(tuple(mine))
    covered = sum(len(b) for b in buckets)
    if covered != len(names):
        raise InvalidArgumentError(f"the plan covers {covered} of the {len(names)} registered tensors of model "
                                   f"{model_name!r}")
    return dataclasses.replace(plan, buckets=tuple(buckets))


class RegistrationFacts:
    """Sums over every tensor of a registration (total bytes, fingerprint), computed once per registration:
    for 100,000 tensors each costs tens of milliseconds of GIL-holding work per ListModels/DescribeModel."""

    def __init__(self, capacity: int = 4096) -> None:
        self._facts: OrderedDict[int, tuple[Registration, int, str]] = OrderedDict()  # id(registration) -> facts
        self._capacity = capacity
        self._lock = threading.Lock()

    def of(self, reg: Registration) -> tuple[int, str]:
        """``reg``'s (total bytes, fingerprint)."""
        hit = self._facts.get(id(reg))
        if hit is not None and hit[0] is reg:
            return hit[1], hit[2]
        total, fingerprint = sum(t.nbytes for t in reg.tensors), reg.fingerprint
        with self._lock:
            self._facts[id(reg)] = (reg, total, fingerprint)  # the registration is kept: its id stays its own
            while len(self._facts) > self._capacity:
                self._facts.popitem(last=False)
        return total, fingerprint
