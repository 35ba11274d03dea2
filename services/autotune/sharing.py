"""What jobs share: the best plan per model shape, a starting point for later jobs, never a verdict.

Scores of different jobs are not comparable (other batch sizes, GPUs, links), so the service never
ranks one job's numbers against another's:

* **Replacement.** A plan a job *completed* with replaces the shape's shared plan (the latest
  verdict, reached from that job's own measurements); a plan a job is still tuning replaces only a
  shared plan that is not completed either (:func:`replaces`).
* **Outliers.** A job's measured plan whose rate is more than :data:`OUTLIER_FACTOR` times above
  (or below) the median of the job's other measured plans is kept out of the shared best
  (:func:`outlier`). The job itself still uses it: its own numbers decide its own plans.
* **Starting.** A new job starts on the shared plan, but never inherits ``completed``: the session
  confirms the plan against its own default plan first (:mod:`.session`).

:class:`SharedPlans` is the table (in memory, bounded, backed by the store through :class:`.StoreIO`).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
from collections import OrderedDict
from collections.abc import Sequence

from .choice import AlgorithmChoice
from .costmodel import Sample
from .errors import InvalidArgumentError, NotFoundError
from .persistence import StoredPlan
from .storeio import StoreIO

logger = logging.getLogger(__name__)

#: A measured plan this many times faster or slower than the median of the job's other measured plans
#: is an outlier. Bucket plans of one model in one job change its speed by tens of percent, a
#: factor of two in extreme cases (a link-bound job); a factor of ten is a broken or forged number.
OUTLIER_FACTOR = 10.0
MAX_SHARED_PLANS = 4096  # best plans per shape held in memory (least recently used dropped; the store keeps all)
MAX_LISTED = 4096  # stored plans a listing (or a forget) reads from the store


def rate(sample: Sample) -> tuple[str, float] | None:
    """A positive, higher-is-better number for comparing a job's samples, with its unit; None when
    the sample carries neither a speed nor a step time."""
    if sample.speed > 0:
        return "samples/s", sample.speed
    step_ms = sample.backward_ms + sample.exposed_ms
    return ("steps/ms", 1.0 / step_ms) if step_ms > 0 else None


def outlier(sample: Sample, history: Sequence[Sample]) -> bool:
    """Whether ``sample`` lies more than :data:`OUTLIER_FACTOR` times above or below the median (the
    lower middle one: a measured value) of the job's samples of its *other* plans of the same unit;
    never for a job's first measured plan (nothing to compare with). Samples of the same plan (its
    layout and bucket size: a plan measured again, or the job's final verdict on it) are not others,
    so an outlier cannot vouch for itself."""
    mine = rate(sample)
    if mine is None:
        return False
    plan = sample.plan
    others = [r[1] for s in history
              if s is not sample and not (s.plan.same_layout(plan) and s.plan.bucket_size == plan.bucket_size)
              and (r := rate(s)) is not None and r[0] == mine[0]]
    if not others:
        return False
    median = statistics.median_low(others)
    return not median / OUTLIER_FACTOR <= mine[1] <= median * OUTLIER_FACTOR


def replaces(new: StoredPlan, known: StoredPlan | None) -> bool:
    """Whether ``new`` should become the shared plan of its shape instead of ``known`` (no scores
    compared: they come from different jobs)."""
    return known is None or new.completed or not known.completed


def matches(key: str, stored: StoredPlan, what: str) -> bool:
    """Whether ``what`` names the shape key, the model or the job of a shared plan."""
    return what in (key, stored.model_name, stored.job_id)


class SharedPlans:
    """The best plan per store key, from sessions' saves and store loads; safe to call from many threads.

    Its lock is taken inside a session's lock (a session saves under it) and never the other way round;
    store I/O runs outside it.
    """

    def __init__(self, io: StoreIO) -> None:
        self.io = io
        self._plans: OrderedDict[str, StoredPlan] = OrderedDict()
        self._lock = threading.Lock()

    def _remember(self, key: str, stored: StoredPlan, *, force: bool = False) -> bool:
        """Keep ``stored`` for ``key`` when :func:`replaces` says so (or ``force``); whether it did."""
        with self._lock:
            if not force and not replaces(stored, self._plans.get(key)):
                return False
            self._plans[key] = stored
            self._plans.move_to_end(key)
            while len(self._plans) > MAX_SHARED_PLANS:
                self._plans.popitem(last=False)
            return True

    def save(self, key: str, stored: StoredPlan) -> None:
        """A session's new best (queued to the store only when it replaces the shared one)."""
        if self._remember(key, stored):
            self.io.save(key, stored)
            logger.info("event=shared_plan_saved key=%s model=%s job=%s completed=%s score=%.4g reports=%d",
                        key, stored.model_name, stored.job_id, stored.completed, stored.score, stored.reports)

    def best(self, key: str) -> StoredPlan | None:
        """The shared plan of ``key``: this service's (newer than the store's queued writes), else the
        store's, read with no lock held."""
        with self._lock:
            known = self._plans.get(key)
        if known is not None:
            return known
        stored = self.io.load(key)
        if stored is not None and not self._remember(key, stored):
            with self._lock:  # a session saved one meanwhile: that one is newer
                return self._plans.get(key, stored)
        return stored

    def with_selection(self, key: str, choice: AlgorithmChoice) -> None:
        """Store ``choice`` with the shared plan of ``key`` (when there is one)."""
        with self._lock:
            known = self._plans.get(key)
            stored = dataclasses.replace(known, selection=choice) if known is not None else None
            if stored is not None:
                self._plans[key] = stored
        if stored is not None:
            self.io.save(key, stored)

    def listed(self, *, from_store: bool = False) -> list[tuple[str, StoredPlan]]:
        """The shared plan per key, sorted by key: those in memory, and with ``from_store`` also those
        only in the store (up to :data:`MAX_LISTED`; a failing store lists what is in memory)."""
        if from_store:
            try:
                keys = self.io.keys(MAX_LISTED)
            except Exception:  # counted and logged by StoreIO
                keys = []
            with self._lock:
                missing = [k for k in keys if k not in self._plans]
            for key in missing:
                self.best(key)
        with self._lock:
            return sorted(self._plans.items(), key=lambda kv: kv[0])

    def forget(self, what: str, *, timeout_s: float = 5.0) -> tuple[list[tuple[str, StoredPlan]], str]:
        """Remove every shared plan whose shape key, model name or job id is ``what``, in memory and in
        the store; returns them (sorted by key) and a warning ("" when the store took the removals).

        NotFoundError when none matches. A job still tuning that shape saves again at its next best.
        """
        if not what:
            raise InvalidArgumentError("the plan to forget is empty; give a model name, a shape key or a job id "
                                       "(see `autotune ls`)")
        gone = [(k, p) for k, p in self.listed(from_store=True) if matches(k, p, what)]
        if not gone:
            raise NotFoundError(f"no shared plan has the model name, shape key or job id {what!r:.200}; "
                                "see `bagua-lightning autotune ls`")
        with self._lock:
            for key, _ in gone:
                self._plans.pop(key, None)
        for key, stored in gone:
            self.io.delete(key)
            logger.info("event=shared_plan_forgotten key=%s model=%s job=%s", key, stored.model_name, stored.job_id)
        warning = ""
        if self.io.store is not None and (not self.io.flush(timeout_s) or self.io.store_failing):
            warning = (f"the plan store {self.io.store!r} is failing: the plans are gone from the service, "
                       "but the store may still hold them; run forget again once it is back")
        return gone, warning
