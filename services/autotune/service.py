"""The service's logic behind the gRPC adapter: validates requests and routes them to model sessions.

Plain Python (no grpc): the servicer translates protos into these calls, and
errors leave as :mod:`.errors` exceptions that it maps to status codes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

from ...proto.plan import DTYPE_SIZES, BucketPlan, BucketTimingRecord, TensorDeclaration
from .config import ServiceConfig
from .costmodel import Sample
from .errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from .memory import MemoryAccount, check_fits, registration_bytes
from .persistence import PlanStore
from .proposal import Proposal, Tuner, exit_with_parent, propose_in_worker
from .reports import PlanRef, Spread
from .samplelog import SampleLog
from .session import ModelSession, Registration
from .storeio import StoreIO
from .validation import check_name

logger = logging.getLogger(__name__)

MAX_WORLD_SIZE = 1 << 20  # ranks of one job
# Each request decodes its own copy of every dtype string: share one per dtype (~50 B a tensor).
_DTYPES = {name: name for name in DTYPE_SIZES}


@dataclass(frozen=True, slots=True)
class Span:
    """One span of a tensor execution trace (times in ns of any monotonic clock)."""

    trace_id: int
    action: str
    tensor_name: str
    start_time: int
    end_time: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model's state, for ListModels / DescribeModel (``samples`` empty in listings)."""

    registration: Registration
    current: BucketPlan
    completed: bool
    best: Sample | None
    samples: tuple[Sample, ...]
    sample_count: int
    reports_accepted: int
    reports_ignored: int
    idle_s: float
    tuner: str
    layouts_tracked: int


class AutotuneService:
    """All models' sessions; safe to call from many threads.

    The service-wide lock guards only the table of sessions (a dict lookup, an insert,
    an eviction); requests of a model then hold that model's own lock, and store or
    sample-log I/O runs outside both (:class:`StoreIO`).

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
        self.io = StoreIO(store, sample_log, timeout_s=config.store_timeout_s)
        self._sessions: dict[str, ModelSession] = {}
        self._lock = threading.Lock()
        self.evicted = 0
        self.memory = MemoryAccount(config.max_memory)  # bytes held per session, guarded by self._lock
        self._retired_plans = 0  # plans issued by sessions since evicted (for the running total)
        self._tuning_pool: ProcessPoolExecutor | None = None
        if config.tuning_processes:
            # Spawned, not forked: the server process runs gRPC threads, which fork does not copy safely.
            self._tuning_pool = ProcessPoolExecutor(config.tuning_processes,
                                                    mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=exit_with_parent, initargs=(os.getpid(),))

    def _propose_async(self, tuner: Tuner, history: tuple[Sample, ...]) -> Future[Proposal]:
        assert self._tuning_pool is not None
        return self._tuning_pool.submit(propose_in_worker, tuner, history)

    @property
    def store(self) -> PlanStore | None:
        return self.io.store

    @property
    def sample_log(self) -> SampleLog | None:
        return self.io.sample_log

    def close(self) -> None:
        """Write what is queued to the store and the sample log, stop the writer and the tuning workers."""
        self.io.close()
        if self._tuning_pool is not None:
            self._tuning_pool.shutdown(wait=True, cancel_futures=True)

    def session(self, model_name: str) -> ModelSession:
        """The session of a registered model; NotFoundError otherwise."""
        session = self._sessions.get(model_name)
        if session is None:
            self._check_name("model_name", model_name)  # a malformed name is INVALID_ARGUMENT, not NOT_FOUND
            raise NotFoundError(f"model_name {model_name!r:.200} is not registered (or was evicted as the least "
                                "recently used); call RegisterTensors first")
        return session

    def tensor_count(self, model_name: str) -> int:
        """Tensors a held model declared (0 when not held): how heavy its requests are."""
        session = self._sessions.get(model_name)
        return len(session.registration.tensors) if session is not None else 0

    @property
    def model_names(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    @property
    def plans_issued(self) -> int:
        """Plans issued since start, by every model (evicted ones included)."""
        with self._lock:
            sessions = list(self._sessions.values())
        return self._retired_plans + sum(s.plans_issued for s in sessions)

    def _check_name(self, what: str, name: str) -> None:
        check_name(what, name, self.config.max_name_bytes)

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
            self._check_name(f"tensor_list[{i}].name", name)
            try:
                t = TensorDeclaration(name=name, num_elements=num_elements, dtype=_DTYPES.get(dtype, dtype))
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
        self._check_name("model_name", model_name)
        if len(tensor_list) <= self.config.max_tensors:  # more: refused below, with the count
            name_bytes = sum(len(t[0]) for t in tensor_list)
            check_fits(model_name, registration_bytes(len(tensor_list), name_bytes), self.config.max_memory)
        tensors = self._tensors(tensor_list)
        world = world_size or self.config.world_size
        if not 1 <= world <= MAX_WORLD_SIZE:
            raise InvalidArgumentError(
                f"world_size must be in [0, {MAX_WORLD_SIZE}] (0: the service's default), got {world_size}")
        per_node = nproc_per_node or world
        if not 1 <= per_node <= world:
            raise InvalidArgumentError(
                f"nproc_per_node must be in [0, world_size={world}] (0: one node), got {nproc_per_node}")
        registration = Registration(model_name=model_name, tensors=tensors, whether_to_bucket=whether_to_bucket,
                                    world_size=world, nproc_per_node=per_node)
        session = self._sessions.get(model_name)
        created = False
        if session is None:
            # The store is read with no lock held: a slow store delays this registration only.
            remembered = self.io.load(registration.store_key)
            fresh = ModelSession(registration, self.config, remembered=remembered, persist=self.io.save,
                                 sample_log=self.io.log if self.io.sample_log is not None else None,
                                 propose_async=self._propose_async if self._tuning_pool else None,
                                 clock=self._clock)
            with self._lock:
                session = self._sessions.get(model_name)
                if session is None:
                    self._evict_for_one()
                    session = self._sessions[model_name] = fresh
                    created = True
                    if self.memory.update(model_name, fresh, name_bytes):
                        self._evict_for_bytes(keep=model_name)
                    logger.info("event=model_registered model=%s tensors=%d world_size=%d nproc_per_node=%d "
                                "whether_to_bucket=%s", model_name, len(tensors), world, per_node,
                                whether_to_bucket)
        if not created:
            session.check_same_registration(registration)
        session.last_used = self._clock()
        return session.current_plan

    def _evict_for_one(self) -> None:
        """Lock held: make room for one more model by dropping the least recently used ones."""
        while len(self._sessions) >= self.config.max_models:
            name = min(self._sessions, key=lambda n: self._sessions[n].last_used)
            self._evict(name, "max-models")

    def _evict(self, name: str, reason: str) -> None:
        """Lock held: drop one session (its best plan is in the store already: sessions persist each new best)."""
        old = self._sessions.pop(name)
        freed = self.memory.bytes_of(name)
        self.memory.forget(name)
        self._retired_plans += old.plans_issued
        self.evicted += 1
        logger.info("event=model_evicted model=%s reason=%s idle_s=%.1f bytes=%d models=%d accounted_bytes=%d",
                    name, reason, self._clock() - old.last_used, freed, len(self._sessions), self.memory.total)

    def _evict_for_bytes(self, keep: str) -> None:
        """Lock held: drop the least recently used sessions (never ``keep``) until the rest fit --max-memory."""
        for name in self.memory.over_budget(self._sessions, keep):
            self._evict(name, "max-memory")
            self.memory.evicted_for_bytes += 1

    def _reaccount(self, model_name: str, session: ModelSession) -> None:
        """Re-measure a session that grew (a new plan or sample), evicting others when over budget."""
        with self._lock:
            if self._sessions.get(model_name) is session and self.memory.update(model_name, session):
                self._evict_for_bytes(keep=model_name)

    def report(self, model_name: str, rank: int, train_iter: int, plan: PlanRef | None, speed: float,
               bucket_timings: Sequence[BucketTimingRecord] = (), backward_ms: float = 0.0,
               spread: Spread = Spread()) -> bool:
        """Record a measurement; False when it duplicates a recorded (rank, train_iter)."""
        return self.session(model_name).report(rank, train_iter, plan, speed, bucket_timings, backward_ms, spread)

    def ask(self, model_name: str, rank: int, train_iter: int) -> tuple[BucketPlan, bool]:
        """The plan for ``train_iter`` (identical for every rank) and whether tuning completed."""
        session = self.session(model_name)
        issued = session.plans_issued
        answer = session.ask(rank, train_iter)
        if session.plans_issued != issued:  # a new plan (and the sample that led to it): the session grew
            self._reaccount(model_name, session)
        return answer

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
                f"spans name tensors {[n[:80] for n in unknown[:5]]} that model "
                f"{session.registration.model_name!r} did not register")
        session.set_execution_order(names)
        return session.registration.model_name

    def _session_for(self, names: Iterable[str]) -> ModelSession:
        wanted = set(names)
        with self._lock:
            sessions = list(self._sessions.values())
        matches = [s for s in sessions if wanted <= s.tensor_names]
        if len(matches) != 1:
            raise NotFoundError(
                f"model_name is empty and {len(matches)} registered models hold every span's tensor_name "
                f"({sorted(s.registration.model_name for s in matches)[:5]}); set model_name")
        return matches[0]

    # -- inspection ----------------------------------------------------------------------------------
    def _info(self, session: ModelSession, with_samples: bool) -> ModelInfo:
        samples = session.samples
        return ModelInfo(registration=session.registration, current=session.current_plan,
                         completed=session.completed, best=session.best,
                         samples=tuple(samples) if with_samples else (), sample_count=len(samples),
                         reports_accepted=session.reports_accepted, reports_ignored=session.reports_ignored,
                         idle_s=max(0.0, self._clock() - session.last_used), tuner=session.tuner_kind,
                         layouts_tracked=session.layouts_tracked)

    def list_models(self) -> list[ModelInfo]:
        """Every model held now, sorted by name."""
        with self._lock:
            sessions = sorted(self._sessions.items())
        return [self._info(s, with_samples=False) for _, s in sessions]

    def describe(self, model_name: str) -> ModelInfo:
        """One model's state with its samples; NotFoundError when it is not held."""
        return self._info(self.session(model_name), with_samples=True)
