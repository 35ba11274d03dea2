"""RedisStore against real servers: standalone, 3 sharded servers, and a real 3-master Redis Cluster."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from bagua_lightning.client.cache import RedisStore
from bagua_lightning.client.cache.cluster_nodes import ClusterNodes
from bagua_lightning.client.cache.hashing import RendezvousHash
from bagua_lightning.client.cache.nodes import ServerNodes
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.services.redis_cluster import ClusterInfo
from tests.client.conftest import TEST_PASSWORD


def test_bagua_parity(any_deployment: tuple[str, ClusterInfo, dict[str, Any]]) -> None:
    kind, info, options = any_deployment
    store = RedisStore(hosts=info.hosts, **options)
    try:
        assert store.status()
        assert isinstance(store.nodes, ClusterNodes if kind == "cluster3" else ServerNodes)
        store.mset({"1": "v1", "2": b"v2"})
        assert store.mget(["1", "2", "5"]) == [b"v1", b"v2", None]
        store.set("k", b"\x00bin")
        assert store.get("k") == b"\x00bin" and store.get("missing") is None
        assert store.num_keys() == 3
        many = {f"key-{i}": str(i).encode() for i in range(300)}
        store.mset(many)
        keys = [*list(many)[::-1], "absent"]
        assert store.mget(keys) == [many[k] for k in keys[:-1]] + [None]
        store.clear()
        assert store.num_keys() == 0
    finally:
        store.shutdown()


def test_sharding_spreads_keys_over_every_server(redis_servers3: ClusterInfo) -> None:
    store = RedisStore(hosts=[f"{h['host']}:{h['port']}" for h in redis_servers3.hosts])
    try:
        store.clear()
        store.mset({f"s:{i}": b"x" for i in range(600)})
        per_node = [int(c.dbsize()) for c in store.nodes.primaries()]
        assert sum(per_node) == 600 and min(per_node) > 120, per_node
    finally:
        store.clear()
        store.shutdown()


def test_cluster_mode_false_uses_host_n_mod_m(redis_servers3: ClusterInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "4")
    store = RedisStore(hosts=redis_servers3.hosts, cluster_mode=False)
    try:
        store.clear()
        store.mset({f"n:{i}": b"x" for i in range(50)})
        expected = redis_servers3.hosts[4 % 3]["port"]
        assert store.nodes.primaries()[0].connection_pool.connection_kwargs["port"] == expected
        with redis.Redis(port=expected) as direct:
            assert direct.dbsize() == 50
    finally:
        store.clear()
        store.shutdown()


def test_password_is_required(redis_standalone: ClusterInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BAGUA_LIGHTNING_REDIS_PASSWORD", raising=False)
    anonymous = RedisStore(hosts=redis_standalone.hosts)
    assert not anonymous.status()
    values, error = anonymous.fetch(["a"])
    assert values == [None] and isinstance(error, redis.AuthenticationError)
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", TEST_PASSWORD)
    assert RedisStore(hosts=redis_standalone.hosts).status()


def test_unreachable_store_reports_instead_of_raising_from_fetch() -> None:
    store = RedisStore(hosts=["127.0.0.1:1"], connect_timeout_s=0.5, retries=0)
    assert not store.status()
    values, error = store.fetch(["a", "b"])
    assert values == [None, None] and isinstance(error, redis.ConnectionError)
    with pytest.raises(redis.ConnectionError):
        store.mget(["a"])


@pytest.mark.parametrize(("hosts", "match"), [
    ([], "empty"),
    ([{"host": "h"}], r"hosts item \{'host': 'h'\}: port None is not a TCP port"),  # core/addresses' words
    (["h:notaport"], "hosts item 'h:notaport': port 'notaport' is not a TCP port"),
    (["h:1", "h:1"], "twice"),
])
def test_bad_hosts_are_named(hosts: list[object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        RedisStore(hosts=hosts)


def test_bad_options_are_named() -> None:
    with pytest.raises(TypeError, match=r"unknown RedisStore option.*'pasword'.*valid options"):
        RedisStore(hosts=["127.0.0.1:1"], pasword="x")
    with pytest.raises(ConfigurationError, match="socket_timeout_s=0"):
        RedisStore(hosts=["127.0.0.1:1"], socket_timeout_s=0)
    with pytest.raises(ConfigurationError, match="capacity_per_node"):
        RedisStore(hosts=["127.0.0.1:1"], capacity_per_node=0)


def test_store_pickles_without_connections(redis_servers3: ClusterInfo) -> None:
    import pickle

    store = RedisStore(hosts=redis_servers3.hosts)
    store.set("p", b"1")
    clone = pickle.loads(pickle.dumps(store))
    assert clone._nodes is None and clone.get("p") == b"1"
    store.clear()


def test_rendezvous_hashing_is_balanced_and_moves_few_keys_when_a_node_is_added() -> None:
    keys = [f"ds:1:{i}" for i in range(6000)]
    three = RendezvousHash(["a:1", "b:1", "c:1"])
    four = RendezvousHash(["a:1", "b:1", "c:1", "d:1"])
    before = [three.node_of(k) for k in keys]
    after = [four.node_of(k) for k in keys]
    counts = [before.count(i) for i in range(3)]
    assert min(counts) > 1700, counts
    moved = sum(b != a for b, a in zip(before, after, strict=True))
    assert all(a == 3 for b, a in zip(before, after, strict=True) if b != a)  # only onto the new node
    assert moved < 0.3 * len(keys)  # ~1/4; modulo hashing would move ~3/4
    assert RendezvousHash(["c:1", "a:1", "b:1"]).node_ids[three.node_of("x")] != "" and \
        RendezvousHash(["c:1", "a:1", "b:1"]).node_ids[RendezvousHash(["c:1", "a:1", "b:1"]).node_of("x")] \
        == three.node_ids[three.node_of("x")]
