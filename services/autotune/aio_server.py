"""The same service on ``grpc.aio``: small requests run on the event loop, big ones in worker threads.

The handlers are the threaded servicer's (:class:`AutotuneServicer`). Small requests
(a report or ask of a model of a few thousand tensors) take tens of microseconds and
run on the loop directly: a hop to a thread would cost more than the work. Requests
whose work grows with a model's tensors (registration, describe, listing, execution
order, and reports or asks of a model above :data:`BIG_MODEL_TENSORS`) run in a
bounded worker pool, so health checks and small requests never wait behind them;
the plans they carry are pre-encoded (:mod:`.wire`), so what is left on the loop is
a copy. A registration also reads the store (up to its deadline).
A handler's refusal leaves through ``await context.abort`` here. Token check,
health (open without a token) and reflection behave as in :mod:`.server`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from . import wire
from .metrics import RpcMetrics
from .readiness import OPEN_PREFIX, SERVICE_NAME
from .service import AutotuneService
from .servicer import AutotuneServicer

BIG_MODEL_TENSORS = 5_000  # above it a model's reports and asks run in a worker (their plans cost milliseconds)
WORKER_THREADS = 4  # big requests at once; more queue (the loop and small requests do not)
# Requests whose work grows with a model whatever its size (the others: with the tensors of the model they
# name; a request that names no model runs in a worker). The RPCs themselves come from the proto (wire.METHODS).
_HEAVY = frozenset({"RegisterTensors", "DescribeModel", "ListModels", "ReportTensorExecutionOrder", "ForgetPlans"})


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _RecordingContext:
    """What the threaded handlers use of a context: ``abort`` raises, to be re-raised on the loop."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(code, details)


def _is_big(sync: AutotuneServicer, name: str, request: Any) -> bool:
    """Whether ``request``'s work grows with a large model (then it runs in a worker thread)."""
    model_name = getattr(request, "model_name", None)
    if name in _HEAVY or model_name is None:
        return True
    return sync.service.tensor_count(model_name, getattr(request, "job_id", "")) > BIG_MODEL_TENSORS


def _handler(sync: AutotuneServicer, name: str, workers: ThreadPoolExecutor) -> Callable[[Any, Any], Awaitable[Any]]:
    method = getattr(sync, name)

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if _is_big(sync, name, request):
                return await asyncio.get_running_loop().run_in_executor(workers, method, request,
                                                                        _RecordingContext())
            return method(request, _RecordingContext())
        except _Aborted as aborted:
            await context.abort(aborted.code, aborted.details)
    return handle


class _AioServicer(pb_grpc.AutotuneServiceServicer):
    def __init__(self, sync: AutotuneServicer) -> None:
        # Threads, not processes: a session's state lives in this process. Python code in them hands the
        # GIL back every switch interval (serve() sets 1 ms), and the long C calls (encoding plans) are
        # done once per plan (:mod:`.wire`).
        self.workers = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="autotune-big")
        for name in wire.METHODS:
            setattr(self, name, _handler(sync, name, self.workers))


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (UNAUTHENTICATED), the health service aside."""

    def __init__(self, token: str, metrics: RpcMetrics | None = None) -> None:
        if not token:
            raise ValueError("the autotune token is empty; give a non-empty token or none")
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "this autotune service requires a token: send gRPC metadata 'authorization: Bearer "
                                "<token>' (AutotuneClient(token=...) or BAGUA_LIGHTNING_AUTOTUNE_TOKEN)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        if details.method.startswith(OPEN_PREFIX):
            return await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return await continuation(details)
                break
        if self._metrics is not None:
            self._metrics.observe(details.method.rsplit("/", 1)[-1], "UNAUTHENTICATED", 0.0)
        return self._deny


def create_aio_server(address: str, service: AutotuneService, *, tls: Any = None, token: str | None = None,
                      metrics: RpcMetrics | None = None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """An aio server for ``service`` bound to ``address``; (server, bound port, its health servicer).

    Call from a running event loop; the server is not started. Liveness (``""``) answers SERVING once it
    is (the aio health servicer's default); readiness (:data:`SERVICE_NAME`) is what :func:`set_readiness`
    publishes.
    """
    limit = service.config.max_request_bytes
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                 ("grpc.so_reuseport", 0)],
        interceptors=[AioTokenInterceptor(token, metrics)] if token else None)
    wire.add_to_server(_AioServicer(AutotuneServicer(service, metrics)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind the autotune service to {address!r}; is the port in use?")
    return server, port, health_servicer


async def set_readiness(servicer: health.aio.HealthServicer, ready: bool) -> None:
    """Publish readiness (SERVING / NOT_SERVING for :data:`SERVICE_NAME`); liveness stays as it is."""
    await servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ready
                       else health_pb2.HealthCheckResponse.NOT_SERVING)
