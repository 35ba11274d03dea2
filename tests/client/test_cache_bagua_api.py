"""Bagua's import paths for the sample cache, driven the way Bagua's own tests drive them, on real servers."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from torch.utils.data import Dataset

from bagua_lightning.services.redis_cluster import ClusterInfo
from bagua_lightning.torch_api.contrib.cache_loader import CacheLoader
from bagua_lightning.torch_api.contrib.cached_dataset import CachedDataset
from bagua_lightning.torch_api.contrib.utils.redis_store import (
    RedisStore,
    find_free_port,
    start_redis_server_cli,
)
from bagua_lightning.torch_api.contrib.utils.store import ClusterStore, Store


def bagua_check(store: Store) -> None:
    """The assertions of Bagua's store test."""
    store.clear()
    assert store.num_keys() == 0
    data = [np.random.rand(10) for _ in range(5)]
    store.set("1", pickle.dumps(data[1]))
    store.mset({"2": pickle.dumps(data[2]), "3": pickle.dumps(data[3]), "4": pickle.dumps(data[4])})
    ret = store.mget(["1", "2", "5"])
    assert (pickle.loads(ret[0]) == data[1]).all() and (pickle.loads(ret[1]) == data[2]).all()
    assert ret[2] is None
    assert (pickle.loads(store.get("4")) == data[4]).all() and store.get("6") is None
    assert store.num_keys() == 4
    assert store.status()


def _server_folders_under(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The detached servers' folders (Bagua's API leaves them, as its servers outlive the call) go to tmp_path."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # spawned children
    monkeypatch.setattr(tempfile, "tempdir", None)  # this process: recomputed from TMPDIR


@pytest.fixture
def three_servers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[dict[str, Any]]]:
    """Three servers started as Bagua's test starts them (a child process each), always shut down."""
    monkeypatch.delenv("BAGUA_LIGHTNING_REDIS_PASSWORD", raising=False)
    _server_folders_under(tmp_path, monkeypatch)
    ports: list[int] = []
    try:
        for _ in range(3):
            port = find_free_port()
            ports.append(port)
            proc = mp.get_context("spawn").Process(
                target=start_redis_server_cli, args=(port, 10_000_000, f"--cluster-config-file nodes{port}.conf"))
            proc.start()
            proc.join(60)
            assert proc.exitcode == 0
        yield [{"host": "127.0.0.1", "port": p} for p in ports]
    finally:
        for port in ports:
            try:
                with redis.Redis(port=port, socket_timeout=5) as client:
                    client.shutdown(nosave=True)
            except redis.ConnectionError:
                pass


def test_bagua_store_test_on_servers_started_like_bagua(three_servers: list[dict[str, Any]]) -> None:
    store = RedisStore(hosts=three_servers, cluster_mode=True)
    try:
        bagua_check(store)
        per_server = [redis.Redis(port=h["port"]).dbsize() for h in three_servers]
        assert sum(per_server) == 4
    finally:
        store.shutdown()


def test_started_server_is_loopback_only_and_takes_the_deployment_password(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", "from-the-deployment")
    _server_folders_under(tmp_path, monkeypatch)
    port = find_free_port()
    start_redis_server_cli(port, 10_000_000)
    try:
        with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis(port=port, password="from-the-deployment") as client:
            assert client.config_get("bind")["bind"] == "127.0.0.1"
            assert client.config_get("maxmemory")["maxmemory"] == "10000000"
        bagua_check(RedisStore(hosts=[{"host": "127.0.0.1", "port": str(port)}]))  # password from the env
    finally:
        with redis.Redis(port=port, password="from-the-deployment") as client:
            client.shutdown(nosave=True)


def test_cluster_store_shards_over_stores(redis_servers3: ClusterInfo, redis_cluster3: ClusterInfo) -> None:
    # Sharded over a set of servers and a Redis Cluster: any Store can be a shard.
    shards = [RedisStore(hosts=redis_servers3.hosts[:2]), RedisStore(hosts=redis_cluster3.hosts)]
    store = ClusterStore(shards)
    try:
        bagua_check(store)
        store.mset({f"k{i}": b"v" for i in range(200)})
        counts = [s.num_keys() for s in shards]
        assert sum(counts) == store.num_keys() == 204 and min(counts) > 60, counts
        loader = CacheLoader(dataset_name="sharded", store=store)
        assert [loader.get(i, lambda k: {"v": k}) for i in range(10)] == [{"v": i} for i in range(10)]
        again = CacheLoader(dataset_name="sharded", store=store)
        assert [again.get(i, lambda k: None) for i in range(10)] == [{"v": i} for i in range(10)]
        assert again.stats.hits == 10
        store.clear()
        assert store.num_keys() == 0
    finally:
        store.shutdown()


def test_cluster_store_rejects_what_is_not_a_list_of_stores() -> None:
    with pytest.raises(ValueError, match="non-empty list of Store"):
        ClusterStore([])
    with pytest.raises(ValueError, match="non-empty list of Store"):
        ClusterStore(["127.0.0.1:6379"])  # type: ignore[list-item]


class Pairs(Dataset[Any]):
    def __init__(self, size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.items = [(rng.random((5, 2)), rng.random(1)) for _ in range(size)]

    def __getitem__(self, i: int) -> Any:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)


def test_bagua_cached_dataset_test(redis_cluster3: ClusterInfo) -> None:
    RedisStore(hosts=redis_cluster3.hosts).clear()
    d1, d2 = Pairs(102, 1), Pairs(102, 2)
    c1 = CachedDataset(d1, backend="redis", dataset_name="d1", hosts=redis_cluster3.hosts)
    c2 = CachedDataset(d2, backend="redis", dataset_name="d2", hosts=redis_cluster3.hosts)
    for dataset, cached in ((d1, c1), (d2, c2)):
        for _ in range(3):
            for _ in cached:
                pass
        for i in range(len(dataset)):
            assert (dataset[i][0] == cached[i][0]).all() and (dataset[i][1] == cached[i][1]).all()
    assert c2.cache_loader.num_keys() == len(d1) + len(d2)
    c1.cache_loader.store.clear()


class HashStore(Store):
    """A user's own store (Bagua's extension point): entries in one Redis hash, only Bagua's operations."""

    def __init__(self, port: int, password: str | None) -> None:
        self.client = redis.Redis(port=port, password=password, socket_timeout=2, socket_connect_timeout=2)

    def mget(self, keys: list[str]) -> list[bytes | None]:  # type: ignore[override]
        return list(self.client.hmget("entries", keys)) if keys else []

    def mset(self, dictionary: dict[str, Any]) -> None:  # type: ignore[override]
        self.client.hset("entries", mapping=dictionary)

    def num_keys(self) -> int:
        return int(self.client.hlen("entries"))

    def clear(self) -> None:
        self.client.delete("entries")

    def status(self) -> bool:
        return bool(self.client.ping())

    def shutdown(self) -> None:
        self.client.close()


def test_a_users_store_gets_batched_fetch_and_put_that_never_raise(redis_standalone: ClusterInfo) -> None:
    from tests.client.conftest import TEST_PASSWORD

    store = HashStore(redis_standalone.nodes[0].port, TEST_PASSWORD)
    try:
        bagua_check(store)
        assert store.put([("4", b"new"), ("9", b"nine")], overwrite=False) == ([False, True], None)
        assert store.fetch(["4", "9", "x"]) == ([store.get("4"), b"nine", None], None)
        loader = CacheLoader(dataset_name="own", store=store, writer_buffer_size=1)
        assert loader.get(3, lambda k: ("three", k)) == ("three", 3)
        assert CacheLoader(dataset_name="own", store=store).get(3, lambda k: None) == ("three", 3)
        assert loader.stats.writes == 1
        pending = CacheLoader(dataset_name="own", store=store, writer_buffer_size=10)
        pending.get(4, lambda k: "four")
        pending.cleanup()  # writes what is pending, then closes the store
        assert store.get(pending.redis_key(4)) is not None
    finally:
        store.clear()
        store.shutdown()
    dead = HashStore(find_free_port(), None)
    values, error = dead.fetch(["a", "b"])
    assert values == [None, None] and isinstance(error, redis.ConnectionError)
    done, put_error = dead.put([("a", b"1")])
    assert done == [False] and isinstance(put_error, redis.ConnectionError)
    loader = CacheLoader(dataset_name="own", store=dead)
    assert [loader.get(i, lambda k: k * 2) for i in range(3)] == [0, 2, 4]  # from the source, no exception
    assert loader.stats.errors >= 1


def test_cluster_store_serves_the_live_shards_when_one_is_down(redis_servers3: ClusterInfo) -> None:
    live = RedisStore(hosts=redis_servers3.hosts[2:])
    dead = RedisStore(hosts=[f"127.0.0.1:{find_free_port()}"], retries=0, connect_timeout_s=0.5)
    store = ClusterStore([live, dead])
    try:
        live.clear()
        keys = [f"k{i}" for i in range(40)]
        done, error = store.put([(k, k.encode()) for k in keys])
        assert isinstance(error, redis.ConnectionError) and 0 < sum(done) < len(keys)
        values, error = store.fetch(keys)
        assert isinstance(error, redis.ConnectionError)
        assert [v for v, ok in zip(values, done, strict=True) if ok] == [k.encode() for k, ok in zip(keys, done,
                                                                                                   strict=True) if ok]
        assert all(v is None for v, ok in zip(values, done, strict=True) if not ok)
        with pytest.raises(redis.ConnectionError):
            store.mget(keys)
        assert store.status() is False and live.status() is True
    finally:
        live.clear()
        store.shutdown()
