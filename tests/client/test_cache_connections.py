"""The connections a cache read holds from one batch to the next: one per node and thread, never out of step,
never shared with a forked DataLoader worker, given back when their thread ends."""

from __future__ import annotations

import gc
import threading
from typing import Any

import redis
import torch
from torch.utils.data import DataLoader

from bagua_lightning.client import CachedDataset
from bagua_lightning.services.redis_cluster import ClusterInfo
from tests.client.cache_datasets import Source
from tests.client.conftest import TEST_PASSWORD
from tests.client.test_cache_faults import FAST, check_batch


def connected_clients(info: ClusterInfo, password: str | None = None) -> int:
    total = 0
    for node in info.nodes:
        with redis.Redis(host=node.host, port=node.port, password=password) as c:
            total += int(c.info("clients")["connected_clients"]) - 1  # less this one
    return total


def test_a_held_connection_out_of_step_is_dropped_and_reads_recover(redis_standalone: ClusterInfo) -> None:
    ds = CachedDataset(Source(32), dataset_name="step", hosts=redis_standalone.hosts, password=TEST_PASSWORD,
                       outage_policy=FAST, retries=0)
    batch = list(range(16))
    check_batch(ds, batch)
    ds.flush()
    check_batch(ds, batch)
    assert ds.stats.hits == 16
    nodes: Any = ds.cache_loader.store.nodes  # type: ignore[attr-defined]
    (_, conn), = nodes.held._local.held.conns.values()
    conn.send_packed_command(conn.pack_command("PING"))  # a reply nobody will ask for, ahead of the next GETs
    check_batch(ds, batch)  # out of step: dropped, the batch comes from the source, still right
    assert ds.stats.errors == 1 and ds.stats.corrupt == 0
    assert conn._sock is None  # disconnected, never read again
    hits = ds.stats.hits
    for _ in range(20):  # a fresh connection: hits again once the outage back-off lets the store be tried
        check_batch(ds, batch)
        if ds.stats.hits > hits:
            break
        threading.Event().wait(0.05)
    assert ds.stats.hits == hits + 16 and ds.stats.corrupt == 0


def test_threads_read_together_and_give_their_connections_back(redis_cluster3: ClusterInfo) -> None:
    ds = CachedDataset(Source(96), dataset_name="threads", hosts=redis_cluster3.hosts, writer_buffer_size=16)
    batches = [list(range(s, s + 16)) for s in range(0, 96, 16)]
    for b in batches:
        check_batch(ds, b)
    ds.flush()
    check_batch(ds, batches[0])  # this thread holds its connections
    before = connected_clients(redis_cluster3)
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for r in range(30):
                check_batch(ds, batches[(k + r) % len(batches)])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert ds.stats.corrupt == 0 and ds.stats.hits == 16 + 4 * 30 * 16
    del threads
    gc.collect()
    assert connected_clients(redis_cluster3) <= before  # the ended threads' connections were given back


def test_forked_workers_never_use_the_parents_connections(redis_cluster3: ClusterInfo) -> None:
    source = Source(64)
    ds = CachedDataset(source, dataset_name="fork", hosts=redis_cluster3.hosts, writer_buffer_size=16)
    batches = [list(range(s, s + 16)) for s in range(0, 64, 16)]
    for b in batches:
        check_batch(ds, b)
    ds.flush()
    for b in batches:
        check_batch(ds, b)  # the parent holds connections when the workers fork
    loader = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="fork", shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        seen = 0
        for images, labels, _extra in loader:
            for image, label in zip(images, labels.tolist(), strict=True):
                assert torch.equal(image, source[label][0])
                seen += 1
            check_batch(ds, batches[seen // 16 - 1])  # the parent reads between the workers' batches
        assert seen == 64
    assert ds.stats.corrupt == 0 and ds.stats.errors == 0


def _fetch_in_child(nodes: Any, keys: list[bytes], out: Any) -> None:
    values, error = nodes.fetch(keys)
    (_, conn), = nodes.held._local.held.conns.values()
    out.send(([bytes(v) for v in values], repr(error), conn._sock.getsockname()))  # views of its receive buffer


def test_a_backend_used_across_a_fork_gives_the_child_its_own_connection(redis_standalone: ClusterInfo) -> None:
    import multiprocessing

    from bagua_lightning.client.cache.nodes import ServerNodes
    from bagua_lightning.client.cache.options import RedisOptions

    host, port = redis_standalone.nodes[0].host, redis_standalone.nodes[0].port
    nodes = ServerNodes([(host, port)], RedisOptions(password=TEST_PASSWORD))
    try:
        keys = [b"fork:%d" % i for i in range(8)]
        with redis.Redis(host=host, port=port, password=TEST_PASSWORD) as c:
            c.mset({k: b"v" + k for k in keys})
        assert nodes.fetch(keys)[0] == [b"v" + k for k in keys]
        (_, conn), = nodes.held._local.held.conns.values()
        mine = conn._sock.getsockname()
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_fetch_in_child, args=(nodes, keys, send))
        child.start()
        try:
            assert recv.poll(30)
            values, error, theirs = recv.recv()
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
        assert values == [b"v" + k for k in keys] and error == "None"
        assert theirs != mine  # its own TCP connection, not the parent's socket
        assert nodes.fetch(keys)[0] == [b"v" + k for k in keys]  # the parent's is still in step
        assert conn._sock is not None and conn._sock.getsockname() == mine
    finally:
        nodes.close()
