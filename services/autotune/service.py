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
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field

from ...proto.plan import DTYPE_SIZES, BucketPlan, BucketTimingRecord, TensorDeclaration
from .choice import AlgorithmChoice
from .config import ServiceConfig
from .costmodel import Sample
from .errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from .memory import MemoryAccount, check_fits, registration_bytes
from .persistence import PlanStore, StoredPlan
from .plancache import EncodedPlans
from .proposal import Proposal, Tuner, exit_with_parent, propose_in_worker
from .registration import Registration, RegistrationFacts
from .reports import PlanRef, Spread
from .samplelog import SampleLog
from .session import ModelSession
from .shapes import JobShape, ShapeHistory
from .sharing import SharedPlans
from .storeio import StoreIO
from .validation import check_name

logger = logging.getLogger(__name__)

MAX_WORLD_SIZE = 1 << 20  # ranks of one job

#: What identifies a tuning session: (job_id, model_name); job_id "" for registrations without a job.
SessionKey = tuple[str, str]
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
    total_bytes: int  # of every tensor the registration declared
    fingerprint: str  # of its tensor list
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
    selection: AlgorithmChoice | None = None
    shapes: ShapeHistory = field(default_factory=ShapeHistory)


class AutotuneService:
    """All jobs' sessions; safe to call from many threads.

    Every (job_id, model_name) is its own session, so concurrent jobs of one model tune
    independently. What they learn is shared by shape: the best plan per store key
    (tensor-list fingerprint, world size, ranks per node) is kept in memory and in the
    store, and a new session starts from it -- a starting point the session confirms with its
    own measurements, never a verdict (:mod:`.sharing` says which plan is kept).

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
        self._sessions: dict[SessionKey, ModelSession] = {}
        self._lock = threading.Lock()
        self.shared = SharedPlans(self.io)  # the best plan per store key: what jobs share
        self.evicted = 0
        self.memory = MemoryAccount(config.max_memory)  # bytes held per session, guarded by self._lock
        self._retired_plans = 0  # plans issued by sessions since evicted (for the running total)
        # Plans encoded for the wire, counted in their sessions' footprints (see :mod:`.plancache`).
        self.plans = EncodedPlans(self._account_cached)
        self._facts = RegistrationFacts()
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

    def session(self, model_name: str, job_id: str = "") -> ModelSession:
        """The session of a registered (job, model); NotFoundError otherwise."""
        session = self._sessions.get((job_id, model_name))
        if session is None:
            self._check_name("model_name", model_name)  # a malformed name is INVALID_ARGUMENT, not NOT_FOUND
            job = f" under job_id {job_id!r:.120}" if job_id else " without a job_id"
            raise NotFoundError(f"model_name {model_name!r:.200} is not registered{job} (or was evicted as the "
                                "least recently used); call RegisterTensors first")
        return session

    def tensor_count(self, model_name: str, job_id: str = "") -> int:
        """Tensors a held (job, model) declared (0 when not held): how heavy its requests are."""
        session = self._sessions.get((job_id, model_name))
        return len(session.registration.tensors) if session is not None else 0

    def find_session(self, model_name: str, job_id: str = "") -> ModelSession:
        """:meth:`session`; with an empty ``job_id``, also the only job's session of ``model_name``."""
        if job_id or ("", model_name) in self._sessions:
            return self.session(model_name, job_id)
        with self._lock:
            matches = [s for (_, name), s in self._sessions.items() if name == model_name]
        if len(matches) > 1:
            jobs = sorted(s.registration.job_id for s in matches)
            raise FailedPreconditionError(f"model_name {model_name!r:.200} is held by {len(matches)} jobs "
                                          f"({jobs[:5]}); name the job (job_id)")
        return matches[0] if matches else self.session(model_name)

    @property
    def model_names(self) -> list[str]:
        """The model name of every session held (once per job)."""
        with self._lock:
            return [name for _, name in self._sessions]

    # -- what jobs share: the best plan per shape (:mod:`.sharing`) -----------------------------------
    def shared_plans(self, *, from_store: bool = False) -> list[tuple[str, StoredPlan]]:
        """The best plan per store key known to this service (with ``from_store``, also those only in the
        store), sorted by key."""
        return self.shared.listed(from_store=from_store)

    def forget(self, what: str) -> tuple[list[tuple[str, StoredPlan]], str]:
        """Remove the shared plans of a model name, shape key or job id (see :meth:`SharedPlans.forget`)."""
        return self.shared.forget(what, timeout_s=max(5.0, 2 * self.config.store_timeout_s))

    @property
    def plans_issued(self) -> int:
        """Plans issued since start, by every model (evicted ones included)."""
        with self._lock:
            sessions = list(self._sessions.values())
        return self._retired_plans + sum(s.plans_issued for s in sessions)

    def _check_job_id(self, job_id: str) -> None:
        self._check_name("job_id", job_id)
        bad = next((c for c in job_id if unicodedata.category(c).startswith("C")), None)
        if bad is not None:
            raise InvalidArgumentError(f"job_id {job_id[:80]!r} holds the control character {bad!r}; use printable "
                                       "characters (e.g. the launcher's run id)")

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
                 world_size: int = 0, nproc_per_node: int = 0, job_id: str = "") -> BucketPlan:
        """Declare a model's tensors; returns the initial plan (see :meth:`register_session`)."""
        return self.register_session(model_name, tensor_list, whether_to_bucket, world_size, nproc_per_node,
                                     job_id=job_id).current_plan

    def register_session(self, model_name: str, tensor_list: Sequence[tuple[str, int, str]],
                         whether_to_bucket: bool, world_size: int = 0, nproc_per_node: int = 0, *,
                         job_id: str = "", resume: BucketPlan | None = None,
                         resume_completed: bool = False) -> ModelSession:
        """Declare a model's tensors for a job; returns its session (whose current plan is the answer).

        A new session starts from ``resume`` (a resumed job's plan) when given, else from the best
        plan known for its shape, else the default plan. A job (non-empty ``job_id``) that
        registers again with another world size or ranks per node gets a new session for the new
        shape, its plan versions continuing; without a job id that is FailedPreconditionError.
        """
        if not model_name:
            raise InvalidArgumentError("model_name is empty; name the model")
        self._check_name("model_name", model_name)
        if job_id:
            self._check_job_id(job_id)
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
                                    world_size=world, nproc_per_node=per_node, job_id=job_id)
        key = registration.session_key
        session = self._sessions.get(key)
        if session is not None:
            if not job_id or session.registration.same_shape(registration):
                session.registration.check_same_registration(registration)
                session.last_used = self._clock()
                return session
            session.registration.check_same_model(registration)  # a resize keeps the model
        # The store is read with no lock held: a slow store delays this registration only.
        start: StoredPlan | None
        first_version = 0 if session is None else session.next_version
        if resume is not None:
            start = StoredPlan(plan=resume, score=0.0, completed=resume_completed, model_name=model_name,
                               job_id=job_id)
            first_version = max(first_version, resume.version)
        else:
            start = self.shared.best(registration.store_key)
        # Only the job's own plan (its checkpoint's, or the one it stored itself) may hand back `completed`.
        own = resume is not None or (start is not None and bool(job_id) and start.job_id == job_id)
        fresh = ModelSession(registration, self.config, remembered=start, own=own, first_version=first_version,
                             persist=self.shared.save,
                             sample_log=self.io.log if self.io.sample_log is not None else None,
                             propose_async=self._propose_async if self._tuning_pool else None, clock=self._clock)
        if resume is not None and not fresh.current_plan.same_layout(resume):
            raise InvalidArgumentError(f"resume_hyperparameters does not cover exactly the {len(tensors)} tensors of "
                                       f"tensor_list; send the plan the job runs, or none")
        origin = "default" if not fresh.started_on_remembered else "resumed" if resume is not None else "shared"
        fresh.shapes = (session.shapes if session is not None else ShapeHistory()).then(JobShape(
            world_size=world, nproc_per_node=per_node, registered_at=time.time(),
            plan_version=fresh.current_plan.version, started_from=origin,
            shared_key=registration.store_key if origin == "shared" else ""))
        with self._lock:
            held = self._sessions.get(key)
            current: ModelSession = fresh if held is None or held is session else held
            if current is fresh:  # nobody registered (or re-registered) this key meanwhile
                if held is None:
                    self._evict_for_one()
                else:
                    self._retired_plans += held.plans_issued
                self._sessions[key] = fresh
                if self.memory.update(key, fresh, name_bytes):
                    self._evict_for_bytes(keep=key)
                old = session.registration if session is not None else None
                logger.info("event=%s model=%s job=%s tensors=%d world_size=%d nproc_per_node=%d "
                            "whether_to_bucket=%s%s", "model_registered" if old is None else "job_reregistered",
                            model_name, job_id, len(tensors), world, per_node, whether_to_bucket,
                            "" if old is None else f" was_world_size={old.world_size} "
                            f"was_nproc_per_node={old.nproc_per_node} first_version={first_version} "
                            f"started_from={origin} reshapes={fresh.shapes.reshapes}")
        if current is not fresh:
            current.registration.check_same_registration(registration)
        current.last_used = self._clock()
        return current

    def _evict_for_one(self) -> None:
        """Lock held: make room for one more model by dropping the least recently used ones."""
        while len(self._sessions) >= self.config.max_models:
            key = min(self._sessions, key=lambda k: self._sessions[k].last_used)
            self._evict(key, "max-models")

    def _account_cached(self, key: SessionKey, nbytes: int) -> bool:
        """Count ``nbytes`` of the session ``key``'s plans cached encoded (:attr:`plans`) in its footprint,
        evicting others when over budget; False when that session is not held (drop them)."""
        with self._lock:
            if key not in self._sessions:
                return False
            if self.memory.set_cached(key, nbytes):
                self._evict_for_bytes(keep=key)
            return True

    def _evict(self, key: SessionKey, reason: str) -> None:
        """Lock held: drop one session (its best plan is in the store already: sessions persist each new best)."""
        old = self._sessions.pop(key)
        self.plans.evicted(key)
        freed = self.memory.bytes_of(key)
        self.memory.forget(key)
        self._retired_plans += old.plans_issued
        self.evicted += 1
        logger.info("event=model_evicted model=%s job=%s reason=%s idle_s=%.1f bytes=%d models=%d "
                    "accounted_bytes=%d", key[1], key[0], reason, self._clock() - old.last_used, freed,
                    len(self._sessions), self.memory.total)

    def _evict_for_bytes(self, keep: SessionKey) -> None:
        """Lock held: drop the least recently used sessions (never ``keep``) until the rest fit --max-memory."""
        for key in self.memory.over_budget(self._sessions, keep):
            self._evict(key, "max-memory")
            self.memory.evicted_for_bytes += 1

    def _reaccount(self, key: SessionKey, session: ModelSession) -> None:
        """Re-measure a session that grew (a new plan or sample), evicting others when over budget."""
        with self._lock:
            if self._sessions.get(key) is session and self.memory.update(key, session):
                self._evict_for_bytes(keep=key)

    def report(self, model_name: str, rank: int, train_iter: int, plan: PlanRef | None, speed: float,
               bucket_timings: Sequence[BucketTimingRecord] = (), backward_ms: float = 0.0,
               spread: Spread = Spread(), job_id: str = "") -> bool:
        """Record a measurement; False when it duplicates a recorded (rank, train_iter)."""
        return self.session(model_name, job_id).report(rank, train_iter, plan, speed, bucket_timings, backward_ms,
                                                       spread)

    def ask(self, model_name: str, rank: int, train_iter: int, job_id: str = "") -> tuple[BucketPlan, bool]:
        """The plan for ``train_iter`` (identical for every rank) and whether tuning completed."""
        session = self.session(model_name, job_id)
        issued = session.plans_issued
        answer = session.ask(rank, train_iter)
        if session.plans_issued != issued:  # a new plan (and the sample that led to it): the session grew
            self._reaccount((job_id, model_name), session)
        return answer

    def report_execution_order(self, spans: Sequence[Span], model_name: str = "", job_id: str = "") -> str:
        """Record the order tensors became ready; returns the model it was applied to."""
        if not spans:
            raise InvalidArgumentError("spans is empty; report at least one span")
        if len(spans) > self.config.max_tensors:
            raise ResourceExhaustedError(
                f"spans has {len(spans)} entries, more than the service's limit of {self.config.max_tensors}")
        names = [s.tensor_name for s in sorted(spans, key=lambda s: (s.start_time, s.end_time))]
        session = self.session(model_name, job_id) if model_name else self._session_for(names, job_id)
        unknown = sorted(set(names) - {t.name for t in session.registration.tensors})
        if unknown:
            raise InvalidArgumentError(
                f"spans name tensors {[n[:80] for n in unknown[:5]]} that model "
                f"{session.registration.model_name!r} did not register")
        session.set_execution_order(names)
        return session.registration.model_name

    def _session_for(self, names: Iterable[str], job_id: str) -> ModelSession:
        wanted = set(names)
        with self._lock:
            sessions = [s for (job, _), s in self._sessions.items() if job == job_id]
        matches = [s for s in sessions if wanted <= s.tensor_names]
        if len(matches) != 1:
            raise NotFoundError(
                f"model_name is empty and {len(matches)} registered models hold every span's tensor_name "
                f"({sorted(s.registration.model_name for s in matches)[:5]}); set model_name")
        return matches[0]

    def report_selection(self, model_name: str, job_id: str, chosen: str, step_ms: Sequence[tuple[str, float]],
                         reason: str, step: int) -> AlgorithmChoice:
        """Record what ``algorithm="auto"`` kept for a registered (job, model), replacing an earlier report.

        It is stored with the shape's best plan (re-saved now when one is known, else with the session's
        first best), so a session that a restarted service builds from that plan shows it again.
        """
        session = self.session(model_name, job_id)
        choice = AlgorithmChoice.of(chosen, step_ms, reason, step, job_id=job_id)
        session.selection = choice
        session.last_used = self._clock()
        self.shared.with_selection(session.registration.store_key, choice)
        logger.info("event=algorithm_selected model=%s job=%s chosen=%s step=%d step_ms=%s", model_name, job_id,
                    chosen, step, ",".join(f"{n}:{ms:.3f}" for n, ms in choice.step_ms))
        return choice

    def selections(self) -> list[tuple[str, str, AlgorithmChoice]]:
        """``(model_name, job_id, choice)`` of every session held that has a selection."""
        with self._lock:
            sessions = list(self._sessions.items())
        return [(name, job, s.selection) for (job, name), s in sessions if s.selection is not None]

    def reshapes(self) -> list[tuple[str, str, int]]:
        """``(model_name, job_id, reshapes)`` of every session held of a job (its re-registrations with
        another shape)."""
        with self._lock:
            sessions = list(self._sessions.items())
        return [(name, job, s.shapes.reshapes) for (job, name), s in sessions if job]

    # -- inspection ----------------------------------------------------------------------------------
    def _info(self, session: ModelSession, with_samples: bool) -> ModelInfo:
        samples = session.samples
        total_bytes, fingerprint = self._facts.of(session.registration)
        return ModelInfo(registration=session.registration, total_bytes=total_bytes, fingerprint=fingerprint,
                         current=session.current_plan,
                         completed=session.completed, best=session.best,
                         samples=tuple(samples) if with_samples else (), sample_count=len(samples),
                         reports_accepted=session.reports_accepted, reports_ignored=session.reports_ignored,
                         idle_s=max(0.0, self._clock() - session.last_used), tuner=session.tuner_kind,
                         layouts_tracked=session.layouts_tracked, selection=session.selection,
                         shapes=session.shapes)

    def list_models(self) -> list[ModelInfo]:
        """Every session held now, sorted by model name, then job id."""
        with self._lock:
            sessions = sorted(self._sessions.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        return [self._info(s, with_samples=False) for _, s in sessions]

    def describe(self, model_name: str, job_id: str = "") -> ModelInfo:
        """One session's state with its samples (see :meth:`find_session` for an empty ``job_id``)."""
        return self._info(self.find_session(model_name, job_id), with_samples=True)
