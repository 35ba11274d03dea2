"""The background worker: every call to the autotune service happens here, off the training loop.

One thread per rank that talks to the service (rank 0 only with aggregated
reports). It reports a measurement, then (rank 0) registers, sends the
gradient-ready order once and asks for the plan; the answer waits in
:attr:`AutotuneWorker.pending` for the next step boundary. Failures never reach
training: the current plan stays, one warning per outage (:class:`Outage`), and a
service that no longer holds the model (:class:`ModelNotRegisteredError`) gets
the model registered again. Every call names the job (:attr:`Job.job_id`): the
service keeps one tuning session per job and model.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ...core.errors import AutotuneError, ModelNotRegisteredError, ServiceUnavailableError
from ...proto.plan import BucketPlan, TensorDeclaration
from .measurement import Measurement
from .selection import Selection

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    """A plan the service handed back, waiting for the next step boundary."""

    plan: BucketPlan
    completed: bool


class Outage:
    """One warning per outage (from rank 0; other ranks log it at INFO), one INFO line when it ends."""

    def __init__(self, address: str, *, loud: bool) -> None:
        self.address = address
        self.level = logging.WARNING if loud else logging.INFO
        self.down = False

    def failed(self, what: str, exc: BaseException) -> None:
        if not self.down:
            self.down = True
            log.log(self.level, "autotune: %s failed (%s: %s); the current bucket plan stays, retrying at later "
                    "step boundaries", what, type(exc).__name__, exc)

    def ok(self) -> None:
        if self.down:
            self.down = False
            log.info("autotune: the service at %s answers again", self.address)


@dataclass(frozen=True, slots=True)
class Job:
    """What the worker needs to know about the job (fixed for a fit).

    ``resume``/``resume_completed``: the plan a resumed job runs (from its checkpoint), sent
    with the registration so that a session the service creates starts from it.
    ``selection``: what ``algorithm="auto"`` kept, reported after every registration (`autotune show`).
    """

    address: str
    model_name: str
    tensors: Sequence[TensorDeclaration]
    rank: int
    world_size: int
    nproc_per_node: int
    job_id: str = ""
    resume: BucketPlan | None = None
    resume_completed: bool = False
    selection: Selection | None = None


class AutotuneWorker:
    """Runs service calls on one background thread; the controller reads :meth:`take` at boundaries.

    Args:
        job: model, rank and placement.
        client_factory: builds an ``AutotuneClient`` (called again after an outage: a fresh
            channel connects at once where an old one may wait out gRPC's reconnect backoff).
    """

    def __init__(self, job: Job, client_factory: Callable[[], Any]) -> None:
        self.job = job
        self._factory = client_factory
        self._client: Any = client_factory()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagua-autotune")
        self._future: Future[None] | None = None
        self._lock = threading.Lock()
        self._pending: Pending | None = None
        self.registered = False
        self._order: list[str] = []
        self._order_sent = False
        self._selection_sent = False
        #: What algorithm="auto" measured for this model and placement, as the service answered the registration.
        self.earlier_selection: Selection | None = None
        self._reconnect = False
        self._unexpected: set[str] = set()
        # Only the first registration resumes: after a service restart the shape's best plan is the start.
        self._resume = job.resume
        self.outage = Outage(job.address, loud=job.rank == 0)
        self.closed = False
        #: False: this worker calls nothing (a node that is not the job's leader under ElasticTraining).
        self.active = True

    @property
    def is_main(self) -> bool:
        return self.job.rank == 0

    @property
    def client(self) -> Any:
        return self._client

    def take(self) -> Pending | None:
        """The plan waiting to be applied (None when none); clears it."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending

    def set_ready_order(self, names: Sequence[str]) -> None:
        """Rank 0: the gradient-ready order to send once (first ready first)."""
        self._order = list(names)

    def register_now(self) -> None:
        """Rank 0, at set-up: register on the calling thread (the caller waits for the initial plan)."""
        self._register(self._client)

    def submit(self, train_iter: int, plan: BucketPlan | None, measurement: Measurement | None) -> None:
        """Queue a report of ``measurement`` on ``plan`` (None: nothing to report), then (rank 0) an ask.

        Skipped when the previous call is still running: a slow service costs intervals, never steps.
        """
        if not self.active or self._pool is None or (self._future is not None and not self._future.done()):
            return
        self._future = self._pool.submit(self._work, train_iter, plan, measurement)

    def reshape(self, *, world_size: int, nproc_per_node: int, job_id: str, active: bool) -> None:
        """The job's nodes changed: it now runs ``world_size`` ranks, ``nproc_per_node`` per node.

        An ``active`` worker registers the new shape at once, on its thread (the service starts the shape
        from the plan jobs share for it, else the default plan; the answer waits in :meth:`take`); an
        inactive one calls nothing. An answer for the old shape still waiting is dropped.
        """
        with self._lock:
            self.job = dataclasses.replace(self.job, world_size=world_size, nproc_per_node=nproc_per_node,
                                           job_id=job_id)
            self._pending = None
            self.registered = False
            self._order_sent = False
            self._selection_sent = False
            self.active = active
        if active and self._pool is not None:
            # Queued even behind a call in flight: the registration must not wait for the next boundary.
            self._future = self._pool.submit(self._work, 0, None, None)

    def _work(self, train_iter: int, plan: BucketPlan | None, m: Measurement | None) -> None:
        client = self._current_client()
        if client is None or not self.active:
            return
        job = self.job
        try:
            if plan is not None and m is not None and m.speed is not None:
                client.report_metrics(job.model_name, job.rank, train_iter, plan, m.speed, m.timings,
                                      backward_ms=m.backward_ms, ranks=m.ranks if m.ranks > 1 else 0,
                                      speed_min=m.speed_min, speed_max=m.speed_max, speed_stddev=m.speed_stddev,
                                      job_id=job.job_id)
            if self.is_main:
                if not self.registered:
                    self._register(client)
                    return
                if not self._selection_sent:
                    self._send_selection(client)
                if self._order and not self._order_sent:
                    spans = [{"trace_id": 1, "action": "tensor_ready", "tensor_name": name, "start_time": i,
                              "end_time": i} for i, name in enumerate(self._order)]
                    client.report_tensor_execution_order(spans, model_name=job.model_name, job_id=job.job_id)
                    self._order_sent = True
                answer = client.ask_hyperparameters(job.model_name, 0, train_iter, job_id=job.job_id)
                with self._lock:
                    if self.job is job:  # not an answer for a shape the job has left
                        self._pending = Pending(answer.plan, answer.completed)
            self.outage.ok()
        except ModelNotRegisteredError as exc:
            # The service restarted without the model, or evicted it: register again at the next boundary.
            self.registered = False
            self._order_sent = False
            self._selection_sent = False
            self.outage.failed(f"autotune call to {job.address}", exc)
        except ServiceUnavailableError as exc:
            self._reconnect = True
            self.outage.failed(f"autotune call to {job.address}", exc)
        except (AutotuneError, ValueError) as exc:  # refused, or a malformed plan from the service
            self.outage.failed(f"autotune call to {job.address}", exc)
        except Exception as exc:  # a bug here must not stop training; say so loudly, once per kind
            if repr(exc) not in self._unexpected:
                self._unexpected.add(repr(exc))
                log.exception("autotune: unexpected error in the background worker; the current plan stays")

    def _current_client(self) -> Any:
        with self._lock:
            if self.closed:
                return None
            if self._reconnect and self._client is not None:
                self._client.close()
                self._client = self._factory()
                self._reconnect = False
            return self._client

    def _register(self, client: Any) -> None:
        job = self.job
        try:
            answer = client.register_job(job.model_name, job.tensors, job_id=job.job_id, world_size=job.world_size,
                                         nproc_per_node=job.nproc_per_node, resume=self._resume,
                                         resume_completed=job.resume_completed)
        except (AutotuneError, ServiceUnavailableError) as exc:
            self._reconnect = isinstance(exc, ServiceUnavailableError)
            self.outage.failed(f"registering model {job.model_name!r} with {job.address}", exc)
            return
        plan = answer.plan
        self._resume = None
        earlier = getattr(answer, "selection", None)
        if earlier is not None:
            self.earlier_selection = Selection(step_ms=dict(earlier.step_ms), chosen=earlier.chosen,
                                               decided_at=earlier.step, job_id=earlier.job_id)
        with self._lock:
            if self.job is not job:  # the job changed shape meanwhile: that shape registers next
                return
            self._pending = Pending(plan, answer.completed)
            self.registered = True
        self.outage.ok()
        log.info("autotune: registered %s (job %s, %d tensors) with %s; initial plan v%d, %d buckets%s",
                 job.model_name, job.job_id, len(job.tensors), job.address, plan.version, len(plan.buckets),
                 " (final)" if answer.completed else "")
        self._selection_sent = False
        try:
            self._send_selection(client)
        except (AutotuneError, ServiceUnavailableError) as exc:  # sent again at the next boundary
            self.outage.failed(f"reporting the algorithm selection to {job.address}", exc)

    def _send_selection(self, client: Any) -> None:
        """Rank 0: tell the service what ``algorithm="auto"`` kept (nothing for a fixed algorithm)."""
        selection, job = self.job.selection, self.job
        if selection is not None and selection.chosen is not None and selection.decided_at is not None:
            client.report_algorithm_selection(job.model_name, selection.chosen, selection.step_ms,
                                              selection.reason(), selection.decided_at, job_id=job.job_id)
        self._selection_sent = True

    def close(self) -> None:
        """Stop (an RPC in flight is cancelled by closing the channel); idempotent."""
        pool, self._pool = self._pool, None
        with self._lock:
            self.closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
