"""Fixtures of the autotune service tests: the real server as its own OS process, on a free port."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.client.retry import ExponentialBackoff, Retry
from bagua_lightning.core.errors import AutotuneError
from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from tests.procs import free_port, running, wait_until

# Tests that drive the service in tight loops take proposals in the request (deterministic plan sequences);
# tuning in worker processes (the serve default) is tested on its own.
FAST = ["--warmup-time-s", "0", "--sampling-confidence-time-s", "0", "--tuning-processes", "0"]


@contextlib.contextmanager
def autotune_service(*args: str, port: int | None = None, log_path: Path | None = None,
                     tls_root_cert: Path | None = None) -> Iterator[tuple[str, object]]:
    """Run ``bagua-lightning autotune serve`` on a free port; yields (target, process); always stopped."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "bagua_lightning.cli", "autotune", "serve", "--port", str(port), *args]
    # The service needs no Lightning: skip registering the strategy (seconds of imports on a small VM).
    env = dict(os.environ)
    with running(cmd, env=env, log_path=str(log_path) if log_path else None) as proc:
        target = f"127.0.0.1:{port}"
        with AutotuneClient(target=target, root_certificates=tls_root_cert) as probe:
            wait_until(lambda: proc.poll() is None and probe.health_check(timeout_s=0.5), 30.0,
                       f"the autotune service on {target}")
        yield target, proc


def no_retry_client(target: str) -> AutotuneClient:
    """A client that surfaces every status code at once (no retries), with a short deadline."""
    return AutotuneClient(target=target, timeout_s=5.0,
                          retry=Retry(backoff=ExponentialBackoff(), retries=0, retryable=lambda e: False))


@pytest.fixture
def start_service(tmp_path: Path) -> Callable[..., contextlib.AbstractContextManager[tuple[str, object]]]:
    """``with start_service(*args) as (target, proc)``: a real service process, logs under tmp_path."""
    counter = iter(range(1000))

    def start(*args: str, port: int | None = None, tls_root_cert: Path | None = None
              ) -> contextlib.AbstractContextManager[tuple[str, object]]:
        return autotune_service(*args, port=port, log_path=tmp_path / f"service-{next(counter)}.log",
                                tls_root_cert=tls_root_cert)

    return start


@pytest.fixture(scope="module")
def shared_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One service for a whole module (bad-input tests): small limits, fast sampling."""
    log = tmp_path_factory.mktemp("svc") / "service.log"
    with autotune_service(*FAST, "--world-size", "4", "--max-tensors", "64", "--max-request-bytes", "65536",
                          log_path=log) as (target, _):
        yield target


def rpc_code(excinfo: pytest.ExceptionInfo[AutotuneError]) -> grpc.StatusCode:
    """The gRPC status code an AutotuneError was raised for."""
    return grpc.StatusCode[excinfo.value.code]


def raw_stub(target: str) -> tuple[grpc.Channel, Any]:
    """A plain gRPC channel and stub: sends requests the typed client would refuse to build."""
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.AutotuneServiceStub(channel)


# --- the CLI, run for real in a private state folder (fixtures and helpers of the CLI tests) --------------

CLI = [sys.executable, "-m", "bagua_lightning.cli"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The CLI's environment: a private state folder, no inherited addresses or secrets."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("BAGUA_LIGHTNING_")}
    out.update(XDG_STATE_HOME=str(tmp_path / "state"), BAGUA_LIGHTNING_SERVICES_FILE=str(tmp_path / "services.json"),
               NO_PROXY="127.0.0.1,localhost")
    return out


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    """``result`` failed with ``code`` and said so in exactly one line containing every fragment."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
