"""Open reads: a keyed loader reads its sealed entries from the nodes' plaintext read ports, as the
password-less reader, never with a secret (docs/deployment.md, "Open reads"). Real TLS clusters of real
redis-servers; the squatter is a real listener on the read ports."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.client import CachedDataset, RedisStore
from bagua_lightning.client.cache import codec
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.read_plane import READER_USER, SEALED_KEY_PREFIX
from bagua_lightning.core.redis_server import client_for
from bagua_lightning.core.tls_trust import ClientTLS
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, running_cluster
from bagua_lightning.services.redis_tls import client_tls
from tests.client.cache_datasets import Source
from tests.client.conftest import TEST_PASSWORD
from tests.client.test_cache_faults import check_batch
from tests.procs import free_port_block

CACHE_KEY = b"open-reads cache key"


@pytest.fixture(scope="module")
def sealed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterInfo, ClientTLS]]:
    """Three masters serving clients over TLS, each with its read port, as ``up`` deploys them."""
    spec = ClusterSpec(nodes=3, port=free_port_block(3, tls=True), state_root=tmp_path_factory.mktemp("open"),
                       timeout_s=60.0, bus_tls=True, client_tls=True, read_port_offset=20000,
                       password=TEST_PASSWORD)
    with running_cluster(spec) as info:
        tls = client_tls(Path(str(info.tls_dir)))
        assert tls is not None and info.read_port_offset is not None
        yield info, tls


def _dataset(info: ClusterInfo, tls: ClientTLS, name: str, source: Any, **kwargs: Any) -> CachedDataset:
    kwargs.setdefault("read_port_offset", info.read_port_offset)
    return CachedDataset(source, dataset_name=name, hosts=info.hosts, password=TEST_PASSWORD, tls_ca=tls.ca,
                         tls_cert=tls.cert, tls_key=tls.key, writer_buffer_size=16, cache_key=CACHE_KEY, **kwargs)


def _cache_then_read(ds: CachedDataset, n: int = 32) -> None:
    """Read samples 0..n-1 twice, flushing what the first read cached; both reads checked against the source."""
    check_batch(ds, list(range(n)))
    ds.flush()
    check_batch(ds, list(range(n)))


def _admin(info: ClusterInfo, tls: ClientTLS, node: int = 0) -> Any:
    """An administrator's connection to one node (TLS, the password)."""
    return contextlib.closing(client_for(info.nodes[node].host, info.nodes[node].port, TEST_PASSWORD, tls=tls))


def _scan(info: ClusterInfo, tls: ClientTLS, match: str) -> dict[bytes, bytes]:
    """The keys matching ``match`` on every node, with their values."""
    out = {}
    for i in range(len(info.nodes)):
        with _admin(info, tls, i) as c:
            out.update({k: c.get(k) for k in c.scan_iter(match=match)})
    return out


def _reader_connections(info: ClusterInfo, tls: ClientTLS) -> int:
    """Connections of the reader, over all nodes."""
    total = 0
    for i in range(len(info.nodes)):
        with _admin(info, tls, i) as c:
            for line in c.execute_command("CLIENT", "LIST", "TYPE", "normal").decode().splitlines():
                total += f" user={READER_USER} " in f" {line} "
    return total


def test_a_keyed_loader_reads_sealed_entries_from_the_read_ports(
        sealed_cluster: tuple[ClusterInfo, ClientTLS]) -> None:
    info, tls = sealed_cluster
    ds = _dataset(info, tls, "open-reads", Source(64))
    try:
        batches = [list(range(s, s + 16)) for s in range(0, 64, 16)]
        for b in batches:
            check_batch(ds, b)
        ds.flush()
        for b in reversed(batches):
            check_batch(ds, b)
        assert ds.stats.hits == 64 and ds.stats.corrupt == 0 and ds.stats.errors == 0
        assert _reader_connections(info, tls) == 3  # the hits came through the read ports, as the reader
        backend: Any = ds.cache_loader.store.nodes  # type: ignore[attr-defined]
        ports = {client.connection_pool.connection_kwargs["port"] for client in backend.reads.clients()}
        assert ports == {node.port + info.read_port_offset for node in info.nodes}
        assert all(c.connection_pool.connection_kwargs["password"] == "" for c in backend.reads.clients())
        # what the nodes hold is ciphertext: no sample's bytes appear in its entry
        with _admin(info, tls) as c:
            keys = [k for k in c.scan_iter(match=f"{SEALED_KEY_PREFIX}open-reads:*")]
            assert keys
            value = c.get(keys[0])
        index = int(keys[0].rsplit(b":", 1)[1])
        plain = ds.dataset[index][0].numpy().tobytes()  # type: ignore[index]
        assert value[4] == codec.DIGEST_SEAL and plain[:64] not in value
    finally:
        ds.cache_loader.cleanup()


def test_the_reader_reads_sealed_entries_only(sealed_cluster: tuple[ClusterInfo, ClientTLS]) -> None:
    """Entries in clear (an unkeyed cache, a loader with ``seal=False``, ``RedisStore.set``) are stored apart from
    the sealed ones and the password-less reader gets ``NOPERM`` for them; nobody can store a clear value under
    the sealed prefix through ``RedisStore``."""
    info, tls = sealed_cluster
    clear = CachedDataset(Source(16), dataset_name="open-reads-clear", hosts=info.hosts, password=TEST_PASSWORD,
                          tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key, writer_buffer_size=4, cache_key=b"")
    gmac = _dataset(info, tls, "open-reads-gmac", Source(16))
    gmac.cache_loader.seal = False  # authenticated, in clear
    sealed = _dataset(info, tls, "open-reads-gmac", Source(16))  # the same name: its entries live apart
    store = RedisStore(hosts=info.hosts, password=TEST_PASSWORD, tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key)
    try:
        for ds in (clear, gmac, sealed):
            _cache_then_read(ds, 16)
            assert ds.stats.hits == 16 and ds.stats.corrupt == 0
        store.set("cfg", b"db_password=swordfish")
        with pytest.raises(ConfigurationError, match="sealed cache entries only"):
            store.set(f"{SEALED_KEY_PREFIX}cfg", b"db_password=swordfish")
        unkeyed, gmacs = _scan(info, tls, "open-reads-clear:*"), _scan(info, tls, "open-reads-gmac:*")
        sealed_entries = _scan(info, tls, f"{SEALED_KEY_PREFIX}open-reads-gmac:*")
        assert len(unkeyed) == len(gmacs) == len(sealed_entries) == 16
        assert {v[4] for v in unkeyed.values()} == {codec.default_digest_kind()}
        assert {v[4] for v in gmacs.values()} == {codec.DIGEST_GMAC}
        assert {v[4] for v in sealed_entries.values()} == {codec.DIGEST_SEAL}
        plain = [*unkeyed, *gmacs]
        from bagua_lightning.core.redis_server import reader_client

        refused = 0
        for node in info.masters:
            with contextlib.closing(reader_client(node.host, node.port + int(info.read_port_offset or 0))) as r:
                for key in [b"cfg", *plain]:
                    try:
                        r.get(key)
                    except Exception as exc:  # redis.NoPermissionError: the key is not the reader's
                        assert "NOPERM" in str(exc) or "permission" in str(exc).lower(), exc
                        refused += 1
        assert refused == len(info.masters) * (1 + len(plain))
        from bagua_lightning.client.cache.catalog import remove_dataset

        assert remove_dataset(store, "open-reads-gmac") == 32  # forgetting a dataset removes both kinds
        assert not _scan(info, tls, f"{SEALED_KEY_PREFIX}open-reads-gmac:*")
    finally:
        store.shutdown()
        for ds in (clear, gmac, sealed):
            ds.cache_loader.cleanup()


def test_a_standalone_server_is_read_from_its_read_port_too(tmp_path: Path) -> None:
    spec = ClusterSpec(nodes=1, cluster=False, port=free_port_block(1, with_bus=False, tls=True), state_root=tmp_path,
                       timeout_s=60.0, client_tls=True, read_port_offset=20000, password=TEST_PASSWORD)
    with running_cluster(spec) as info:
        tls = client_tls(Path(str(info.tls_dir)))
        assert tls is not None
        ds = _dataset(info, tls, "open-reads-single", Source(32))
        try:
            _cache_then_read(ds)
            assert ds.stats.hits == 32 and ds.stats.corrupt == 0 and ds.stats.errors == 0
            assert _reader_connections(info, tls) == 1
        finally:
            ds.cache_loader.cleanup()


def test_keys_the_reader_may_not_read_come_through_the_client_port(
        sealed_cluster: tuple[ClusterInfo, ClientTLS]) -> None:
    info, tls = sealed_cluster
    # "bagua_lightning" is the protected prefix of the service's plans: the reader gets NOPERM for these keys
    ds = _dataset(info, tls, "bagua_lightning", Source(32))
    try:
        _cache_then_read(ds)
        assert ds.stats.hits == 32 and ds.stats.misses == 32 and ds.stats.corrupt == 0
    finally:
        ds.cache_loader.cleanup()


def test_a_read_port_that_does_not_answer_leaves_reads_on_the_client_port(
        sealed_cluster: tuple[ClusterInfo, ClientTLS], caplog: pytest.LogCaptureFixture) -> None:
    info, tls = sealed_cluster
    closed = free_port_block(3, with_bus=False)  # nothing listens there
    ds = _dataset(info, tls, "open-reads-closed", Source(32), read_port_offset=closed - info.nodes[0].port)
    try:
        check_batch(ds, list(range(32)))
        ds.flush()
        with caplog.at_level(logging.WARNING, logger="bagua_lightning.client.cache.nodes"):
            check_batch(ds, list(range(32)))
        assert ds.stats.hits == 32 and ds.stats.corrupt == 0
        assert "read port" in caplog.text and "reading through its client port" in caplog.text
    finally:
        ds.cache_loader.cleanup()


class Squatter:
    """Plain listeners on the read ports that answer as Redis would, with forged entries, and keep every byte
    they receive."""

    def __init__(self, ports: list[int], forge: Any, refuse_auth: bool = False, hang_up: bool = False) -> None:
        self.refuse_auth = refuse_auth
        self.hang_up = hang_up  # close the connection at the first GET
        self.received = bytearray()
        self.forge = forge
        self.lock = threading.Lock()
        self.socks = []
        for port in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            self.socks.append(s)
        self.threads = [threading.Thread(target=self._accept, args=(s,), daemon=True) for s in self.socks]
        for t in self.threads:
            t.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with self.lock:
                    self.received += data
                buf += data
                if self.hang_up and b"GET" in buf:
                    return
                replies, buf = self._commands(buf)
                try:
                    conn.sendall(replies)
                except OSError:
                    return

    def _commands(self, buf: bytes) -> tuple[bytes, bytes]:
        """The replies to every whole RESP command in ``buf``, and what is left of it."""
        out = b""
        while buf.startswith(b"*") and b"\r\n" in buf:
            head, rest = buf.split(b"\r\n", 1)
            args = []
            for _ in range(int(head[1:])):
                if b"\r\n" not in rest:
                    return out, buf
                size_line, rest = rest.split(b"\r\n", 1)
                size = int(size_line[1:])
                if len(rest) < size + 2:
                    return out, buf
                args.append(rest[:size])
                rest = rest[size + 2:]
            buf = rest
            if self.refuse_auth and b"AUTH" in [a.upper() for a in args[:3]]:  # AUTH, or HELLO 3 AUTH
                out += b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
            elif args[0].upper() == b"GET":
                value = bytes(self.forge(args[1]))
                out += b"$%d\r\n%s\r\n" % (len(value), value)
            else:
                out += b"+OK\r\n"
        return out, buf

    def close(self) -> None:
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            s.close()
        for t in self.threads:
            t.join(timeout=5)


def test_a_squatter_on_the_read_ports_gets_no_secret_and_its_replies_are_misses(
        sealed_cluster: tuple[ClusterInfo, ClientTLS]) -> None:
    info, tls = sealed_cluster
    source = Source(32)
    rogue_base = free_port_block(3, with_bus=False)
    # forgeries a squatter can make: an entry sealed with another key, and a genuine-looking unkeyed one
    forgeries = [lambda key: codec.encode(source[0], key, secret=b"the squatter's key"),
                 lambda key: codec.encode(source[0], key)]
    squatter = Squatter([rogue_base + i for i in range(3)], forgeries[0])
    try:
        for forge in forgeries:
            squatter.forge = forge
            ds = _dataset(info, tls, "open-reads-squatted", source, read_port_offset=rogue_base - info.nodes[0].port)
            try:
                check_batch(ds, list(range(32)))  # misses: loaded and written through the client port (TLS)
                ds.flush()
                check_batch(ds, list(range(32)))  # every forged reply is a miss; the samples are the source's
                assert ds.stats.hits == 0 and ds.stats.corrupt == 64, ds.stats
            finally:
                ds.cache_loader.cleanup()
    finally:
        squatter.close()
    assert b"GET" in squatter.received and READER_USER.encode() in squatter.received
    for secret in (TEST_PASSWORD.encode(), CACHE_KEY, Path(tls.key).read_bytes()[40:80]):
        assert secret not in squatter.received


def test_a_read_port_that_refuses_the_reader_leaves_reads_on_the_client_port(
        sealed_cluster: tuple[ClusterInfo, ClientTLS], caplog: pytest.LogCaptureFixture) -> None:
    info, tls = sealed_cluster
    source = Source(32)
    rogue_base = free_port_block(3, with_bus=False)
    squatter = Squatter([rogue_base + i for i in range(3)], lambda key: b"", refuse_auth=True)
    ds = _dataset(info, tls, "open-reads-refused", source, read_port_offset=rogue_base - info.nodes[0].port)
    try:
        with caplog.at_level(logging.WARNING, logger="bagua_lightning.client.cache.nodes"):
            _cache_then_read(ds)
        assert ds.stats.misses == 32 and ds.stats.hits == 32 and ds.stats.corrupt == 0, ds.stats
        assert caplog.text.count("reading through its client port") == 3  # once per node
    finally:
        ds.cache_loader.cleanup()
        squatter.close()
    assert b"GET" not in squatter.received and TEST_PASSWORD.encode() not in squatter.received


def test_a_read_port_that_hangs_up_mid_read_costs_the_master_nothing(
        sealed_cluster: tuple[ClusterInfo, ClientTLS], caplog: pytest.LogCaptureFixture) -> None:
    # The read port breaks off after the GETs were sent: its keys are read again through the client port in the
    # same fetch, and the master is not taken for down (no backing off, no error).
    info, tls = sealed_cluster
    rogue_base = free_port_block(3, with_bus=False)
    squatter = Squatter([rogue_base + i for i in range(3)], lambda key: b"", hang_up=True)
    ds = _dataset(info, tls, "open-reads-hang-up", Source(32))
    try:
        check_batch(ds, list(range(32)))
        ds.flush()
        reader = _dataset(info, tls, "open-reads-hang-up", Source(32), read_port_offset=rogue_base - info.nodes[0].port)
        with caplog.at_level(logging.WARNING, logger="bagua_lightning.client.cache.nodes"):
            check_batch(reader, list(range(32)))
            check_batch(reader, list(range(32)))
        assert reader.stats.hits == 64 and reader.stats.errors == 0 and reader.stats.corrupt == 0, reader.stats
        assert caplog.text.count("reading through its client port") == 3
        assert b"GET" in squatter.received
    finally:
        ds.cache_loader.cleanup()
        squatter.close()


@pytest.mark.parametrize("bad", [0, "20000", True, 70000, -70000, 1.5])
def test_a_bad_read_port_offset_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(f"read_port_offset={bad!r}")):
        RedisStore(hosts=["127.0.0.1:7000"], read_port_offset=bad)
