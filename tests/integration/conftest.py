"""The ``services`` fixture: the deployed services, by docker compose when a Docker engine answers, else
by ``bagua-lightning up``; the same endpoints either way, always torn down.

Docker path: ``pytest-docker``'s ``docker_services`` runs ``docker compose up --build -d --wait`` on the
top-level docker-compose.yml (fixed ports: 29600, 7000-7002) and ``down -v`` after. Native path:
``bagua-lightning up`` in a temporary state folder (``XDG_STATE_HOME`` and ``BAGUA_LIGHTNING_SERVICES_FILE``
point there) on free ports, ``bagua-lightning down`` after, and whatever is still alive is killed by pid.
The native path is the default; ``BAGUA_LIGHTNING_TEST_DEPLOYMENT=docker`` picks compose (its clients then
need the deployment's TLS files: see test_compose_up.py, which runs the compose stack on its own).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.core import procs as processes
from bagua_lightning.core.procs import read_secret
from bagua_lightning.core.services_file import (
    DEFAULT_AUTOTUNE_ADDRESS,
    ENV_AUTOTUNE_TOKEN,
    ENV_FILE,
    ENV_REDIS_PASSWORD,
    ServicesInfo,
    read_services_file,
)
from bagua_lightning.core.tls_trust import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY
from bagua_lightning.services import deploy
from tests.integration.compose import COMPOSE_FILE
from tests.procs import free_port, free_port_block

DOCKER_PROJECT = f"bagua-lightning-test-{os.getpid()}"


def docker_engine_available() -> bool:
    """True when ``docker info`` succeeds and ``docker compose`` exists (a daemon answers)."""
    if shutil.which("docker") is None:
        return False
    for cmd in (["docker", "info"], ["docker", "compose", "version"]):
        try:
            if subprocess.run(cmd, capture_output=True, timeout=20).returncode != 0:
                return False
        except (OSError, subprocess.TimeoutExpired):
            return False
    return True


def _deployment_kind() -> str:
    forced = os.environ.get("BAGUA_LIGHTNING_TEST_DEPLOYMENT", "")
    if forced in ("native", "docker"):
        return forced
    # The compose stack serves TLS only; its own test (test_compose_up.py) runs it with the client files.
    return "native"


@dataclass(kw_only=True)
class Deployment:
    """Where the services are, and how to run ``up``/``down`` and list the processes of this deployment.

    Attributes:
        kind: ``"docker"`` or ``"native"``.
        autotune: ``host:port`` of the autotune service.
        redis_hosts: the Redis Cluster masters as ``{"host", "port"}``.
        env: environment for the CLI (native: the temporary state folder).
        up_args: arguments of ``bagua-lightning up`` (native).
    """

    kind: str
    autotune: str
    redis_hosts: list[dict[str, Any]]
    redis_cluster: bool = True
    env: dict[str, str] = field(default_factory=dict)
    up_args: list[str] = field(default_factory=list)
    compose: Any = None  # pytest-docker's executor (docker path)

    def up(self) -> None:
        if self.kind == "docker":
            self.compose.execute("up --build -d --wait")
        else:
            _cli(["up", *self.up_args], self.env)

    def down(self) -> None:
        if self.kind == "docker":
            self.compose.execute("down -v")
        else:
            _cli(["down"], self.env)

    def processes(self, *, exited_too: bool = False) -> list[str]:
        """What runs: container ids (docker; with ``exited_too`` also the one-shot init's) or live pids."""
        if self.kind == "docker":
            return self.compose.execute("ps -aq" if exited_too else "ps -q").decode().split()
        info = self.recorded()
        pids = _recorded_pids(info) if info is not None else []
        return [str(p) for p in pids if processes.pid_alive(p)]

    def recorded(self) -> ServicesInfo | None:
        return read_services_file(Path(self.env[ENV_FILE])) if self.kind == "native" else None

    def secret_env(self) -> dict[str, str]:
        """The secrets a client of this deployment needs, as the environment variables that carry them."""
        if self.kind == "docker":
            return {k: v for k, v in os.environ.items() if k in (ENV_REDIS_PASSWORD, ENV_AUTOTUNE_TOKEN)}
        info = self.recorded()
        names = {"redis_password": ENV_REDIS_PASSWORD, "autotune_token": ENV_AUTOTUNE_TOKEN}
        env = {env: read_secret(info.secrets[name]) for name, env in names.items()
               if info is not None and name in info.secrets}
        if info is not None and info.tls is not None:  # the pinned CA and the client certificate, by path
            env.update({ENV_TLS_CA: info.tls.ca, ENV_TLS_CERT: info.tls.cert or "", ENV_TLS_KEY: info.tls.key or ""})
        return env

    def ports(self) -> list[int]:
        port = int(self.autotune.rpartition(":")[2])
        return [port, *(int(h["port"]) for h in self.redis_hosts)]


def _recorded_pids(info: ServicesInfo) -> list[int]:
    pids = [info.pids.get("autotune"), info.pids.get("lighthouse"), *(info.pids.get("redis") or [])]
    return [int(p) for p in pids if p is not None]


def stop_recorded(info: ServicesInfo | None) -> None:
    """Stop every process ``info`` records that is still the recorded one (pid, start time, deployment)."""
    for records in (info.processes.values() if info is not None else []):
        for rec in records:
            processes.stop(rec, timeout_s=5)


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", *args], env=env, capture_output=True,
                            text=True, timeout=180)
    if result.returncode != 0:
        raise AssertionError(f"bagua-lightning {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


@contextlib.contextmanager
def native_deployment(state: Path) -> Iterator[Deployment]:
    env = dict(os.environ)
    for name in ("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_REDIS_PASSWORD"):
        env.pop(name, None)
    env.update({"XDG_STATE_HOME": str(state), ENV_FILE: str(state / "services.json"),
                "NO_PROXY": "127.0.0.1,localhost"})
    autotune_port, redis_port = free_port(), free_port_block(6)  # 3 masters, 3 replicas
    dep = Deployment(kind="native", autotune=f"127.0.0.1:{autotune_port}",
                     redis_hosts=[{"host": "127.0.0.1", "port": redis_port + i} for i in range(3)], env=env,
                     up_args=["--autotune-port", str(autotune_port), "--redis-port", str(redis_port),
                              "--maxmemory", "64mb", "--timeout", "90"])
    try:
        dep.up()
        yield dep
    finally:
        info = dep.recorded()
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            dep.down()
        # Safety net: nothing this deployment started may outlive the tests.
        from bagua_lightning.services.redis_cluster import stop_cluster

        stop_recorded(info)
        stop_cluster(redis_port, state / "bagua-lightning")


@pytest.fixture(scope="module")
def services(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The running services; module-scoped, so the last test of a module may take them down."""
    if _deployment_kind() == "docker":
        docker = request.getfixturevalue("docker_services")
        yield Deployment(kind="docker", autotune=DEFAULT_AUTOTUNE_ADDRESS,
                         redis_hosts=[{"host": "127.0.0.1", "port": deploy.DEFAULT_REDIS_PORT + i} for i in range(3)],
                         compose=docker._docker_compose)
        return
    with native_deployment(tmp_path_factory.mktemp("state")) as dep:
        yield dep


# pytest-docker's settings for the docker path: this repository's compose file, a private project name.
@pytest.fixture(scope="session")
def docker_compose_file() -> str:
    return str(COMPOSE_FILE)


@pytest.fixture(scope="session")
def docker_compose_project_name() -> str:
    return DOCKER_PROJECT


@pytest.fixture(scope="session")
def docker_setup() -> list[str]:
    return ["up --build -d --wait"]


@pytest.fixture(scope="session")
def docker_cleanup() -> list[str]:
    return ["down -v"]
