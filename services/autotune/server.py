"""The gRPC server: the autotune service, grpc.health.v1 and reflection on one port.

:func:`create_server` builds and binds a server (port 0 picks a free one) and
returns it with the bound port; :func:`serve` runs one until SIGTERM/SIGINT,
then marks itself NOT_SERVING, lets in-flight calls finish and exits.

With a token configured every call needs the gRPC metadata ``authorization:
Bearer <token>`` (UNAUTHENTICATED otherwise), except the health service, which
stays open so that load balancers, ``docker`` and Kubernetes probes can reach it.
Health follows the gRPC convention (:mod:`.readiness`): ``""`` is liveness (the
process serves), the service's own name is readiness (store and sample log work).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...core.addresses import check_host, check_port, format_address, parse_address
from ...core.file_trust import UntrustedFileError, read_trusted
from . import wire
from .aio_server import create_aio_server, set_readiness
from .config import ServiceConfig
from .metrics import RpcMetrics, make_registry
from .mirror import open_store
from .readiness import LIVENESS, OPEN_PREFIX, SERVICE_NAME, ReadinessMonitor
from .samplelog import SampleLog
from .service import AutotuneService
from .servicer import AutotuneServicer

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29600
SHUTDOWN_GRACE_S = 5.0  # seconds in-flight calls get to finish after SIGTERM
SERVER_KINDS = ("aio", "threads")
HEALTH_THREADS = 2  # the threaded server's health checks run on their own threads (see _HealthOnOwnThreads)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` (UNAUTHENTICATED), the health service aside."""

    def __init__(self, token: str, metrics: RpcMetrics | None = None) -> None:
        if not token:
            raise ValueError("the autotune token is empty; give a non-empty token or none")
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this autotune service requires a token: send gRPC metadata 'authorization: Bearer "
                          "<token>' (AutotuneClient(token=...) or BAGUA_LIGHTNING_AUTOTUNE_TOKEN)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        if details.method.startswith(OPEN_PREFIX):
            return continuation(details)
        for key, value in details.invocation_metadata:
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return continuation(details)
                break
        if self._metrics is not None:
            self._metrics.observe(details.method.rsplit("/", 1)[-1], "UNAUTHENTICATED", 0.0)
        return self._deny


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace removed), a file only this user (or root) owns and reads,
    like every secret file of the deployment (:mod:`bagua_lightning.core.file_trust`).

    Raises:
        ValueError: empty, unreadable, or another user could read, write or replace it (naming the fix).
    """
    try:
        token = read_trusted(path, "autotune token file", secret=True).strip()
    except UntrustedFileError as exc:
        raise ValueError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the autotune token file {str(path)!r}: {exc}") from exc
    if not token:
        raise ValueError(f"the autotune token file {str(path)!r} is empty; write the token into it")
    return token


class _HealthOnOwnThreads:
    """A health servicer whose unary checks run on their own small thread pool in a threaded server.

    grpc runs a handler on the pool named by its ``experimental_thread_pool`` attribute (grpc's own
    health servicer uses it for Watch), else on the server's pool: there, a burst of big requests
    (registrations, describes of 100,000-tensor models) holding every worker would queue health checks
    behind them, and a probe would time out on a busy but healthy server. Watch streams stay on the
    server's pool (each holds a thread for its lifetime; they must not take the checks' threads).
    """

    def __init__(self, servicer: health.HealthServicer, pool: futures.ThreadPoolExecutor) -> None:
        def check(request: Any, context: grpc.ServicerContext) -> Any:
            return servicer.Check(request, context)

        def list_(request: Any, context: grpc.ServicerContext) -> Any:
            return servicer.List(request, context)

        for method in (check, list_):
            method.experimental_thread_pool = pool  # type: ignore[attr-defined]
        self.Check, self.List, self.Watch = check, list_, servicer.Watch


def _readiness_publisher(servicer: health.HealthServicer) -> Callable[[bool], None]:
    def publish(ready: bool) -> None:
        servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ready
                     else health_pb2.HealthCheckResponse.NOT_SERVING)
    return publish


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of the server's certificate chain and private key."""

    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


def create_server(address: str, service: AutotuneService, *, max_workers: int = 8,
                  tls: TlsFiles | None = None, health_servicer: health.HealthServicer | None = None,
                  token: str | None = None, metrics: RpcMetrics | None = None,
                  ready: bool = True) -> tuple[grpc.Server, int]:
    """Build a server for ``service`` bound to ``address`` ("host:port"); returns (server, bound port).

    The server is not started. Liveness (``""``) is SERVING once the caller starts it; readiness
    (:data:`SERVICE_NAME`) is NOT_SERVING until a :class:`ReadinessMonitor` check publishes it, or SERVING
    at once when ``ready`` (a server without a monitor, e.g. in tests).
    ``token``: require ``authorization: Bearer <token>`` on every call but health checks.
    Health checks run on their own threads: requests occupying all ``max_workers`` do not delay them.
    """
    limit = service.config.max_request_bytes
    interceptors = [TokenInterceptor(token, metrics)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="autotune"),
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                 ("grpc.so_reuseport", 0)],
        interceptors=interceptors,
    )
    wire.add_to_server(AutotuneServicer(service, metrics), server)
    health_servicer = health_servicer or health.HealthServicer()
    health_pool = futures.ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="autotune-health")
    health_pb2_grpc.add_HealthServicer_to_server(_HealthOnOwnThreads(health_servicer, health_pool), server)
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ready
                        else health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind the autotune service to {address!r}; is the port in use?")
    return server, port


def serve(config: ServiceConfig, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          state: str | Sequence[str] | None = None,
          log_dir: str | None = None, tls: TlsFiles | None = None, max_workers: int = 8,
          token: str | None = None, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
          kind: str = "aio", stop_event: threading.Event | None = None) -> int:
    """Run the service until SIGTERM/SIGINT (or ``stop_event``); returns the exit code.

    ``metrics_port``: serve Prometheus metrics over HTTP on ``metrics_host:metrics_port``
    (None: no metrics endpoint; 0 picks a free port, printed on stdout). ``kind``: ``"aio"``
    (handlers on grpc.aio's event loop) or ``"threads"`` (grpc's thread-pool server with
    ``max_workers`` threads); docs/benchmarks.md compares them.
    """
    if kind not in SERVER_KINDS:
        raise ValueError(f"server kind must be one of {SERVER_KINDS}, got {kind!r}")
    address = format_address(check_host(host, "--host"), check_port(port, "--port", bind=True))
    store = open_store(state, timeout_s=config.store_timeout_s)
    service = AutotuneService(config, store=store, sample_log=SampleLog(log_dir) if log_dir else None)
    metrics = None
    http_server = None
    if metrics_port is not None:
        from prometheus_client import start_http_server

        registry, metrics = make_registry(service)
        http_server, _ = start_http_server(metrics_port, addr=metrics_host, registry=registry)
        metrics_bound = http_server.server_address[1]
        print(f"autotune metrics on http://{metrics_host}:{metrics_bound}/metrics", flush=True)
    stop = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    # Threads besides the one answering a health check (big requests, store loads, the writer) hand the GIL
    # back within 1 ms instead of Python's default 5 ms, which would otherwise show in the tail latency.
    sys.setswitchinterval(0.001)
    if kind == "aio":
        # Requests allocate many short-lived, acyclic objects (freed by reference counting); the default
        # gen-0 threshold (700) runs the cycle collector every few requests, and its occasional full
        # passes over every model's plans are the longest pauses in the tail. Collect less often, and
        # leave what exists at start-up (modules, config) out of every pass.
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        asyncio.run(_serve_aio(service, address, tls=tls, token=token, metrics=metrics, stop=stop))
    else:
        _serve_threads(service, address, max_workers=max_workers, tls=tls, token=token, metrics=metrics,
                       stop=stop)
    service.close()
    if http_server is not None:
        http_server.shutdown()
    logger.info("event=stopped")
    sys.stdout.flush()
    return 0


def _announce(address: str, bound: int, service: AutotuneService, tls: TlsFiles | None, token: str | None,
              kind: str) -> None:
    listening = format_address(parse_address(address, "the service address", bind=True)[0], bound)
    logger.info("event=serving address=%s server=%s store=%r log_dir=%s tls=%s token=%s", listening, kind,
                service.store, service.sample_log.directory if service.sample_log else None, bool(tls), bool(token))
    # One plain line on stdout that scripts and tests can wait for (the port matters when 0 was asked).
    print(f"autotune service listening on {listening}", flush=True)


def _serve_threads(service: AutotuneService, address: str, *, max_workers: int, tls: TlsFiles | None,
                   token: str | None, metrics: RpcMetrics | None, stop: threading.Event) -> None:
    health_servicer = health.HealthServicer()
    server, bound = create_server(address, service, max_workers=max_workers, tls=tls,
                                  health_servicer=health_servicer, token=token, metrics=metrics, ready=False)
    monitor = ReadinessMonitor(service, _readiness_publisher(health_servicer))
    server.start()
    monitor.check()
    monitor.start()
    _announce(address, bound, service, tls, token, "threads")
    while not stop.wait(timeout=1.0):
        pass
    logger.info("event=shutting_down grace_s=%.1f models=%d", SHUTDOWN_GRACE_S, len(service.model_names))
    monitor.stop()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=SHUTDOWN_GRACE_S).wait()


async def _serve_aio(service: AutotuneService, address: str, *, tls: TlsFiles | None, token: str | None,
                     metrics: RpcMetrics | None, stop: threading.Event) -> None:
    loop = asyncio.get_running_loop()
    server, bound, health_servicer = create_aio_server(address, service, tls=tls, token=token, metrics=metrics)

    def publish(ready: bool) -> None:
        asyncio.run_coroutine_threadsafe(set_readiness(health_servicer, ready), loop).result(timeout=10)

    monitor = ReadinessMonitor(service, publish)
    await set_readiness(health_servicer, False)  # not ready until the first check says so
    await server.start()
    await loop.run_in_executor(None, monitor.check)
    monitor.start()
    _announce(address, bound, service, tls, token, "aio")
    while not await loop.run_in_executor(None, stop.wait, 1.0):
        pass
    logger.info("event=shutting_down grace_s=%.1f models=%d", SHUTDOWN_GRACE_S, len(service.model_names))
    await loop.run_in_executor(None, monitor.stop)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(SHUTDOWN_GRACE_S)
