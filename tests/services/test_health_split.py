"""Health by the gRPC convention on a real service process: "" is liveness, the service's name readiness."""

from __future__ import annotations

import ast
import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.services.autotune import readiness
from bagua_lightning.services.autotune.config import ServiceConfig
from bagua_lightning.services.autotune.readiness import SERVICE_NAME, ReadinessMonitor
from bagua_lightning.services.autotune.service import AutotuneService
from tests.procs import free_port, running, wait_until
from tests.services.conftest import FAST

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"


def _status(target: str, name: str) -> str:
    """The health status of ``name`` as its enum name; the gRPC code's name when the check fails."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name),
                                                              timeout=2.0)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@contextlib.contextmanager
def _redis(port: int, folder: Path) -> Iterator[None]:
    """A standalone redis-server on ``port`` for the block; stopped after."""
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(folder)]
    with running(cmd):
        wait_until(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                                          timeout=5).stdout.strip() == b"PONG", 20, "redis-server")
        yield


def test_service_name_is_the_one_constant_both_servers_share() -> None:
    assert SERVICE_NAME == "bagua_lightning.autotune.v1.AutotuneService"
    # aio_server and server import their names from readiness, not from each other.
    folder = Path(readiness.__file__).parent
    imported = {node.module for node in ast.walk(ast.parse((folder / "aio_server.py").read_text()))
                if isinstance(node, ast.ImportFrom)}
    assert "readiness" in imported and "server" not in imported


def test_monitor_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="period must be > 0 seconds, got 0"):
        ReadinessMonitor(AutotuneService(ServiceConfig()), lambda ready: None, period_s=0)


@pytest.mark.parametrize("server", ["aio", "threads"])
def test_a_stopped_redis_store_fails_readiness_not_liveness(start_service, tmp_path: Path, server: str) -> None:
    redis_port = free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    with start_service(*FAST, "--server", server, "--state", url, "--store-timeout-s", "0.5") as (target, _), \
            AutotuneClient(target=target) as client:
        # No Redis yet: the process serves (alive) but is not ready.
        assert _status(target, "") == SERVING
        wait_until(lambda: _status(target, SERVICE_NAME) == NOT_SERVING, 30.0, "readiness NOT_SERVING")
        with _redis(redis_port, tmp_path):
            wait_until(lambda: _status(target, SERVICE_NAME) == SERVING, 30.0, "readiness SERVING")
            assert _status(target, "") == SERVING
        # Redis stopped: readiness fails, liveness stays (a liveness probe would not restart the process).
        wait_until(lambda: _status(target, SERVICE_NAME) == NOT_SERVING, 30.0, "readiness NOT_SERVING again")
        assert _status(target, "") == SERVING
        assert client.list_models() == []  # and it still answers
        # The same Redis comes back on the same port: ready again, without a restart.
        with _redis(redis_port, tmp_path):
            wait_until(lambda: _status(target, SERVICE_NAME) == SERVING, 30.0, "readiness SERVING again")


def test_a_broken_plan_folder_fails_readiness_not_liveness(start_service, tmp_path: Path) -> None:
    plans = tmp_path / "plans"
    with start_service(*FAST, "--server", "threads", "--state", str(plans)) as (target, _):
        wait_until(lambda: _status(target, SERVICE_NAME) == SERVING, 30.0, "readiness SERVING")
        shutil.rmtree(plans)
        plans.write_text("")  # the store's folder is now a file: every save and probe fails
        wait_until(lambda: _status(target, SERVICE_NAME) == NOT_SERVING, 30.0, "readiness NOT_SERVING")
        assert _status(target, "") == SERVING
        plans.unlink()
        plans.mkdir()
        wait_until(lambda: _status(target, SERVICE_NAME) == SERVING, 30.0, "readiness SERVING again")


def test_an_unknown_service_name_is_not_found(start_service) -> None:
    with start_service(*FAST) as (target, _):
        assert _status(target, "bagua_lightning.autotune.v1.NoSuchService") == "NOT_FOUND"
