"""The trainer side of the autotune contract: :class:`AutotuneClient`.

Every call has a deadline and is retried with exponential backoff while the
service answers UNAVAILABLE or DEADLINE_EXCEEDED (starting, restarting, busy).
Inputs may be the proto messages, the shared plan dataclasses, or plain dicts
in Bagua's shape; calls return the response messages.

Example::

    client = AutotuneClient("127.0.0.1", 29600)
    plan = client.register_tensors("resnet50", [{"name": "fc.weight", "num_elements": 2048000, "dtype": "f32"}])
    client.report_metrics("resnet50", rank=0, train_iter=100,
                          hyperparameters=plan.recommended_hyperparameters, speed=812.5)
    reply = client.ask_hyperparameters("resnet50", rank=0, train_iter=100)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagua_lightning.errors import ServiceUnavailableError
from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from bagua_lightning.proto.plan import BucketPlan, BucketTimingRecord, TensorDeclaration, plan_to_proto

from .retry import ExponentialBackoff, Retry

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # seconds: deadline of one attempt
DEFAULT_RETRIES = 5
RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE_CODES  # type: ignore[attr-defined]


def default_retry() -> Retry:
    """5 retries, 50 ms doubling up to 1 s (about 2 s of waiting in all), giving up after 30 s."""
    return Retry(backoff=ExponentialBackoff(), retries=DEFAULT_RETRIES, retryable=_retryable, budget_s=30.0)


def tensor_to_proto(value: Any) -> Any:
    """A ``TensorDeclaration`` message from a message, the dataclass or a dict in Bagua's shape."""
    if isinstance(value, pb.TensorDeclaration):
        return value
    t = TensorDeclaration.coerce(value)
    return pb.TensorDeclaration(name=t.name, num_elements=t.num_elements, dtype=t.dtype)


def hyperparameters_to_proto(value: Any) -> Any:
    """A ``Hyperparameters`` message from a message, a response holding one, a ``BucketPlan`` or a dict.

    Dicts may be Bagua's shape (``{"buckets": [[{name, num_elements, dtype}, ...], ...], "bucket_size",
    "is_hierarchical_reduce"}``, as :meth:`BucketPlan.to_dict` returns) or the message's JSON shape
    (buckets as ``{"tensors": [...]}``).
    """
    if value is None:
        return pb.Hyperparameters()
    if isinstance(value, pb.Hyperparameters):
        return value
    if isinstance(value, pb.AskHyperparametersResponse | pb.RegisterTensorsResponse):
        return value.recommended_hyperparameters
    if isinstance(value, BucketPlan):
        return plan_to_proto(value)
    if isinstance(value, Mapping):
        if "recommended_hyperparameters" in value:
            return hyperparameters_to_proto(value["recommended_hyperparameters"])
        buckets = [b["tensors"] if isinstance(b, Mapping) else b for b in value.get("buckets", ())]
        return pb.Hyperparameters(
            buckets=[pb.Bucket(tensors=[tensor_to_proto(t) for t in bucket]) for bucket in buckets],
            bucket_size=int(value.get("bucket_size", 0)),
            is_hierarchical_reduce=bool(value.get("is_hierarchical_reduce", False)),
            plan_version=int(value.get("plan_version", 0)),
        )
    raise TypeError(f"hyperparameters must be a Hyperparameters message, a BucketPlan or a dict, "
                    f"got {type(value).__name__}")


def timing_to_proto(value: Any) -> Any:
    """A ``BucketTiming`` message from a message, a ``BucketTimingRecord`` or a dict of its fields."""
    if isinstance(value, pb.BucketTiming):
        return value
    if isinstance(value, BucketTimingRecord):
        value = value.to_dict()
    if isinstance(value, Mapping):
        unknown = set(value) - {"bucket_index", "bytes", "ready_ms", "comm_ms", "wait_ms"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in bucket timing {dict(value)!r}; expected "
                             "bucket_index, bytes, ready_ms, comm_ms, wait_ms")
        return pb.BucketTiming(**value)
    raise TypeError(f"a bucket timing must be a BucketTiming, a BucketTimingRecord or a dict, "
                    f"got {type(value).__name__}")


def span_to_proto(value: Any) -> Any:
    """An ``ExecutionSpan`` message from a message or a dict (Bagua's span shape)."""
    if isinstance(value, pb.ExecutionSpan):
        return value
    if isinstance(value, Mapping):
        return pb.ExecutionSpan(**value)
    raise TypeError(f"a span must be an ExecutionSpan or a dict, got {type(value).__name__}")


class AutotuneClient:
    """Client of the autotune service.

    Args:
        host: service host (ignored when ``target`` is given).
        port: service port (ignored when ``target`` is given).
        target: ``"host:port"`` (or any gRPC target) instead of host and port.
        timeout_s: deadline of each attempt, in seconds.
        retry: retry policy for UNAVAILABLE / DEADLINE_EXCEEDED (default: :func:`default_retry`).
        tls_root_cert: PEM file of the CA that signed the server's certificate; enables TLS.
        max_message_bytes: largest message sent or received, in bytes.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 29600, *, target: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry: Retry | None = None,
                 tls_root_cert: str | Path | None = None, max_message_bytes: int = 64 * 1024**2) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.target = target or f"{host}:{port}"
        self.timeout_s = timeout_s
        self.retry = retry or default_retry()
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.enable_http_proxy", 0),
                   # Reconnect quickly to a service that is (re)starting; the Retry object paces the calls.
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls_root_cert is not None:
            credentials = grpc.ssl_channel_credentials(Path(tls_root_cert).read_bytes())
            self._channel = grpc.secure_channel(self.target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=options)
        self._stub = pb_grpc.AutotuneServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # -- plumbing ----------------------------------------------------------------------------------
    def _call(self, method: str, request: Any) -> Any:
        rpc = getattr(self._stub, method)

        def attempt() -> Any:
            return rpc(request, timeout=self.timeout_s)

        def log_retry(exc: BaseException, failures: int, wait_s: float) -> None:
            logger.debug("autotune %s to %s failed (%s); retry %d in %.3f s", method, self.target,
                         exc.code().name, failures, wait_s)  # type: ignore[attr-defined]

        try:
            return self.retry.call(attempt, on_retry=log_retry)
        except grpc.RpcError as exc:
            if _retryable(exc):
                raise ServiceUnavailableError(
                    f"the autotune service at {self.target} did not answer {method} "
                    f"({exc.code().name}: {exc.details()}) after {self.retry.retries} retries; "  # type: ignore[attr-defined]
                    "start it with `bagua-lightning autotune serve` or point BAGUA_LIGHTNING_AUTOTUNE_SERVICE at it"
                ) from exc
            raise

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AutotuneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the API (Bagua's names) -------------------------------------------------------------------
    def register_tensors(self, model_name: str, tensor_list: Iterable[Any], whether_to_bucket: bool = True, *,
                         world_size: int = 0, nproc_per_node: int = 0) -> Any:
        """Declare a model's tensors; returns a ``RegisterTensorsResponse`` with the initial plan."""
        request = pb.RegisterTensorsRequest(model_name=model_name,
                                            tensor_list=[tensor_to_proto(t) for t in tensor_list],
                                            whether_to_bucket=whether_to_bucket, world_size=world_size,
                                            nproc_per_node=nproc_per_node)
        return self._call("RegisterTensors", request)

    def report_metrics(self, model_name: str, rank: int, train_iter: int, hyperparameters: Any, speed: float,
                       bucket_timings: Sequence[Any] | None = None, *, backward_ms: float = 0.0) -> Any:
        """Report one rank's measurement of ``hyperparameters``; returns a ``ReportMetricsResponse``."""
        request = pb.ReportMetricsRequest(
            model_name=model_name, rank=rank, train_iter=train_iter,
            hyperparameters=hyperparameters_to_proto(hyperparameters), speed=speed,
            bucket_timings=[timing_to_proto(t) for t in bucket_timings or ()], backward_ms=backward_ms)
        return self._call("ReportMetrics", request)

    def ask_hyperparameters(self, model_name: str, rank: int, train_iter: int) -> Any:
        """The plan to use from ``train_iter`` on; returns an ``AskHyperparametersResponse``."""
        return self._call("AskHyperparameters",
                          pb.AskHyperparametersRequest(model_name=model_name, rank=rank, train_iter=train_iter))

    def report_tensor_execution_order(self, spans: Iterable[Any], model_name: str = "") -> Any:
        """Report when tensors became ready; later plans cut buckets in that order."""
        request = pb.ReportTensorExecutionOrderRequest(spans=[span_to_proto(s) for s in spans],
                                                       model_name=model_name)
        return self._call("ReportTensorExecutionOrder", request)

    def health_check(self, timeout_s: float = 1.0) -> bool:
        """True when the service answers SERVING within ``timeout_s``; never raises."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except Exception:  # any failure (unreachable, TLS mismatch, shutting down) means "not healthy"
            return False

    def wait_until_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the service is SERVING; ServiceUnavailableError after ``timeout_s``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError as exc:
            raise ServiceUnavailableError(
                f"the autotune service at {self.target} was not reachable within {timeout_s} s; "
                "start it with `bagua-lightning autotune serve`") from exc
        if not self.health_check(timeout_s=min(timeout_s, 5.0)):
            raise ServiceUnavailableError(f"the autotune service at {self.target} is reachable but not SERVING")
