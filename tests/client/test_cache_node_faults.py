"""Nodes dying under the sample cache: a dead master costs only its own keys, no Redis failure reaches
training (parent and DataLoader workers, fork and spawn), caching resumes when the servers are back.

Real redis-server processes killed with SIGKILL; every cluster a test starts is stopped, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.exceptions
from redis.crc import key_slot
from torch.utils.data import DataLoader

from bagua_lightning.client import CachedDataset
from bagua_lightning.client.cache import OutagePolicy, RedisStore
from bagua_lightning.client.cache.nodes import STORE_ERRORS
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, start_cluster, stop_cluster
from tests.client.cache_datasets import Source
from tests.client.conftest import free_port_block
from tests.client.test_cache_faults import _cluster_ok_without, check_batch, outage_warnings
from tests.procs import free_port

FAST = OutagePolicy(retry_initial_s=0.05, retry_max_s=0.2)
STORE_OPTIONS = {"outage_policy": FAST, "retries": 0, "connect_timeout_s": 0.5, "socket_timeout_s": 2.0}


@contextlib.contextmanager
def own_cluster(root: Path, **kwargs: object) -> Iterator[tuple[ClusterSpec, ClusterInfo]]:
    """A cluster for one test (it kills nodes): always stopped and removed after."""
    nodes = int(kwargs.get("nodes", 3)) * (1 + int(kwargs.get("replicas", 0)))  # type: ignore[call-overload]
    spec = ClusterSpec(port=free_port_block(nodes), state_root=root, timeout_s=60.0, **kwargs)  # type: ignore[arg-type]
    info = start_cluster(spec)
    try:
        yield spec, info
    finally:
        stop_cluster(spec.port, root)


def slots_of(info: ClusterInfo, port: int) -> set[int]:
    """The slots the master on ``port`` serves, as the cluster says."""
    live = next(n for n in info.masters if n.port == port)
    with redis.Redis(host=live.host, port=live.port) as c:
        nodes = c.execute_command("CLUSTER NODES")
    out: set[int] = set()
    for lo, hi in nodes[f"{live.host}:{live.port}"]["slots"]:
        out |= set(range(int(lo), int(hi) + 1))
    return out


def batches(n: int, size: int = 20) -> list[list[int]]:
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]


def read_epoch(ds: CachedDataset, n: int) -> int:
    """Read every sample once, checking each; the hits of this pass."""
    hits = ds.stats.hits
    for b in batches(n):
        check_batch(ds, b)
    return ds.stats.hits - hits


def test_every_redis_exception_is_a_store_error() -> None:
    classes = [c for c in vars(redis.exceptions).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert redis.exceptions.RedisClusterException in classes and redis.exceptions.SlotNotCoveredError in classes
    assert [c.__name__ for c in classes if not issubclass(c, STORE_ERRORS)] == []
    assert issubclass(TimeoutError, STORE_ERRORS) and issubclass(ConnectionRefusedError, STORE_ERRORS)


def test_one_master_killed_keys_of_the_live_masters_keep_hitting_and_being_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bagua_lightning.client.cache")
    n = 150
    with own_cluster(tmp_path) as (_, info):
        ds = CachedDataset(Source(n), dataset_name="one-dead", writer_buffer_size=1000, hosts=info.hosts,
                           **STORE_OPTIONS)
        read_epoch(ds, n)
        ds.flush()
        assert read_epoch(ds, n) == n
        victim = info.masters[1]
        dead = slots_of(info, victim.port)
        on_live = [i for i in range(n) if key_slot(ds.cache_loader.redis_key(i).encode()) not in dead]
        assert 0.5 * n < len(on_live) < 0.8 * n
        os.kill(victim.pid, signal.SIGKILL)
        for _ in range(4):  # every key of a live master hits in every pass, the first one included
            assert read_epoch(ds, n) == len(on_live)
        stats = ds.stats
        assert stats.corrupt == 0 and stats.errors >= 1
        assert outage_warnings(caplog) == 1

        # Writes during the outage land on the live masters; the dead master's keys count as failed.
        fresh = CachedDataset(Source(n), dataset_name="written-during", writer_buffer_size=1000, hosts=info.hosts,
                              **STORE_OPTIONS)
        assert read_epoch(fresh, n) == 0
        fresh.flush()
        on_live_fresh = [i for i in range(n) if key_slot(fresh.cache_loader.redis_key(i).encode()) not in dead]
        assert fresh.stats.writes == len(on_live_fresh)
        assert fresh.stats.write_errors == n - len(on_live_fresh)
        assert read_epoch(fresh, n) == len(on_live_fresh)
        first = info.masters[0]
        mine = slots_of(info, first.port)
        keys = [fresh.cache_loader.redis_key(i) for i in on_live_fresh]
        keys = [k for k in keys if key_slot(k.encode()) in mine]
        with redis.Redis(host=first.host, port=first.port) as c:  # really on the live master
            assert keys and all(c.exists(k) for k in keys)
        assert outage_warnings(caplog) == 2  # one per store (each dataset has its own) and outage


def test_replicated_master_killed_reads_go_on_and_return_to_hits_after_failover(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bagua_lightning.client.cache")
    n = 150
    with own_cluster(tmp_path, replicas=1, node_timeout_ms=1000) as (_, info):
        ds = CachedDataset(Source(n), dataset_name="failover", writer_buffer_size=1000, hosts=info.hosts,
                           **STORE_OPTIONS)
        read_epoch(ds, n)
        ds.flush()
        for node in info.masters:  # the replicas hold every entry before the kill
            with redis.Redis(host=node.host, port=node.port) as c:
                assert c.execute_command("WAIT", 1, 5000) == 1
        assert read_epoch(ds, n) == n
        victim = info.masters[1]
        dead = slots_of(info, victim.port)
        on_live = sum(key_slot(ds.cache_loader.redis_key(i).encode()) not in dead for i in range(n))
        os.kill(victim.pid, signal.SIGKILL)
        assert read_epoch(ds, n) >= on_live  # the live masters keep serving while the replica takes over
        deadline = time.monotonic() + 60
        while True:  # failover: reads stay correct all along
            ok = _cluster_ok_without(info, victim.port) and _promoted(info, victim.port)
            hits = read_epoch(ds, n)
            if ok:
                break
            assert hits >= on_live
            assert time.monotonic() < deadline, "the replica was not promoted in time"
            time.sleep(0.05)
        # The cluster says the replica serves: within a couple of passes (the slot map is reloaded at most
        # twice a second) every sample is a hit again.
        best = max(read_epoch(ds, n) for _ in range(2))
        time.sleep(0.6)
        best = max(best, read_epoch(ds, n))
        assert best >= 0.9 * n, ds.stats
        assert read_epoch(ds, n) == n
        assert ds.stats.corrupt == 0
        assert outage_warnings(caplog) == 1
        assert any("is back" in r.getMessage() for r in caplog.records)


def _promoted(info: ClusterInfo, dead_port: int) -> bool:
    """Whether a replica of the dead master is a master now (seen by a live master)."""
    live = next(n for n in info.masters if n.port != dead_port)
    with redis.Redis(host=live.host, port=live.port, socket_timeout=1) as c:
        nodes = c.execute_command("CLUSTER NODES")
    replica_ports = {n.port for n in info.nodes if n.role == "replica"}
    return any(int(addr.rsplit(":", 1)[1]) in replica_ports and "master" in v["flags"] and v["slots"]
               for addr, v in nodes.items())


def _kill_all(info: ClusterInfo) -> None:
    for node in info.nodes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_every_server_killed_mid_epoch_under_dataloader_workers(tmp_path: Path, start_method: str) -> None:
    n, size = 192, 8
    with own_cluster(tmp_path) as (spec, info):
        # writer_buffer_size=1: nothing waits in a worker's write buffer (a read of a buffered key
        # is a hit without the store, which would blur "all from the source" below).
        ds = CachedDataset(Source(n), dataset_name=f"all-dead-{start_method}", writer_buffer_size=1,
                           hosts=info.hosts, **STORE_OPTIONS)
        loaders = [DataLoader(ds, batch_size=size, shuffle=True, num_workers=2, persistent_workers=True,
                              multiprocessing_context=start_method, collate_fn=list)]
        reference = Source(n)

        def epoch(kill_at: int | None = None) -> None:
            seen: list[int] = []
            for k, batch in enumerate(loaders[0]):
                if k == kill_at:
                    _kill_all(info)
                for image, label, extra in batch:
                    expected = reference[label]
                    assert image.equal(expected[0]) and extra["id"] == expected[2]["id"]
                    seen.append(label)
            assert sorted(seen) == list(range(n))  # every sample once, none lost, none twice

        epoch()
        epoch()
        deadline = time.monotonic() + 60
        while ds.stats.hits == 0:  # entries are written by the workers as they go
            assert time.monotonic() < deadline, ds.stats
            epoch()
        epoch(kill_at=5)  # every server killed mid-epoch
        hits = ds.stats.hits
        epoch()  # all from the source
        assert ds.stats.hits == hits
        stop_cluster(spec.port, tmp_path)  # records and data of the dead deployment
        start_cluster(spec)  # the same ports again, empty
        deadline = time.monotonic() + 60
        while ds.stats.hits == hits:  # the same workers reconnect and cache again
            assert time.monotonic() < deadline, ds.stats
            epoch()
        assert ds.stats.corrupt == 0 and ds.stats.errors >= 1
        loaders.clear()  # the persistent workers stop with their loader


def test_nothing_answers_creation_and_reads_never_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bagua_lightning.client.cache")
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    store = RedisStore(hosts=dead, **STORE_OPTIONS)
    values, error = store.fetch(["a", "b"])
    assert values == [None, None] and isinstance(error, STORE_ERRORS)
    assert store.put([("a", b"1")])[0] == [False] and store.status() is False
    services = tmp_path / "services.json"
    services.write_text(json.dumps({"version": 2, "deployment": "gone", "redis": {
        "hosts": [{"host": "127.0.0.1", "port": int(h.rsplit(":", 1)[1])} for h in dead], "cluster": True}}))
    monkeypatch.setenv("BAGUA_LIGHTNING_SERVICES_FILE", str(services))
    monkeypatch.delenv("BAGUA_LIGHTNING_REDIS_HOSTS", raising=False)
    ds = CachedDataset(Source(16), dataset_name="nothing", **STORE_OPTIONS)  # hosts from the services file
    for _ in range(3):
        check_batch(ds, list(range(16)))
    assert ds.stats.hits == 0 and ds.stats.misses == 48
    assert outage_warnings(caplog) == 2  # the store above and this dataset's: one each


def test_a_stale_slot_map_is_reloaded_and_every_sample_stays_correct(redis_cluster3: ClusterInfo) -> None:
    n = 120
    ds = CachedDataset(Source(n), dataset_name="stale-map", writer_buffer_size=1000, hosts=redis_cluster3.hosts,
                       **STORE_OPTIONS)
    read_epoch(ds, n)
    ds.flush()
    assert read_epoch(ds, n) == n
    store = ds.cache_loader.store
    assert isinstance(store, RedisStore)
    nodes = store.nodes
    primaries, table = nodes._slot_table()  # type: ignore[attr-defined]
    nodes._slots = (primaries, [0] * len(table))  # type: ignore[attr-defined]  # every slot on master 0: MOVEDs
    nodes._next_refresh = 0.0  # type: ignore[attr-defined]
    assert read_epoch(ds, n) == n  # redirected keys read again through the reloaded map
    assert read_epoch(ds, n) == n and ds.stats.corrupt == 0
