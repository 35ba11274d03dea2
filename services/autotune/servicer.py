"""The gRPC adapter: translates between protos and :class:`AutotuneService` calls, and nothing else.

Errors leave in one place, :func:`_abort`: each :mod:`.errors` category maps to
one status code; anything unexpected is logged and becomes INTERNAL, and the
server keeps serving.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from ...proto.autotune.v1 import autotune_pb2 as pb
from ...proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from ...proto.plan import BucketPlan, BucketTimingRecord, plan_from_proto, plan_to_proto
from . import wire
from .choice import AlgorithmChoice
from .errors import (
    AutotuneRequestError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from .metrics import RpcMetrics
from .persistence import StoredPlan, parse_plan_key
from .reports import PlanRef, Spread
from .service import AutotuneService, ModelInfo, Span

logger = logging.getLogger(__name__)

_MAX_ENCODED = 1024  # encoded plans kept
_MAX_ENCODED_TENSORS = 2_000_000  # tensors in all encoded plans kept (one tensor: ~50-1000 bytes)
_MAX_ENCODED_PER_MODEL = 4  # the current, the best and the plans reports still name
_ENTRY_BYTES = 256  # an entry's tuple, key, digest and bytes object headers

_STATUS: tuple[tuple[type[AutotuneRequestError], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)

F = TypeVar("F", bound=Callable[..., Any])


def _code_of(exc: Exception) -> grpc.StatusCode:
    for category, code in _STATUS:
        if isinstance(exc, category):
            return code
    return grpc.StatusCode.INTERNAL


def _status(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a handler's exception leaves as (logged here)."""
    code = _code_of(exc)
    if code is not grpc.StatusCode.INTERNAL:
        logger.info("event=request_refused method=%s code=%s message=%r", method, code.name, str(exc)[:500])
        return code, str(exc)
    logger.exception("event=internal_error method=%s", method, exc_info=exc)
    return code, f"{method} failed: {type(exc).__name__}: {exc}"


def _translate_errors(method: F) -> F:
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: AutotuneServicer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            return method(self, request, context)
        except Exception as exc:
            status, message = _status(name, exc)
            code = status.name
        finally:
            if self.metrics is not None:
                self.metrics.observe(name, code, time.perf_counter() - start)
        context.abort(status, message)  # raises (the one place errors leave)
    return wrapper  # type: ignore[return-value]


def _tensor_count(plan: BucketPlan) -> int:
    return sum(len(b) for b in plan.buckets)


def _entry_bytes(entry: tuple[BucketPlan, bytes, bytes]) -> int:
    """Bytes one cached encoding holds (the plan itself is the session's, counted there)."""
    return _ENTRY_BYTES + len(entry[1])


def _digest(message: Any) -> bytes:
    return _digest_of(message.SerializeToString(deterministic=True))


def _digest_of(encoded: bytes) -> bytes:
    return hashlib.blake2b(encoded, digest_size=16).digest()


class _RegistrationFacts:
    """Sums over every tensor of a registration (total bytes, fingerprint), computed once per registration:
    for 100,000 tensors each costs tens of milliseconds of GIL-holding work per ListModels/DescribeModel."""

    def __init__(self, capacity: int = 4096) -> None:
        self._facts: OrderedDict[int, tuple[Any, int, str]] = OrderedDict()  # id(registration) -> (it, facts)
        self._capacity = capacity
        self._lock = threading.Lock()

    def of(self, reg: Any) -> tuple[int, str]:
        hit = self._facts.get(id(reg))
        if hit is not None and hit[0] is reg:
            return hit[1], hit[2]
        total, fingerprint = sum(t.nbytes for t in reg.tensors), reg.fingerprint
        with self._lock:
            self._facts[id(reg)] = (reg, total, fingerprint)  # the registration is kept: its id stays its own
            while len(self._facts) > self._capacity:
                self._facts.popitem(last=False)
        return total, fingerprint


def _summary(info: ModelInfo, facts: _RegistrationFacts) -> Any:
    reg = info.registration
    total_bytes, fingerprint = facts.of(reg)
    return pb.ModelSummary(
        model_name=reg.model_name, tensors=len(reg.tensors), total_bytes=total_bytes,
        world_size=reg.world_size, nproc_per_node=reg.nproc_per_node, plan_version=info.current.version,
        completed=info.completed, samples=info.sample_count, reports_accepted=info.reports_accepted,
        reports_ignored=info.reports_ignored, best_score=info.best.score if info.best else 0.0,
        has_best=info.best is not None, idle_s=info.idle_s, tuner=info.tuner, layouts_tracked=info.layouts_tracked,
        job_id=reg.job_id, fingerprint=fingerprint,
        algorithm=info.selection.chosen if info.selection and info.selection.job_id == reg.job_id else "")


def _selection(choice: AlgorithmChoice) -> Any:
    return pb.AlgorithmSelection(
        chosen=choice.chosen, reason=choice.reason, step=choice.step, job_id=choice.job_id,
        candidates=[pb.AlgorithmCandidate(algorithm=n, step_ms=ms) for n, ms in choice.step_ms])


def _shared(key: str, stored: StoredPlan) -> Any:
    _, world, per_node = parse_plan_key(key)
    return pb.SharedPlanSummary(key=key, model_name=stored.model_name, job_id=stored.job_id, world_size=world,
                                nproc_per_node=per_node, score=stored.score, completed=stored.completed,
                                buckets=len(stored.plan.buckets), saved_at=stored.saved_at, reports=stored.reports,
                                samples=stored.samples)


class AutotuneServicer(pb_grpc.AutotuneServiceServicer):
    """``bagua_lightning.autotune.v1.AutotuneService`` over an :class:`AutotuneService`.

    The methods carrying a plan return encoded bytes, not messages: register it with
    :func:`.wire.add_to_server`, not the generated ``add_AutotuneServiceServicer_to_server``.

    Args:
        service: the logic.
        metrics: counts every call by method and status code (None: not counted).
    """

    def __init__(self, service: AutotuneService, metrics: RpcMetrics | None = None) -> None:
        self.service = service
        self.metrics = metrics
        # Encoding a plan of many tensors costs far more than the rest of a call: encode each issued plan
        # once, with the digest of its full layout. Keyed by (job, model, version); the plan object is kept to
        # check the entry is still that plan. Bounded: the least recently used entries go first.
        # Responses carrying the plan are assembled from its encoded bytes (:mod:`.wire`): encoding a plan
        # of many tensors holds the GIL for milliseconds, which every other request would wait for.
        self._encoded: OrderedDict[tuple[str, str, int], tuple[BucketPlan, bytes, bytes]] = OrderedDict()
        self._encoded_lock = threading.Lock()
        self._encoded_tensors = 0
        self._model_bytes: dict[tuple[str, str], int] = {}  # cached bytes per (job, model)
        self._dropped: list[tuple[str, str]] = []  # evicted models whose encodings are still cached
        service.on_evict(self._evicted)
        self._facts = _RegistrationFacts()

    def _entry(self, job_id: str, model_name: str, plan: BucketPlan) -> tuple[BucketPlan, bytes, bytes]:
        """(plan, its encoded Hyperparameters, their digest), cached.

        Each model's cached bytes count in its session's footprint (the service's --max-memory budget,
        :meth:`AutotuneService.account_cached`): caching may evict other models, and an evicted model's
        encodings are dropped here (the service tells :meth:`_evicted`).
        """
        key = (job_id, model_name, plan.version)
        cached = self._encoded.get(key)
        if cached is not None and cached[0] is plan:
            return cached
        encoded = plan_to_proto(plan).SerializeToString(deterministic=True)
        entry = (plan, encoded, _digest_of(encoded))
        model = (job_id, model_name)
        with self._encoded_lock:
            self._drop(key)
            self._encoded[key] = entry
            self._encoded_tensors += _tensor_count(plan)
            self._model_bytes[model] = self._model_bytes.get(model, 0) + _entry_bytes(entry)
            changed = {model}
            mine = [k for k in self._encoded if k[:2] == model]
            for k in mine[:max(0, len(mine) - _MAX_ENCODED_PER_MODEL)]:  # its least recently used
                self._drop(k)
            while len(self._encoded) > 1 and (len(self._encoded) > _MAX_ENCODED
                                              or self._encoded_tensors > _MAX_ENCODED_TENSORS):
                changed.add(next(iter(self._encoded))[:2])
                self._drop(next(iter(self._encoded)))
            # Under this lock, so counts reach the service in the order they were made (the service's
            # eviction callback never waits for this lock: no deadlock the other way round).
            for job, name in changed:
                if not self.service.account_cached(job, name, self._model_bytes.get((job, name), 0)):
                    self._dropped.append((job, name))  # not held (evicted meanwhile): keep nothing of it
            self._drop_evicted()
        return entry

    def _drop_evicted(self) -> None:
        """Lock held: drop the encodings of the models the service evicted."""
        while self._dropped:
            evicted = self._dropped.pop()
            for k in [k for k in self._encoded if k[:2] == evicted]:
                self._drop(k)

    def _drop(self, key: tuple[str, str, int]) -> None:
        """Lock held: forget one cached encoding."""
        old = self._encoded.pop(key, None)
        if old is None:
            return
        self._encoded_tensors -= _tensor_count(old[0])
        model = key[:2]
        left = self._model_bytes.get(model, 0) - _entry_bytes(old)
        if left > 0:
            self._model_bytes[model] = left
        else:
            self._model_bytes.pop(model, None)

    def _evicted(self, model: tuple[str, str]) -> None:
        """The service evicted ``model`` (its table lock held): drop its encodings now, or, while another
        thread (or this one, in :meth:`_entry`) holds the cache's lock, when that one is done with it."""
        self._dropped.append(model)
        if self._encoded_lock.acquire(blocking=False):  # never wait: the service's lock is held
            try:
                self._drop_evicted()
            finally:
                self._encoded_lock.release()

    def cached_bytes(self) -> int:
        """Bytes of every encoded plan cached now (as counted in the memory budget)."""
        with self._encoded_lock:
            return sum(self._model_bytes.values())

    def _ask_response(self, job_id: str, model_name: str, plan: BucketPlan, completed: bool) -> bytes:
        """The encoded ``AskHyperparametersResponse`` carrying ``plan`` (see :mod:`.wire`)."""
        encoded = self._entry(job_id, model_name, plan)[1]
        return wire.ask_response(encoded, completed)

    def _plan_ref(self, job_id: str, model_name: str, message: Any) -> PlanRef | None:
        if not message.buckets:
            return None
        digest = _digest(message)
        return PlanRef(version=int(message.plan_version),
                       matches=lambda issued: self._entry(job_id, model_name, issued)[2] == digest,
                       decode=lambda: plan_from_proto(message))

    @_translate_errors
    def RegisterTensors(self, request: Any, context: grpc.ServicerContext) -> Any:
        resume = None
        if request.HasField("resume_hyperparameters") and request.resume_hyperparameters.buckets:
            try:
                resume = plan_from_proto(request.resume_hyperparameters)
            except (ValueError, TypeError) as exc:
                raise InvalidArgumentError(f"resume_hyperparameters is not a valid plan: {exc}") from exc
        session = self.service.register_session(
            request.model_name,
            [(t.name, int(t.num_elements), t.dtype) for t in request.tensor_list],
            bool(request.whether_to_bucket),
            world_size=int(request.world_size),
            nproc_per_node=int(request.nproc_per_node),
            job_id=request.job_id,
            resume=resume,
            resume_completed=bool(request.resume_completed),
        )
        plan, completed, selection = session.current_plan, session.completed, session.selection
        encoded = self._entry(request.job_id, request.model_name, plan)[1]
        return wire.register_response(encoded, completed,
                                      _selection(selection).SerializeToString() if selection is not None else None)

    @_translate_errors
    def ReportMetrics(self, request: Any, context: grpc.ServicerContext) -> Any:
        timings = [BucketTimingRecord(bucket_index=int(t.bucket_index), bytes=int(t.bytes), ready_ms=t.ready_ms,
                                      comm_ms=t.comm_ms, wait_ms=t.wait_ms, comm_ms_max=t.comm_ms_max,
                                      wait_ms_max=t.wait_ms_max) for t in request.bucket_timings]
        spread = Spread(ranks=int(request.ranks) or 1, speed_min=request.speed_min, speed_max=request.speed_max,
                        speed_stddev=request.speed_stddev)
        ref = self._plan_ref(request.job_id, request.model_name, request.hyperparameters) \
            if request.HasField("hyperparameters") else None
        accepted = self.service.report(request.model_name, int(request.rank), int(request.train_iter), ref,
                                       float(request.speed), timings, float(request.backward_ms), spread,
                                       job_id=request.job_id)
        return pb.ReportMetricsResponse(accepted=accepted)

    @_translate_errors
    def AskHyperparameters(self, request: Any, context: grpc.ServicerContext) -> Any:
        plan, completed = self.service.ask(request.model_name, int(request.rank), int(request.train_iter),
                                           job_id=request.job_id)
        return self._ask_response(request.job_id, request.model_name, plan, completed)

    @_translate_errors
    def ReportTensorExecutionOrder(self, request: Any, context: grpc.ServicerContext) -> Any:
        spans = [Span(trace_id=int(s.trace_id), action=s.action, tensor_name=s.tensor_name,
                      start_time=int(s.start_time), end_time=int(s.end_time)) for s in request.spans]
        self.service.report_execution_order(spans, request.model_name, job_id=request.job_id)
        return pb.ReportTensorExecutionOrderResponse()

    @_translate_errors
    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ListModelsResponse(models=[_summary(info, self._facts) for info in self.service.list_models()],
                                     shared_plans=[_shared(k, p) for k, p in
                                                   self.service.shared_plans(from_store=True)])

    @_translate_errors
    def DescribeModel(self, request: Any, context: grpc.ServicerContext) -> Any:
        info = self.service.describe(request.model_name, request.job_id)
        reply = pb.DescribeModelResponse(summary=_summary(info, self._facts))
        if info.selection is not None:
            reply.algorithm_selection.CopyFrom(_selection(info.selection))
        reply.samples.extend(
            pb.SampleRecord(index=i + 1, plan_version=s.plan.version, bucket_size=s.plan.bucket_size,
                            is_hierarchical_reduce=s.plan.is_hierarchical_reduce, bucket_bytes=s.plan.bucket_bytes,
                            speed=s.speed, score=s.score, exposed_ms=s.exposed_ms, reports=s.reports,
                            train_iter=s.train_iter)
            for i, s in enumerate(info.samples))
        job = info.registration.job_id
        best = self._entry(job, request.model_name, info.best.plan)[1] if info.best is not None else None
        return wire.describe_response(reply, self._entry(job, request.model_name, info.current)[1], best)

    @_translate_errors
    def ReportAlgorithmSelection(self, request: Any, context: grpc.ServicerContext) -> Any:
        s = request.selection
        self.service.report_selection(request.model_name, request.job_id, s.chosen,
                                      [(c.algorithm, c.step_ms) for c in s.candidates], s.reason, int(s.step))
        return pb.ReportAlgorithmSelectionResponse()

    @_translate_errors
    def ForgetPlans(self, request: Any, context: grpc.ServicerContext) -> Any:
        removed, warning = self.service.forget(request.match)
        return pb.ForgetPlansResponse(removed=[_shared(k, p) for k, p in removed], warning=warning)
