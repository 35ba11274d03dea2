"""Faults: Redis down, a server restarted, a cluster master killed mid-read. Never a wrong sample."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import redis

from bagua_lightning.client import CachedDataset
from bagua_lightning.client.cache import OutagePolicy
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, start_cluster, stop_cluster
from tests.client.cache_datasets import Source
from tests.client.conftest import free_port_block
from tests.procs import free_port

FAST = OutagePolicy(retry_initial_s=0.05, retry_max_s=0.2)


def check_batch(ds: CachedDataset, indices: list[int], seed: int = 0) -> None:
    reference = Source(len(ds), seed)
    for i, (image, label, extra) in zip(indices, ds.__getitems__(indices), strict=True):
        expected = reference[i]
        assert label == i and extra["id"] == expected[2]["id"]
        assert image.equal(expected[0])


def outage_warnings(caplog: pytest.LogCaptureFixture) -> int:
    return sum("unavailable" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_redis_down_from_the_start_loads_from_source_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bagua_lightning.client.cache")
    ds = CachedDataset(Source(32), dataset_name="down", hosts=[f"127.0.0.1:{free_port()}"],
                       outage_policy=FAST, retries=0, connect_timeout_s=0.5)
    for _ in range(3):
        for start in range(0, 32, 8):
            check_batch(ds, list(range(start, start + 8)))
            time.sleep(0.02)
    stats = ds.stats
    assert stats.hits == 0 and stats.misses == 96 and stats.errors >= 1
    assert outage_warnings(caplog) == 1


def test_caching_resumes_when_the_server_comes_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bagua_lightning.client.cache")
    spec = ClusterSpec(nodes=1, cluster=False, port=free_port_block(1, with_bus=False), state_root=tmp_path)
    info = start_cluster(spec)
    try:
        ds = CachedDataset(Source(16), dataset_name="restart", writer_buffer_size=1, hosts=info.hosts,
                           outage_policy=FAST, retries=0, connect_timeout_s=0.5)
        check_batch(ds, list(range(16)))
        check_batch(ds, list(range(16)))
        assert ds.stats.hits == 16
        stop_cluster(spec.port, tmp_path)
        for _ in range(3):
            check_batch(ds, list(range(16)))  # from the source, still correct
        assert outage_warnings(caplog) == 1
        start_cluster(spec)  # empty again: no persistence
        deadline = time.monotonic() + 20
        hits = ds.stats.hits
        while ds.stats.hits < hits + 16:
            assert time.monotonic() < deadline, ds.stats
            check_batch(ds, list(range(16)))
            time.sleep(0.05)
        assert any("is back" in r.getMessage() for r in caplog.records)
        assert outage_warnings(caplog) == 1
    finally:
        stop_cluster(spec.port, tmp_path)


def _cluster_ok_without(info: ClusterInfo, dead_port: int) -> bool:
    for n in info.nodes:
        if n.port == dead_port:
            continue
        with redis.Redis(host=n.host, port=n.port, socket_timeout=1) as c:
            state = c.execute_command("CLUSTER INFO")
            state = state if isinstance(state, dict) else {}
            if str(state.get("cluster_state")) != "ok":
                return False
    return True
