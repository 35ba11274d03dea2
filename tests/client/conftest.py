"""Real Redis deployments for the sample cache tests: started once per session, always stopped."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.client.cache import RedisStore, digests
from bagua_lightning.core.local_redis import stop_server
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, running_cluster
from tests.procs import free_port_block

TEST_PASSWORD = "cache-test-password"


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


@pytest.fixture
def local_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private state folder and no configured Redis: ``RedisStore(hosts=None)`` starts the node-local server
    there; it is stopped after the test."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("BAGUA_LIGHTNING_SERVICES_FILE", str(tmp_path / "no-services.json"))
    for name in ("BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_REDIS_PASSWORD", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path
    stop_server()


def clear_digest_caches() -> None:
    """Forget what the digests module found out and derived (the AES class, the kinds, the ciphers)."""
    digests._aesgcm_class.cache_clear()
    digests.keyed_digest_kind.cache_clear()
    digests._gmac_cipher.cache_clear()
    digests.seal_cipher.cache_clear()


@contextlib.contextmanager
def cryptography_missing() -> Iterator[None]:
    """This process, for the block, as one where the ``cryptography`` package is not installed (its import
    fails); as it was after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
        clear_digest_caches()
        try:
            yield
        finally:
            mp.undo()
            clear_digest_caches()


@pytest.fixture
def without_cryptography() -> Iterator[None]:
    """The test as one where the ``cryptography`` package is not installed (:func:`cryptography_missing`)."""
    with cryptography_missing():
        yield
