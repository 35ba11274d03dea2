"""The trainer side of the autotune contract: :class:`AutotuneClient`.

Every call has a deadline and is retried with exponential backoff while the
service answers UNAVAILABLE or DEADLINE_EXCEEDED (starting, restarting, busy).
Results are the shared plan dataclasses and small typed records (:mod:`.autotune_records`), never proto
messages; refusals raise the project's errors (:mod:`bagua_lightning.core.errors`):
:class:`ModelNotRegisteredError` for NOT_FOUND, :class:`AutotuneRequestRejectedError`
for INVALID_ARGUMENT / FAILED_PRECONDITION / RESOURCE_EXHAUSTED,
:class:`AutotuneAuthenticationError` for UNAUTHENTICATED, :class:`ServiceUnavailableError`
once retries are spent, :class:`AutotuneError` for anything else.

Example::

    client = AutotuneClient("127.0.0.1", 29600)
    plan = client.register_tensors("resnet50", [{"name": "fc.weight", "num_elements": 2048000, "dtype": "f32"}])
    client.report_metrics("resnet50", rank=0, train_iter=100, hyperparameters=plan, speed=812.5)
    answer = client.ask_hyperparameters("resnet50", rank=0, train_iter=100)
    answer.plan, answer.completed
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..core.addresses import check_host, check_port, format_address, parse_address
from ..core.errors import (
    AutotuneAuthenticationError,
    AutotuneError,
    AutotuneRequestRejectedError,
    ModelNotRegisteredError,
    ServiceUnavailableError,
)
from ..core.tls_trust import handshake_failed, read_pem, untrusted
from ..proto.autotune.v1 import autotune_pb2 as pb
from ..proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from ..proto.plan import (
    BucketPlan,
    BucketTimingRecord,
    TensorDeclaration,
    plan_from_proto,
    plan_to_proto,
)
from .autotune_records import (
    ModelDescription,
    ModelSummary,
    PlanAnswer,
    SampleSummary,
    SharedPlan,
    plan_of,
    selection_of,
    shapes_of,
    shared_plan_of,
    span_to_proto,
    summary_of,
    tensor_to_proto,
    timing_to_proto,
)
from .retry import ExponentialBackoff, Retry

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29600
DEFAULT_TIMEOUT_S = 5.0  # seconds: deadline of one attempt
DEFAULT_RETRIES = 5
RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE)


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE_CODES


def default_retry() -> Retry:
    """5 retries, 50 ms doubling up to 1 s (about 2 s of waiting in all), giving up after 30 s."""
    return Retry(backoff=ExponentialBackoff(), retries=DEFAULT_RETRIES, retryable=_retryable, budget_s=30.0)


def quick_retry(retries: int, timeout_s: float) -> Retry:
    """For calls from a training loop: ``retries`` quick retries within twice ``timeout_s`` in all."""
    return Retry(backoff=ExponentialBackoff(base_s=0.05, cap_s=0.5), retries=retries, retryable=_retryable,
                 budget_s=2 * timeout_s)


def _error(method: str, target: str, exc: grpc.RpcError) -> AutotuneError:
    code = exc.code()
    detail = f"autotune {method} at {target}: {code.name}: {exc.details()}"
    if code == grpc.StatusCode.NOT_FOUND:
        return ModelNotRegisteredError(detail, code.name)
    if code in _REJECTED:
        return AutotuneRequestRejectedError(detail, code.name)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AutotuneAuthenticationError(
            f"{detail}; pass token= or set BAGUA_LIGHTNING_AUTOTUNE_TOKEN to the service's token", code.name)
    return AutotuneError(detail, code.name)


class AutotuneClient:
    """Client of the autotune service.

    The address, like every client's: ``target`` (or ``host``/``port``), else
    ``$BAGUA_LIGHTNING_AUTOTUNE_SERVICE``, else the services file's, else ``127.0.0.1:29600``. The recorded
    token and CA go only to the address the services file records
    (:mod:`bagua_lightning.core.services_file`).

    Args:
        host: service host (ignored when ``target`` is given); with only ``port``: ``127.0.0.1``.
        port: service port, 1..65535 (ignored when ``target`` is given); with only ``host``: 29600.
        target: ``"host:port"`` instead of host and port. None of the three: resolved as above.
        timeout_s: deadline of each attempt, in seconds.
        retry: retry policy for UNAVAILABLE / DEADLINE_EXCEEDED (default: :func:`default_retry`).
        token: bearer token sent with every call (``authorization`` metadata); None: from
            :func:`bagua_lightning.core.services_file.resolve_autotune_token`: ``$BAGUA_LIGHTNING_AUTOTUNE_TOKEN``, else
            the services file's token when ``target`` is the service that file records, else none.
        tls: connect over TLS (the system's root certificates unless a CA is given or resolved).
        root_certificates: PEM of the CA that signed the server's certificate (bytes, or a
            file path); implies ``tls``.
        tls_ca: PEM file of the deployment's CA (the same as ``root_certificates`` given as a path). None
            (and no ``root_certificates``): ``$BAGUA_LIGHTNING_TLS_CA``, else the services file's CA when
            the address is the service it records, else plaintext. With a CA the server must prove itself
            with a certificate of that CA (host name or IP checked) before the token is sent; one that
            does not raises :class:`~bagua_lightning.core.errors.UntrustedServerError` at once.
        max_message_bytes: largest message sent or received, in bytes.
    """

    def __init__(self, host: str | None = None, port: int | None = None, *, target: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry: Retry | None = None, token: str | None = None,
                 tls: bool = False, root_certificates: bytes | str | Path | None = None,
                 tls_ca: str | Path | None = None, max_message_bytes: int = 64 * 1024**2) -> None:
        from ..core.services_file import (
            resolve_autotune_address,
            resolve_autotune_tls,
            resolve_autotune_token,
        )

        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if target is not None:
            parse_address(target, "the autotune service address")
            self.target = target
        elif host is not None or port is not None:
            self.target = format_address(check_host(host if host is not None else "127.0.0.1"),
                                         check_port(port if port is not None else DEFAULT_PORT))
        else:
            self.target = resolve_autotune_address()
            parse_address(self.target, "the autotune service address")
        if root_certificates is None:
            resolved = resolve_autotune_tls(self.target, ca=tls_ca)
            root_certificates = Path(resolved.ca) if resolved is not None else None
        elif tls_ca is not None:
            raise ValueError("give the CA once: root_certificates= or tls_ca=, not both")
        self.tls_ca = root_certificates
        if token is None:
            token = resolve_autotune_token(self.target)
        if token is not None and (not isinstance(token, str) or not token.strip() or "\n" in token):
            raise ValueError("token must be a non-empty single-line string (or None for no token)")
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s
        self.retry = retry or default_retry()
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.enable_http_proxy", 0),
                   # Reconnect quickly to a service that is (re)starting; the Retry object paces the calls.
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls or root_certificates is not None:
            roots = root_certificates
            if isinstance(roots, str | Path):
                roots = read_pem(roots)
            self._channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(roots), options=options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=options)
        self._stub = pb_grpc.AutotuneServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # -- plumbing ----------------------------------------------------------------------------------
    def _call(self, method: str, request: Any) -> Any:
        rpc = getattr(self._stub, method)

        def attempt() -> Any:
            try:
                return rpc(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                # A failed handshake: the server is not the deployment's (it got no token); retrying cannot help.
                if self.tls_ca is not None and handshake_failed(exc.details() or ""):
                    raise untrusted(self.target, exc.details()) from exc
                raise

        def log_retry(exc: BaseException, failures: int, wait_s: float) -> None:
            logger.debug("autotune %s to %s failed (%s); retry %d in %.3f s", method, self.target,
                         exc.code().name, failures, wait_s)  # type: ignore[attr-defined]

        try:
            return self.retry.call(attempt, on_retry=log_retry)
        except grpc.RpcError as exc:
            if _retryable(exc):
                raise ServiceUnavailableError(
                    f"the autotune service at {self.target} did not answer {method} "
                    f"({exc.code().name}: {exc.details()}) after {self.retry.retries} retries; "
                    "start it with `bagua-lightning autotune serve` or point BAGUA_LIGHTNING_AUTOTUNE_SERVICE at it"
                ) from exc
            raise _error(method, self.target, exc) from exc

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AutotuneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the API (Bagua's names) -------------------------------------------------------------------
    def register_tensors(self, model_name: str, tensor_list: Iterable[TensorDeclaration | Mapping[str, Any]],
                         whether_to_bucket: bool = True, *, world_size: int = 0,
                         nproc_per_node: int = 0) -> BucketPlan:
        """Declare a model's tensors; returns the initial plan."""
        request = pb.RegisterTensorsRequest(model_name=model_name,
                                            tensor_list=[tensor_to_proto(t) for t in tensor_list],
                                            whether_to_bucket=whether_to_bucket, world_size=world_size,
                                            nproc_per_node=nproc_per_node)
        return self._answer("RegisterTensors", request).plan

    def register_job(self, model_name: str, tensor_list: Iterable[TensorDeclaration | Mapping[str, Any]],
                     whether_to_bucket: bool = True, *, job_id: str, world_size: int = 0, nproc_per_node: int = 0,
                     resume: BucketPlan | None = None, resume_completed: bool = False) -> PlanAnswer:
        """Declare a model's tensors for the job ``job_id`` (its own tuning session); returns the initial
        plan and whether it is final. ``resume``: the plan the job already runs (e.g. from a checkpoint),
        which a new session starts from."""
        request = pb.RegisterTensorsRequest(model_name=model_name,
                                            tensor_list=[tensor_to_proto(t) for t in tensor_list],
                                            whether_to_bucket=whether_to_bucket, world_size=world_size,
                                            nproc_per_node=nproc_per_node, job_id=job_id,
                                            resume_completed=resume_completed)
        if resume is not None:
            request.resume_hyperparameters.CopyFrom(plan_to_proto(resume))
        return self._answer("RegisterTensors", request)

    def _answer(self, method: str, request: Any) -> PlanAnswer:
        reply = self._call(method, request)
        try:
            plan = plan_from_proto(reply.recommended_hyperparameters)
        except (ValueError, TypeError) as exc:
            raise AutotuneError(f"the autotune service at {self.target} answered {method} with a malformed "
                                f"plan: {exc}", "INTERNAL") from exc
        return PlanAnswer(plan=plan, completed=bool(reply.is_autotune_completed),
                          selection=selection_of(reply) if method == "RegisterTensors" else None)

    def report_metrics(self, model_name: str, rank: int, train_iter: int,
                       hyperparameters: BucketPlan | Mapping[str, Any] | None, speed: float,
                       bucket_timings: Sequence[BucketTimingRecord | Mapping[str, Any]] | None = None, *,
                       backward_ms: float = 0.0, ranks: int = 0, speed_min: float = 0.0, speed_max: float = 0.0,
                       speed_stddev: float = 0.0, job_id: str = "") -> bool:
        """Report a measurement of ``hyperparameters`` (None: the plan the service handed back for
        ``train_iter``); returns False when the service already had one for (rank, train_iter).

        ``ranks > 1`` makes it the job's aggregated report (from rank 0): speed and timings are
        means over the ranks, ``speed_min/max/stddev`` their spread.
        """
        request = pb.ReportMetricsRequest(
            model_name=model_name, rank=rank, train_iter=train_iter, speed=speed,
            bucket_timings=[timing_to_proto(t) for t in bucket_timings or ()], backward_ms=backward_ms,
            ranks=ranks, speed_min=speed_min, speed_max=speed_max, speed_stddev=speed_stddev, job_id=job_id)
        if hyperparameters is not None:
            request.hyperparameters.CopyFrom(plan_to_proto(plan_of(hyperparameters)))
        return bool(self._call("ReportMetrics", request).accepted)

    def ask_hyperparameters(self, model_name: str, rank: int, train_iter: int, job_id: str = "") -> PlanAnswer:
        """The plan to use from ``train_iter`` on, and whether tuning completed."""
        request = pb.AskHyperparametersRequest(model_name=model_name, rank=rank, train_iter=train_iter,
                                               job_id=job_id)
        return self._answer("AskHyperparameters", request)

    def report_tensor_execution_order(self, spans: Iterable[Mapping[str, Any]], model_name: str = "",
                                      job_id: str = "") -> None:
        """Report when tensors became ready; later plans cut buckets in that order."""
        request = pb.ReportTensorExecutionOrderRequest(spans=[span_to_proto(s) for s in spans],
                                                       model_name=model_name, job_id=job_id)
        self._call("ReportTensorExecutionOrder", request)

    def list_models(self) -> list[ModelSummary]:
        """Every session (model, job) the service holds, by model name then job id."""
        return self.list_jobs()[0]

    def list_jobs(self) -> tuple[list[ModelSummary], list[SharedPlan]]:
        """Every session the service holds, and the best plan per model shape that jobs share."""
        reply = self._call("ListModels", pb.ListModelsRequest())
        return [summary_of(m) for m in reply.models], [shared_plan_of(p) for p in reply.shared_plans]

    def forget_plans(self, match: str) -> tuple[list[SharedPlan], str]:
        """Remove every shared plan whose shape key, model name or job id is ``match``; returns them and a
        warning ("" unless the service's store failed to drop them). ModelNotRegisteredError when none
        matches."""
        reply = self._call("ForgetPlans", pb.ForgetPlansRequest(match=match))
        return [shared_plan_of(p) for p in reply.removed], reply.warning

    def describe_model(self, model_name: str, job_id: str = "") -> ModelDescription:
        """One session's plans and samples; ModelNotRegisteredError when the service does not hold it
        (an empty ``job_id`` also finds the only job's session of ``model_name``)."""
        reply = self._call("DescribeModel", pb.DescribeModelRequest(model_name=model_name, job_id=job_id))
        samples = tuple(SampleSummary(index=s.index, plan_version=s.plan_version, bucket_size=s.bucket_size,
                                      is_hierarchical_reduce=s.is_hierarchical_reduce,
                                      bucket_bytes=tuple(s.bucket_bytes), speed=s.speed, score=s.score,
                                      exposed_ms=s.exposed_ms, reports=s.reports, train_iter=s.train_iter)
                        for s in reply.samples)
        return ModelDescription(summary=summary_of(reply.summary), current=plan_from_proto(reply.current),
                                best=plan_from_proto(reply.best) if reply.HasField("best") else None,
                                samples=samples, selection=selection_of(reply), shapes=shapes_of(reply))

    def report_algorithm_selection(self, model_name: str, chosen: str, step_ms: Mapping[str, float], reason: str,
                                   step: int, job_id: str = "") -> None:
        """Record what ``algorithm="auto"`` kept for a registered (job, model): ``step_ms`` holds every
        candidate's measured step time in milliseconds, in measured order."""
        selection = pb.AlgorithmSelection(
            chosen=chosen, reason=reason, step=step,
            candidates=[pb.AlgorithmCandidate(algorithm=n, step_ms=ms) for n, ms in step_ms.items()])
        self._call("ReportAlgorithmSelection", pb.ReportAlgorithmSelectionRequest(
            model_name=model_name, job_id=job_id, selection=selection))

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
