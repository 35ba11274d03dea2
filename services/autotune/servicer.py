"""The gRPC adapter: translates between protos and :class:`AutotuneService` calls, and nothing else.

Errors leave in one place, :func:`_abort`: each :mod:`.errors` category maps to
one status code; anything unexpected is logged and becomes INTERNAL, and the
server keeps serving.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from bagua_lightning.proto.plan import BucketPlan, BucketTimingRecord, plan_from_proto, plan_to_proto

from .errors import (
    AutotuneRequestError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from .service import AutotuneService, Span
from .session import PlanRef

logger = logging.getLogger(__name__)

_STATUS: tuple[tuple[type[AutotuneRequestError], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)

F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    for category, code in _STATUS:
        if isinstance(exc, category):
            logger.info("event=request_refused method=%s code=%s message=%r", method, code.name, str(exc))
            context.abort(code, str(exc))
    logger.exception("event=internal_error method=%s", method, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {type(exc).__name__}: {exc}")


def _translate_errors(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError):  # context.abort's own exception: already handled
                raise
            _abort(context, method.__name__, exc)
    return wrapper  # type: ignore[return-value]


def _plan_ref(message: Any) -> PlanRef | None:
    if not message.buckets:
        return None
    return PlanRef(
        version=int(message.plan_version),
        bucket_names=tuple((b.tensors[0].name, b.tensors[-1].name) if b.tensors else ("", "")
                           for b in message.buckets),
        bucket_lengths=tuple(len(b.tensors) for b in message.buckets),
        decode=lambda: plan_from_proto(message),
    )


class AutotuneServicer(pb_grpc.AutotuneServiceServicer):
    """``bagua_lightning.autotune.v1.AutotuneService`` over an :class:`AutotuneService`."""

    def __init__(self, service: AutotuneService) -> None:
        self.service = service
        # Encoding a plan of many tensors costs far more than the rest of a call: encode each issued plan
        # once. Keyed by (model, version); the plan object is kept to check the entry is still that plan.
        self._encoded: dict[tuple[str, int], tuple[BucketPlan, Any]] = {}
        self._encoded_lock = threading.Lock()

    def _encode(self, model_name: str, plan: BucketPlan) -> Any:
        key = (model_name, plan.version)
        cached = self._encoded.get(key)
        if cached is not None and cached[0] is plan:
            return cached[1]
        message = plan_to_proto(plan)
        with self._encoded_lock:
            if len(self._encoded) > 65536:
                self._encoded.clear()
            self._encoded[key] = (plan, message)
        return message

    @_translate_errors
    def RegisterTensors(self, request: Any, context: grpc.ServicerContext) -> Any:
        plan = self.service.register(
            request.model_name,
            [(t.name, int(t.num_elements), t.dtype) for t in request.tensor_list],
            bool(request.whether_to_bucket),
            world_size=int(request.world_size),
            nproc_per_node=int(request.nproc_per_node),
        )
        return pb.RegisterTensorsResponse(recommended_hyperparameters=self._encode(request.model_name, plan))

    @_translate_errors
    def ReportMetrics(self, request: Any, context: grpc.ServicerContext) -> Any:
        timings = [BucketTimingRecord(bucket_index=int(t.bucket_index), bytes=int(t.bytes), ready_ms=t.ready_ms,
                                      comm_ms=t.comm_ms, wait_ms=t.wait_ms) for t in request.bucket_timings]
        accepted = self.service.report(
            request.model_name, int(request.rank), int(request.train_iter),
            _plan_ref(request.hyperparameters) if request.HasField("hyperparameters") else None,
            float(request.speed), timings, float(request.backward_ms))
        return pb.ReportMetricsResponse(accepted=accepted)

    @_translate_errors
    def AskHyperparameters(self, request: Any, context: grpc.ServicerContext) -> Any:
        plan, completed = self.service.ask(request.model_name, int(request.rank), int(request.train_iter))
        return pb.AskHyperparametersResponse(recommended_hyperparameters=self._encode(request.model_name, plan),
                                             is_autotune_completed=completed)

    @_translate_errors
    def ReportTensorExecutionOrder(self, request: Any, context: grpc.ServicerContext) -> Any:
        spans = [Span(trace_id=int(s.trace_id), action=s.action, tensor_name=s.tensor_name,
                      start_time=int(s.start_time), end_time=int(s.end_time)) for s in request.spans]
        self.service.report_execution_order(spans, request.model_name)
        return pb.ReportTensorExecutionOrderResponse()
