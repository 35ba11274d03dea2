"""The gRPC server: the autotune service, grpc.health.v1 and reflection on one port.

:func:`create_server` builds and binds a server (port 0 picks a free one) and
returns it with the bound port; :func:`serve` runs one until SIGTERM/SIGINT,
then marks itself NOT_SERVING, lets in-flight calls finish and exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc

from .config import ServiceConfig
from .persistence import open_store
from .samplelog import SampleLog
from .service import AutotuneService
from .servicer import AutotuneServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AutotuneService"].full_name
DEFAULT_PORT = 29600
SHUTDOWN_GRACE_S = 5.0  # seconds in-flight calls get to finish after SIGTERM


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of the server's certificate chain and private key."""

    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


def create_server(address: str, service: AutotuneService, *, max_workers: int = 8,
                  tls: TlsFiles | None = None,
                  health_servicer: health.HealthServicer | None = None) -> tuple[grpc.Server, int]:
    """Build a server for ``service`` bound to ``address`` ("host:port"); returns (server, bound port).

    The server is not started. Health status is SERVING for "" and the service name
    once started by the caller (set here already, as grpc answers only once started).
    """
    limit = service.config.max_request_bytes
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="autotune"),
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                 ("grpc.so_reuseport", 0)],
    )
    pb_grpc.add_AutotuneServiceServicer_to_server(AutotuneServicer(service), server)
    health_servicer = health_servicer or health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind the autotune service to {address!r}; is the port in use?")
    return server, port


def serve(config: ServiceConfig, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, state: str | None = None,
          log_dir: str | None = None, tls: TlsFiles | None = None, max_workers: int = 8,
          stop_event: threading.Event | None = None) -> int:
    """Run the service until SIGTERM/SIGINT (or ``stop_event``); returns the exit code."""
    store = open_store(state)
    service = AutotuneService(config, store=store, sample_log=SampleLog(log_dir) if log_dir else None)
    health_servicer = health.HealthServicer()
    server, bound = create_server(f"{host}:{port}", service, max_workers=max_workers, tls=tls,
                                  health_servicer=health_servicer)
    stop = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    server.start()
    logger.info("event=serving address=%s:%d store=%r log_dir=%s tls=%s", host, bound, store, log_dir, bool(tls))
    # One plain line on stdout that scripts and tests can wait for (the port matters when 0 was asked).
    print(f"autotune service listening on {host}:{bound}", flush=True)
    while not stop.wait(timeout=1.0):
        pass
    logger.info("event=shutting_down grace_s=%.1f models=%d", SHUTDOWN_GRACE_S, len(service.model_names))
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=SHUTDOWN_GRACE_S).wait()
    close = getattr(store, "close", None)
    if close is not None:
        close()
    logger.info("event=stopped")
    sys.stdout.flush()
    return 0
