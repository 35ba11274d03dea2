"""One model's tuning session: registration, reports, one plan per train_iter, completion.

Every method holds the session's lock, so ranks of one model are serialised
while different models proceed concurrently. The protocol:

* ``ReportMetrics`` adds to the statistics of the plan that was measured
  (identified by its layout); duplicates of a (rank, train_iter) are ignored.
* ``AskHyperparameters(train_iter)`` decides the plan for that iteration once
  and caches it, so every rank asking for the same iteration gets the identical
  plan. An iteration asked for the first time may get a new plan, once the
  current plan has been held ``sampling_confidence_time_s``, the warm-up is
  over, and at least one report measured it; the measured sample goes to the
  tuner (in the request, or in a worker process whose proposal a later ask
  hands back).
* After ``max_samples`` measured plans (or when the planner converged), the best
  measured plan is handed back for good and persisted.
* A session that starts from another job's shared plan never inherits ``completed``:
  its first measured plan is that one, its second its own default plan; only when the
  shared plan was final and the job's own numbers rank it at least as high as the default
  does the session complete on it, otherwise it tunes on (:mod:`.sharing`).

Every collection here is bounded (layouts, issued plans, decisions, remembered
iterations); numbers were range-checked on entry (:mod:`.reports`).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ...proto.plan import (
    BucketPlan,
    BucketTimingRecord,
    TensorDeclaration,
    split_into_buckets,
)
from .choice import AlgorithmChoice
from .config import ServiceConfig
from .costmodel import Sample
from .errors import InvalidArgumentError
from .persistence import StoredPlan
from .proposal import Proposal, Tuner
from .registration import Registration, canonical_plan, layout_key
from .reports import MAX_TRAIN_ITER, LayoutStats, PlanRef, SeenIters, Spread, check_measurement
from .samplelog import sample_record
from .shapes import ShapeHistory
from .sharing import outlier
from .tuners import make_tuner

logger = logging.getLogger(__name__)

_MAX_DECISIONS = 4096  # cached train_iter -> plan decisions before the oldest are dropped


class ModelSession:
    """The tuning state of one model (see the module docstring for the protocol).

    Args:
        registration: what the model declared.
        config: limits and how to tune.
        remembered: the plan to start from (the best remembered for the model's shape, loaded by
            the caller outside every lock, or the plan a resumed job runs), or None: the default plan.
        own: whether ``remembered`` is this job's own plan (a resumed job's, or one it stored itself):
            then its ``completed`` holds; another job's plan is confirmed first (module docstring).
        first_version: the initial plan's version; later plans count on from it (a job that
            re-registers or resumes keeps its versions increasing).
        persist: takes ``(store key, plan)`` to save; it must only queue the write (the
            session calls it under its lock; the store is written by the service's writer
            thread, never under a lock). None: nothing persists.
        sample_log: takes ``(model name, record)`` for every measured plan; queues it likewise.
        propose_async: runs ``tuner.propose(history)`` elsewhere (another process) and returns its
            future; the session then keeps the current plan until the proposal is there, so no
            request waits for a tuner. None: proposals run in the request that takes the sample.
        clock: monotonic clock in seconds.
    """

    def __init__(self, registration: Registration, config: ServiceConfig, *, remembered: StoredPlan | None = None,
                 own: bool = False, first_version: int = 0, persist: Callable[[str, StoredPlan], None] | None = None,
                 sample_log: Callable[[str, dict[str, Any]], None] | None = None,
                 propose_async: Callable[[Tuner, tuple[Sample, ...]], Future[Proposal]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registration = registration
        self._propose_async = propose_async
        self._proposing: tuple[Future[Proposal], Sample, int] | None = None
        self.config = config
        self._persist_fn = persist
        self._sample_log = sample_log
        self._clock = clock
        self._lock = threading.Lock()
        self._names = {t.name: t for t in registration.tensors}
        self.tensor_names = self._names.keys()  # a set view: a frozenset copy would cost ~40 B a tensor
        self._order: tuple[TensorDeclaration, ...] = registration.tensors
        self._order_changed = False
        self._tuner: Tuner | None = None
        self.tuner_kind = ""
        self._history: list[Sample] = []
        # Bounded by config.max_layouts / max_plans / _MAX_DECISIONS, oldest (least recently used) first.
        self._stats: OrderedDict[tuple[str, bool], LayoutStats] = OrderedDict()
        self._seen = SeenIters()
        self._decisions: OrderedDict[int, tuple[BucketPlan, bool]] = OrderedDict()
        self._decided_iters: list[int] = []
        self._issued: OrderedDict[int, BucketPlan] = OrderedDict()
        self._issued_keys: dict[int, tuple[str, bool]] = {}
        self._next_version = first_version + 1
        self._fresh_reports = 0
        self._best: Sample | None = None
        self.completed = config.autotune_level == 0
        self.started_at = clock()
        self.last_used = self.started_at
        self.reports_accepted = 0
        self.reports_ignored = 0
        self.plans_issued = 0
        #: What algorithm="auto" kept (this job's report, else the one stored with the plan it started from).
        self.selection: AlgorithmChoice | None = remembered.selection if remembered is not None else None

        initial = dataclasses.replace(self._default_plan(), version=first_version)
        remembered = self._usable(remembered)
        #: The shared plan this session started from, while its own measurements have not confirmed it
        #: against the default plan (None: nothing to confirm).
        self.confirming: StoredPlan | None = None
        if remembered is not None:
            initial = dataclasses.replace(remembered.plan, version=first_version)
            if own:
                self.completed = self.completed or remembered.completed
            elif not self.completed:
                self.confirming = remembered
            logger.info("event=plan_restored model=%s job=%s key=%s from_job=%s completed=%s score=%.4g buckets=%d",
                        registration.model_name, registration.job_id, registration.store_key, remembered.job_id,
                        remembered.completed, remembered.score, len(initial.buckets))
        #: Whether the initial plan is ``remembered`` (False: the default plan, none given or it did not fit).
        self.started_on_remembered = remembered is not None
        #: The job's shapes up to this session's (the service sets it at registration).
        self.shapes = ShapeHistory()
        self._current = initial
        self._issued[first_version] = initial
        self._issued_at = self.started_at

    # -- persistence -------------------------------------------------------------------------------
    def _usable(self, stored: StoredPlan | None) -> StoredPlan | None:
        if stored is None:
            return None
        try:
            plan = self._canonical(stored.plan)
        except InvalidArgumentError as exc:
            logger.warning("event=plan_mismatch model=%s key=%s; the stored plan does not fit the tensor list "
                           "(%s), ignoring it", self.registration.model_name, self.registration.store_key, exc)
            return None
        return dataclasses.replace(stored, plan=plan)

    def _persist(self, sample: Sample, completed: bool) -> None:
        if self._persist_fn is None:
            return
        reg = self.registration
        if outlier(sample, self._history):  # this job's own plans may use it; no other job's
            logger.warning("event=plan_not_shared model=%s job=%s reason=outlier score=%.4g samples=%d",
                           reg.model_name, reg.job_id, sample.score, len(self._history))
            return
        self._persist_fn(reg.store_key, StoredPlan(
            plan=sample.plan, score=sample.score, completed=completed, model_name=reg.model_name,
            saved_at=time.time(), job_id=reg.job_id, selection=self.selection, reports=sample.reports,
            samples=len(self._history)))

    # -- public API (each takes the lock) ----------------------------------------------------------
    @property
    def current_plan(self) -> BucketPlan:
        with self._lock:
            return self._current

    @property
    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._history)

    @property
    def best(self) -> Sample | None:
        with self._lock:
            return self._best

    @property
    def layouts_tracked(self) -> int:
        """Measured layouts whose statistics this session holds (at most ``config.max_layouts``)."""
        return len(self._stats)

    @property
    def next_version(self) -> int:
        """The version the next new plan would get."""
        with self._lock:
            return self._next_version

    @property
    def plans_remembered(self) -> int:
        """Issued plans this session remembers by version (at most ``config.max_plans``)."""
        return len(self._issued)

    def _check_rank_iter(self, rank: int, train_iter: int) -> None:
        if not 0 <= rank < self.registration.world_size:
            raise InvalidArgumentError(
                f"rank must be in [0, world_size={self.registration.world_size}) for model "
                f"{self.registration.model_name!r}, got {rank}")
        if not 0 <= train_iter <= MAX_TRAIN_ITER:
            raise InvalidArgumentError(f"train_iter must be in [0, 2**62], got {train_iter}")

    def _canonical(self, plan: BucketPlan) -> BucketPlan:
        return canonical_plan(plan, self._names, self.registration.model_name)

    def _resolve_plan(self, ref: PlanRef | None, train_iter: int) -> BucketPlan:
        if ref is None:
            return self._plan_at(train_iter)
        issued = self._issued.get(ref.version)
        if issued is not None and ref.matches(issued):
            return issued
        try:
            plan = ref.decode()
        except (ValueError, TypeError) as exc:
            raise InvalidArgumentError(f"hyperparameters.buckets is not a valid plan: {exc}") from exc
        try:
            return self._canonical(plan)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"hyperparameters.buckets: {exc}") from exc

    def report(self, rank: int, train_iter: int, plan_ref: PlanRef | None, speed: float,
               bucket_timings: Sequence[BucketTimingRecord] = (), backward_ms: float = 0.0,
               spread: Spread = Spread()) -> bool:
        """Record a measurement (one rank's, or the job's when ``spread.ranks > 1``); False for a duplicate."""
        self._check_rank_iter(rank, train_iter)
        if not 0 <= spread.ranks <= self.registration.world_size:
            raise InvalidArgumentError(
                f"ranks must be in [0, world_size={self.registration.world_size}] for model "
                f"{self.registration.model_name!r}, got {spread.ranks}")
        if spread.ranks > 1 and rank != 0:
            raise InvalidArgumentError(f"an aggregated report (ranks={spread.ranks}) comes from rank 0, got "
                                       f"rank {rank}")
        check_measurement(speed, backward_ms, bucket_timings, spread)
        self.last_used = self._clock()
        with self._lock:
            plan = self._resolve_plan(plan_ref, train_iter)
            for i, t in enumerate(bucket_timings):
                if not 0 <= t.bucket_index < len(plan.buckets):
                    raise InvalidArgumentError(
                        f"bucket_timings[{i}].bucket_index must be in [0, {len(plan.buckets)}) for the reported "
                        f"plan, got {t.bucket_index}")
            if not self._seen.add(rank, train_iter):
                self.reports_ignored += 1
                return False
            self.reports_accepted += 1
            if self._clock() - self.started_at < self.config.warmup_time_s:
                return True  # accepted, but start-up speeds are not representative
            key = self._key_of(plan)
            stats = self._stats.get(key)
            if stats is None:
                stats = self._stats[key] = LayoutStats(plan=plan)
                self._trim_stats()
            else:
                self._stats.move_to_end(key)
            stats.add(speed, backward_ms, bucket_timings, train_iter)
            if key == self._key_of(self._current):
                self._fresh_reports += 1
            return True

    def ask(self, rank: int, train_iter: int) -> tuple[BucketPlan, bool]:
        """The plan to use from ``train_iter`` on, identical for every rank; and whether tuning completed.

        Only an iteration asked before is answered from the cache: an iteration never asked for
        is decided now, whatever iterations were decided before, so no train_iter (however large)
        can pin a model to an old plan.
        """
        self._check_rank_iter(rank, train_iter)
        self.last_used = self._clock()
        with self._lock:
            decided = self._decisions.get(train_iter)
            if decided is not None:
                return decided
            self._maybe_advance(train_iter)
            decision = (self._current, self.completed)
            self._decisions[train_iter] = decision
            bisect.insort(self._decided_iters, train_iter)
            if len(self._decisions) > _MAX_DECISIONS:
                for _ in range(_MAX_DECISIONS // 2):
                    self._decisions.popitem(last=False)
                self._decided_iters = sorted(self._decisions)
            return decision

    def set_execution_order(self, names: Sequence[str]) -> None:
        """Tensors first reported ready come first; the rest keep registration order."""
        self.last_used = self._clock()
        with self._lock:
            first = list(dict.fromkeys(names))
            chosen = set(first)
            rest = [t.name for t in self.registration.tensors if t.name not in chosen]
            order = tuple(self._names[n] for n in first + rest)
            if order != self._order:
                self._order = order
                self._order_changed = True
                self._tuner = None  # tuners cut in ready order: rebuild with the new one
                logger.info("event=execution_order model=%s first=%s", self.registration.model_name, first[:3])

    # -- internals (lock held) ---------------------------------------------------------------------
    def _trim_stats(self) -> None:
        current = self._key_of(self._current)
        best = layout_key(self._best.plan) if self._best is not None else None
        while len(self._stats) > self.config.max_layouts:
            for key in self._stats:
                if key not in (current, best):
                    del self._stats[key]
                    break

    def _key_of(self, plan: BucketPlan) -> tuple[str, bool]:
        # Hashing a layout is the costliest part of a report: remember it for the plans issued here.
        if self._issued.get(plan.version) is not plan:
            return layout_key(plan)
        key = self._issued_keys.get(plan.version)
        if key is None:
            key = self._issued_keys[plan.version] = layout_key(plan)
        return key

    def _plan_at(self, train_iter: int) -> BucketPlan:
        index = bisect.bisect_right(self._decided_iters, train_iter) - 1
        if index < 0:
            return next(iter(self._issued.values()))
        return self._decisions[self._decided_iters[index]][0]

    def _issue(self, plan: BucketPlan, reason: str, predicted_ms: float | None = None) -> None:
        current = self._current
        if not (plan.same_layout(current) and plan.bucket_size == current.bucket_size):
            version = self._next_version
            self._next_version += 1
            plan = dataclasses.replace(plan, version=version)
            self._issued[version] = plan
            while len(self._issued) > self.config.max_plans:
                old, _ = self._issued.popitem(last=False)
                self._issued_keys.pop(old, None)
            self._current = plan
            self.plans_issued += 1
            logger.info(
                "event=plan_issued model=%s version=%d reason=%s buckets=%d bucket_size=%d hierarchical=%s%s",
                self.registration.model_name, version, reason, len(plan.buckets), plan.bucket_size,
                plan.is_hierarchical_reduce, "" if predicted_ms is None else f" predicted_ms={predicted_ms:.3f}")
        self._fresh_reports = 0
        self._issued_at = self._clock()

    def _maybe_advance(self, train_iter: int) -> None:
        if self.completed:
            return
        if self._proposing is not None:
            future, sample, sample_iter = self._proposing
            if not future.done():
                return  # the tuner is still thinking: the current plan stays
            self._proposing = None
            try:
                proposal = future.result()
            except Exception as exc:  # a failed worker process must not end tuning: propose here instead
                logger.warning("event=tuner_worker_failed model=%s error=%r; proposing in the request",
                               self.registration.model_name, exc)
                proposal = self._tuner.propose(self._history) if self._tuner else Proposal(plan=self._current)
            self._conclude(sample, sample_iter, proposal)
            return
        # A shared plan being confirmed is measured as its job cut it (in that job's ready order).
        if self._order_changed and self.confirming is None:
            self._order_changed = False
            self._issue(BucketPlan(buckets=split_into_buckets(self._order, self._current.bucket_size,
                                                              whether_to_bucket=self.registration.whether_to_bucket),
                                   bucket_size=self._current.bucket_size,
                                   is_hierarchical_reduce=self._current.is_hierarchical_reduce), "execution-order")
            return
        now = self._clock()
        warm_from = self.started_at + self.config.warmup_time_s
        # A plan's hold counts from its issue or from the end of the warm-up, whichever is later.
        held_s = now - max(self._issued_at, warm_from)
        if self._fresh_reports == 0 or now < warm_from or held_s < self.config.sampling_confidence_time_s:
            return
        stats = self._stats.get(self._key_of(self._current))
        if stats is None:
            return
        sample = stats.sample(self._current)
        self._history.append(sample)
        if self._best is None or sample.score > self._best.score:
            self._best = sample
            self._persist(sample, completed=False)
        if self._tuner is None:
            self._tuner, self.tuner_kind = make_tuner(self.config, self.registration, self._order, sample)
        if self.confirming is not None and self._confirm(sample, train_iter):
            return
        if len(self._history) >= self.config.max_samples:
            self._conclude(sample, train_iter, Proposal(plan=self._current, converged=True, reason="max-samples"))
        elif self._propose_async is not None:
            # Proposals take milliseconds of CPU: another process computes them, and this ask (and every
            # other request) does not wait. The plan for this iteration is the current one.
            self._proposing = (self._propose_async(self._tuner, tuple(self._history)), sample, train_iter)
            self._fresh_reports = 0
        else:
            self._conclude(sample, train_iter, self._tuner.propose(self._history))

    def _default_plan(self) -> BucketPlan:
        return BucketPlan(buckets=split_into_buckets(self._order, self.config.default_bucket_size,
                                                     whether_to_bucket=self.registration.whether_to_bucket),
                          bucket_size=self.config.default_bucket_size)

    def _confirm(self, sample: Sample, train_iter: int) -> bool:
        """Lock held, after each of the first samples of a session that started from another job's plan:
        measure the default plan next, then judge the shared plan by this job's own numbers. True when
        this decided the next plan (the default, or the final one)."""
        shared = self.confirming
        assert shared is not None and self._tuner is not None
        default = self._default_plan()
        measured = [s for s in self._history if s.plan.same_layout(default) and s.plan.bucket_size ==
                    default.bucket_size]
        if not measured and len(self._history) < self.config.max_samples:
            self._log_sample(sample, train_iter, "confirm-default")
            self._issue(default, "confirm-default")
            return True
        self.confirming = None
        first = self._history[0]
        kept = shared.completed and all(first.score >= s.score for s in measured)
        logger.info("event=shared_plan_%s model=%s job=%s from_job=%s score=%.4g default_score=%s",
                    "confirmed" if kept else "not_confirmed", self.registration.model_name,
                    self.registration.job_id, shared.job_id, first.score,
                    f"{measured[0].score:.4g}" if measured else "-")
        if kept and self.config.early_stop:  # final: the job's best of what it measured
            self._conclude(sample, train_iter, Proposal(plan=first.plan, converged=True, reason="confirmed"))
            return True
        return False  # tune on from this job's own history

    def _conclude(self, sample: Sample, train_iter: int, proposal: Proposal) -> None:
        """Lock held: log the sample, then complete (hand back the final plan) or issue the proposal."""
        assert self._tuner is not None
        self._log_sample(sample, train_iter, proposal.reason)
        done = len(self._history) >= self.config.max_samples or (proposal.converged and self.config.early_stop)
        if done:
            final = self._tuner.final(self._history)
            self._best = final
            self.completed = True
            self._issue(final.plan, "best")
            self._persist(dataclasses.replace(final, plan=self._current), completed=True)
            logger.info("event=autotune_completed model=%s samples=%d tuner=%s score=%.4g version=%d",
                        self.registration.model_name, len(self._history), self.tuner_kind, final.score,
                        self._current.version)
        else:
            self._issue(proposal.plan, proposal.reason, proposal.predicted_ms)

    def _log_sample(self, sample: Sample, train_iter: int, next_reason: str) -> None:
        if self._sample_log is not None:
            self._sample_log(self.registration.model_name, sample_record(
                sample, model_name=self.registration.model_name, job_id=self.registration.job_id,
                index=len(self._history), train_iter=train_iter, tuner=self.tuner_kind, next_reason=next_reason))
