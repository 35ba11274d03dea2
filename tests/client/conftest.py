"""Real Redis deployments for the sample cache tests: started once per session, always stopped."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.client.cache import RedisStore
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, running_cluster
from tests.procs import free_port

TEST_PASSWORD = "cache-test-password"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int, with_bus: bool = True) -> int:
    """First of ``n`` consecutive free ports (and their cluster bus ports, +10000), all below 55000."""
    for _ in range(200):
        base = free_port()
        if base + n > 55000:
            base = 20000 + base % 30000
        ports = [base + i for i in range(n)] + ([base + i + 10000 for i in range(n)] if with_bus else [])
        if all(_bindable(p) for p in ports):
            return base
    raise RuntimeError(f"no block of {n} free ports found")


def deployment(tmp_root: Path, **kwargs: object) -> Iterator[ClusterInfo]:
    total = int(kwargs.get("nodes", 3)) * (1 + int(kwargs.get("replicas", 0)))  # type: ignore[call-overload]
    spec = ClusterSpec(port=free_port_block(total), state_root=tmp_root, timeout_s=60.0, **kwargs)  # type: ignore[arg-type]
    with running_cluster(spec) as info:
        yield info


@pytest.fixture(scope="session")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    """One standalone server that requires ``TEST_PASSWORD``."""
    yield from deployment(tmp_path_factory.mktemp("redis-standalone"), nodes=1, cluster=False,
                          password=TEST_PASSWORD)


@pytest.fixture(scope="session")
def redis_servers3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    """Three independent standalone servers (client-side sharding)."""
    yield from deployment(tmp_path_factory.mktemp("redis-servers3"), nodes=3, cluster=False)


@pytest.fixture(scope="session")
def redis_cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    """A real Redis Cluster of 3 masters."""
    yield from deployment(tmp_path_factory.mktemp("redis-cluster3"), nodes=3)


@pytest.fixture
def store(redis_cluster3: ClusterInfo) -> Iterator[RedisStore]:
    """A store on the 3-master cluster, emptied before and after the test."""
    s = RedisStore(hosts=redis_cluster3.hosts)
    s.clear()
    yield s
    s.clear()
    s.shutdown()


@pytest.fixture(params=["standalone", "servers3", "cluster3"])
def any_deployment(request: pytest.FixtureRequest) -> tuple[str, ClusterInfo, dict[str, object]]:
    """Each topology in turn, with the store options it needs; its data is cleared first."""
    info: ClusterInfo = request.getfixturevalue(f"redis_{request.param}")
    options: dict[str, object] = {"password": TEST_PASSWORD} if request.param == "standalone" else {}
    from bagua_lightning.client.cache import RedisStore

    store = RedisStore(hosts=info.hosts, **options)
    store.clear()
    store.shutdown()
    return request.param, info, options
