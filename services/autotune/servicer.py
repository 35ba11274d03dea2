"""The gRPC adapter: translates between protos and :class:`AutotuneService` calls, and nothing else.

Errors leave in one place, :func:`_abort`: each :mod:`.errors` category maps to
one status code; anything unexpected is logged and becomes INTERNAL, and the
server keeps serving.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from ...proto.autotune.v1 import autotune_pb2 as pb
from ...proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from ...proto.plan import BucketPlan, BucketTimingRecord, plan_from_proto
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
from .plancache import digest_of
from .reports import PlanRef, Spread
from .service import AutotuneService, ModelInfo, Span

logger = logging.getLogger(__name__)

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


def _digest(message: Any) -> bytes:
    return digest_of(message.SerializeToString(deterministic=True))


def _summary(info: ModelInfo) -> Any:
    reg = info.registration
    return pb.ModelSummary(
        model_name=reg.model_name, tensors=len(reg.tensors), total_bytes=info.total_bytes,
        world_size=reg.world_size, nproc_per_node=reg.nproc_per_node, plan_version=info.current.version,
        completed=info.completed, samples=info.sample_count, reports_accepted=info.reports_accepted,
        reports_ignored=info.reports_ignored, best_score=info.best.score if info.best else 0.0,
        has_best=info.best is not None, idle_s=info.idle_s, tuner=info.tuner, layouts_tracked=info.layouts_tracked,
        job_id=reg.job_id, fingerprint=info.fingerprint,
        algorithm=info.selection.chosen if info.selection and info.selection.job_id == reg.job_id else "",
        reshapes=info.shapes.reshapes)


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
        self.plans = service.plans  # each plan encoded once (see :mod:`.plancache`)

    def _ask_response(self, job_id: str, model_name: str, plan: BucketPlan, completed: bool) -> bytes:
        """The encoded ``AskHyperparametersResponse`` carrying ``plan`` (see :mod:`.wire`)."""
        return wire.ask_response(self.plans.encoded(job_id, model_name, plan), completed)

    def _plan_ref(self, job_id: str, model_name: str, message: Any) -> PlanRef | None:
        if not message.buckets:
            return None
        digest = _digest(message)
        return PlanRef(version=int(message.plan_version),
                       matches=lambda issued: self.plans.digest(job_id, model_name, issued) == digest,
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
        encoded = self.plans.encoded(request.job_id, request.model_name, plan)
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
        return pb.ListModelsResponse(models=[_summary(info) for info in self.service.list_models()],
                                     shared_plans=[_shared(k, p) for k, p in
                                                   self.service.shared_plans(from_store=True)])

    @_translate_errors
    def DescribeModel(self, request: Any, context: grpc.ServicerContext) -> Any:
        info = self.service.describe(request.model_name, request.job_id)
        reply = pb.DescribeModelResponse(summary=_summary(info))
        if info.selection is not None:
            reply.algorithm_selection.CopyFrom(_selection(info.selection))
        reply.samples.extend(
            pb.SampleRecord(index=i + 1, plan_version=s.plan.version, bucket_size=s.plan.bucket_size,
                            is_hierarchical_reduce=s.plan.is_hierarchical_reduce, bucket_bytes=s.plan.bucket_bytes,
                            speed=s.speed, score=s.score, exposed_ms=s.exposed_ms, reports=s.reports,
                            train_iter=s.train_iter)
            for i, s in enumerate(info.samples))
        reply.shapes.extend(
            pb.JobShape(world_size=s.world_size, nproc_per_node=s.nproc_per_node, registered_at=s.registered_at,
                        plan_version=s.plan_version, started_from=s.started_from, shared_key=s.shared_key)
            for s in info.shapes.shapes)
        job = info.registration.job_id
        best = self.plans.encoded(job, request.model_name, info.best.plan) if info.best is not None else None
        return wire.describe_response(reply, self.plans.encoded(job, request.model_name, info.current), best)

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
