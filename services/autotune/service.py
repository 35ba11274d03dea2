"""The service's logic behind the gRPC adapter: validates requests and routes them to model sessions.

Plain Python (no grpc): the servicer translates protos into these calls, and
errors leave as :mod:`.errors` exceptions that it maps to status codes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from bagua_lightning.proto.plan import BucketPlan, BucketTimingRecord, TensorDeclaration

from .config import ServiceConfig
from .errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from .persistence import PlanStore
from .samplelog import SampleLog
from .session import ModelSession, PlanRef, Registration

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Span:
    """One span of a tensor execution trace (times in ns of any monotonic clock)."""

    trace_id: int
    action: str
    tensor_name: str
    start_time: int
    end_time: int


class AutotuneService:
    """All models' sessions; safe to call from many threads.

    Args:
        config: how to tune (see :class:`ServiceConfig`).
        store: where best plans persist across restarts (None: memory only).
        sample_log: where every sample is logged per model (None: not logged).
        clock: monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(self, config: ServiceConfig, *, store: PlanStore | None = None,
                 sample_log: SampleLog | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.store = store
        self.sample_log = sample_log
        self._sessions: dict[str, ModelSession] = {}
        self._lock = threading.Lock()

    def session(self, model_name: str) -> ModelSession:
        """The session of a registered model; NotFoundError otherwise."""
        session = self._sessions.get(model_name)
        if session is None:
            raise NotFoundError(f"model_name {model_name!r} is not registered; call RegisterTensors first")
        return session

    @property
    def model_names(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def _tensors(self, tensor_list: Sequence[tuple[str, int, str]]) -> tuple[TensorDeclaration, ...]:
        if not tensor_list:
            raise InvalidArgumentError("tensor_list is empty; declare at least one tensor")
        if len(tensor_list) > self.config.max_tensors:
            raise ResourceExhaustedError(
                f"tensor_list has {len(tensor_list)} tensors, more than the service's limit of "
                f"{self.config.max_tensors}; raise --max-tensors")
        tensors = []
        seen: set[str] = set()
        for i, (name, num_elements, dtype) in enumerate(tensor_list):
            try:
                t = TensorDeclaration(name=name, num_elements=num_elements, dtype=dtype)
            except (ValueError, TypeError) as exc:
                raise InvalidArgumentError(f"tensor_list[{i}]: {exc}") from exc
            if t.name in seen:
                raise InvalidArgumentError(f"tensor_list[{i}].name {t.name!r} is a duplicate; names must be unique")
            seen.add(t.name)
            tensors.append(t)
        return tuple(tensors)

    def register(self, model_name: str, tensor_list: Sequence[tuple[str, int, str]], whether_to_bucket: bool,
                 world_size: int = 0, nproc_per_node: int = 0) -> BucketPlan:
        """Declare a model's tensors; returns the initial plan (remembered best, else default)."""
        if not model_name:
            raise InvalidArgumentError("model_name is empty; name the model")
        tensors = self._tensors(tensor_list)
        world = world_size or self.config.world_size
        if world < 1:
            raise InvalidArgumentError(f"world_size must be >= 0 (0: the service's default), got {world_size}")
        per_node = nproc_per_node or world
        if not 1 <= per_node <= world:
            raise InvalidArgumentError(
                f"nproc_per_node must be in [0, world_size={world}] (0: one node), got {nproc_per_node}")
        registration = Registration(model_name=model_name, tensors=tensors, whether_to_bucket=whether_to_bucket,
                                    world_size=world, nproc_per_node=per_node)
        with self._lock:
            session = self._sessions.get(model_name)
            if session is None:
                if len(self._sessions) >= self.config.max_models:
                    raise ResourceExhaustedError(
                        f"the service already tunes {len(self._sessions)} models, its limit; raise --max-models "
                        "or restart it")
                session = ModelSession(registration, self.config, store=self.store, sample_log=self.sample_log,
                                       clock=self._clock)
                self._sessions[model_name] = session
                logger.info("event=model_registered model=%s tensors=%d world_size=%d nproc_per_node=%d "
                            "whether_to_bucket=%s", model_name, len(tensors), world, per_node, whether_to_bucket)
            else:
                session.check_same_registration(registration)
        return session.current_plan

    def report(self, model_name: str, rank: int, train_iter: int, plan: PlanRef | None, speed: float,
               bucket_timings: Sequence[BucketTimingRecord] = (), backward_ms: float = 0.0) -> bool:
        """Record one rank's measurement; False when it duplicates a recorded (rank, train_iter)."""
        return self.session(model_name).report(rank, train_iter, plan, speed, bucket_timings, backward_ms)

    def ask(self, model_name: str, rank: int, train_iter: int) -> tuple[BucketPlan, bool]:
        """The plan for ``train_iter`` (identical for every rank) and whether tuning completed."""
        return self.session(model_name).ask(rank, train_iter)

    def report_execution_order(self, spans: Sequence[Span], model_name: str = "") -> str:
        """Record the order tensors became ready; returns the model it was applied to."""
        if not spans:
            raise InvalidArgumentError("spans is empty; report at least one span")
        if len(spans) > self.config.max_tensors:
            raise ResourceExhaustedError(
                f"spans has {len(spans)} entries, more than the service's limit of {self.config.max_tensors}")
        names = [s.tensor_name for s in sorted(spans, key=lambda s: (s.start_time, s.end_time))]
        session = self.session(model_name) if model_name else self._session_for(names)
        unknown = sorted(set(names) - {t.name for t in session.registration.tensors})
        if unknown:
            raise InvalidArgumentError(
                f"spans name tensors {unknown[:5]} that model {session.registration.model_name!r} did not register")
        session.set_execution_order(names)
        return session.registration.model_name

    def _session_for(self, names: Iterable[str]) -> ModelSession:
        wanted = set(names)
        with self._lock:
            sessions = list(self._sessions.values())
        matches = [s for s in sessions if wanted <= {t.name for t in s.registration.tensors}]
        if len(matches) != 1:
            raise NotFoundError(
                f"model_name is empty and {len(matches)} registered models hold every span's tensor_name "
                f"({sorted(s.registration.model_name for s in matches)[:5]}); set model_name")
        return matches[0]
