"""Cache reads over TLS decrypted from memory (client/cache/tls_stream.py), against real redis-servers that serve
clients over TLS only (the deployment's CA, a client certificate, a password), as ``up`` deploys them."""

from __future__ import annotations

import contextlib
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bagua_lightning.client import CachedDataset, RedisStore
from bagua_lightning.client.cache.tls_stream import MemoryTLSConnection, TLSStream
from bagua_lightning.core.errors import UntrustedServerError
from bagua_lightning.core.redis_server import client_for
from bagua_lightning.core.tls_trust import ClientTLS
from bagua_lightning.services.redis_cluster import ClusterInfo
from bagua_lightning.services.redis_tls import client_tls, make_node_certificates
from tests.client.cache_datasets import Source
from tests.client.conftest import TEST_PASSWORD, deployment
from tests.client.test_cache_faults import check_batch
from tests.procs import recording_tls_server, wait_until


@pytest.fixture(scope="module", params=["servers", "cluster"])
def tls_deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[ClusterInfo, ClientTLS]]:
    """Three standalone servers, or a 3-master cluster, serving clients over TLS only."""
    cluster = request.param == "cluster"
    yield from ((info, _tls(info)) for info in deployment(
        tmp_path_factory.mktemp(f"tls-{request.param}"), nodes=3, cluster=cluster, bus_tls=True, client_tls=True,
        password=TEST_PASSWORD))


def _tls(info: ClusterInfo) -> ClientTLS:
    tls = client_tls(Path(str(info.tls_dir)))
    assert tls is not None
    return tls


def _held(ds: CachedDataset) -> list[Any]:
    nodes: Any = ds.cache_loader.store.nodes  # type: ignore[attr-defined]
    return [conn for _, conn in nodes.held._local.held.conns.values()]


def test_batches_read_over_tls_are_right_and_come_through_memory_decryption(
        tls_deployment: tuple[ClusterInfo, ClientTLS]) -> None:
    info, tls = tls_deployment
    source = Source(96)  # small samples: many replies per TLS record, replies across records
    ds = CachedDataset(source, dataset_name="tls-stream", hosts=info.hosts, password=TEST_PASSWORD,
                       tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key, writer_buffer_size=16)
    try:
        batches = [list(range(s, s + 32)) for s in range(0, 96, 32)]
        for b in batches:
            check_batch(ds, b)
        ds.flush()
        for _ in range(3):
            for b in reversed(batches):
                check_batch(ds, b)
        assert ds.stats.hits == 3 * 96 and ds.stats.corrupt == 0 and ds.stats.errors == 0
        held = _held(ds)
        assert held and all(type(c) is MemoryTLSConnection and isinstance(c._sock, TLSStream) for c in held)
        assert all(c._sock.version() == "TLSv1.3" for c in held)
        assert all(c._sock.pending() == 0 for c in held)  # every reply read, nothing left behind
    finally:
        ds.cache_loader.cleanup()


def test_values_larger_than_the_chunk_and_of_every_size_round_trip(tls_deployment: tuple[ClusterInfo, ClientTLS]
                                                                   ) -> None:
    info, tls = tls_deployment
    store = RedisStore(hosts=info.hosts, password=TEST_PASSWORD, tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key)
    try:
        g = torch.Generator().manual_seed(1)
        sizes = [0, 1, 5, 16383, 16384, 16385, 65536, 300_000, 1 << 20]  # around a record, a chunk, beyond
        values = {f"tls-size:{n}": bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist())
                  for n in sizes}
        store.mset(values)
        for _ in range(2):
            assert store.mget([*values, "tls-size:missing"]) == [*values.values(), None]
    finally:
        store.clear()
        store.shutdown()


def test_each_nodes_replies_are_decrypted_on_its_own_persistent_thread(
        tls_deployment: tuple[ClusterInfo, ClientTLS]) -> None:
    info, tls = tls_deployment
    store = RedisStore(hosts=info.hosts, password=TEST_PASSWORD, tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key)
    threads: set[threading.Thread] = set()
    try:
        g = torch.Generator().manual_seed(2)
        values = {f"tls-par:{i}": bytes(torch.randint(0, 256, (1000 + 37 * i,), generator=g, dtype=torch.uint8)
                                        .tolist()) for i in range(90)}
        store.mset(values)
        keys = [*values, "tls-par:missing"]
        store.nodes.held.decrypt_threads = True  # type: ignore[attr-defined]  # also on a machine of few cores
        for round_ in range(5):
            assert store.mget(keys) == [*values.values(), None], round_
            # One worker per node but the first (the reading thread decrypts that one), kept from batch to batch.
            workers = store.nodes.held._local.held.workers._workers  # type: ignore[attr-defined]
            assert len(workers) == 2 and all(w.thread.is_alive() for w in workers.values())
            threads |= {w.thread for w in workers.values()}
        assert len(threads) == 2
        # A node closes our connections between batches: its keys fail once (the worker meets the end of the
        # stream and hands it to the reader), the other nodes' values are right, and the next batch reconnects.
        for host, port in ((h["host"], h["port"]) for h in info.hosts):
            with client_for(host, int(port), TEST_PASSWORD, tls=tls) as admin:
                admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        values_now, error = store.fetch(keys)
        assert error is not None
        assert all(v is None or v == values[k] for k, v in zip(keys, values_now, strict=False))

        def all_served() -> bool:  # the failed nodes back off; their keys come back once they are tried again
            got, error = store.fetch(keys)
            return error is None and got == [*values.values(), None]
        wait_until(all_served, 30, "every node to serve the batch again")
        workers = store.nodes.held._local.held.workers._workers  # type: ignore[attr-defined]
        assert {w.thread for w in workers.values()} == threads  # the same workers served the new connections
    finally:
        store.clear()
        store.shutdown()
    wait_until(lambda: not any(t.is_alive() for t in threads), 30, "the decrypting threads to end with the store")


@contextlib.contextmanager
def _other_ca_server(tmp: Path, received: bytearray) -> Iterator[int]:
    """A TLS server with a certificate of another CA, recording every byte it decrypts."""
    make_node_certificates(tmp, [1], ["127.0.0.1"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp / "node-1.crt", tmp / "node-1.key")
    with recording_tls_server(context, received) as port:
        yield port


def test_a_server_of_another_ca_fails_the_handshake_and_gets_no_password(
        tls_deployment: tuple[ClusterInfo, ClientTLS], tmp_path: Path) -> None:
    _, tls = tls_deployment
    received = bytearray()
    with _other_ca_server(tmp_path / "other", received) as port:
        conn = MemoryTLSConnection(host="127.0.0.1", port=port, password="never-sent", ssl_ca_certs=tls.ca,
                                   ssl_certfile=tls.cert, ssl_keyfile=tls.key, socket_timeout=5,
                                   socket_connect_timeout=5)
        with pytest.raises(Exception) as excinfo:
            conn.connect()
        conn.disconnect()
        # The error redis-py's SSLSocket gives, so the store names the server as not the deployment's.
        assert isinstance(excinfo.value.__context__, ssl.SSLCertVerificationError), repr(excinfo.value)
        store = RedisStore(hosts=[f"127.0.0.1:{port}"], password="never-sent", tls_ca=tls.ca, tls_cert=tls.cert,
                           tls_key=tls.key, retries=0)
        try:
            with pytest.raises(UntrustedServerError, match=f"127.0.0.1:{port} is not this deployment's"):
                store.mget(["k"])
        finally:
            store.shutdown()
    assert bytes(received) == b""


def test_the_pinned_ca_is_the_only_root(tmp_path: Path) -> None:
    make_node_certificates(tmp_path, [1], ["127.0.0.1"])
    conn = MemoryTLSConnection(host="127.0.0.1", port=1, ssl_ca_certs=str(tmp_path / "ca.crt"),
                               ssl_cert_reqs="none", ssl_check_hostname=False)  # cannot be weakened
    context = conn.tls.context()
    assert [c["subject"] for c in context.get_ca_certs()] == [c["subject"] for c in
                                                             _loaded(str(tmp_path / "ca.crt")).get_ca_certs()]
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


def _loaded(ca: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(ca)
    return context
