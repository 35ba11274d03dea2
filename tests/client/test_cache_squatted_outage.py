"""One warning per outage, even when a squatter holds the dead node's read port and answers every read with nil.

A real TLS deployment with read ports (as ``up`` runs it); one node killed with SIGKILL; a real listener takes
its read port. Whatever answers there is not the node: the node's outage lasts until its client port (TLS, the
password) answers again, so the squatter's answers neither end the outage nor start a new one at every try.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.client import CachedDataset
from bagua_lightning.client.cache import OutagePolicy
from bagua_lightning.core.redis_server import CONFIG_FILE, redis_server_binary
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, start_cluster, stop_cluster
from bagua_lightning.services.redis_tls import client_tls
from tests.client.cache_datasets import Source
from tests.client.conftest import TEST_PASSWORD
from tests.client.test_cache_faults import check_batch
from tests.procs import bindable, free_port_block, stop_process, wait_until

CACHE_KEY = b"squatted-outage cache key"
FAST = OutagePolicy(retry_initial_s=0.05, retry_max_s=0.2)  # many tries of the dead node in a few seconds
READ_PORT_OFFSET = 20000
N = 48
CACHE_LOGGER = "bagua_lightning.client.cache"


class NilSquatter:
    """A listener on one port that answers every RESP command with a nil (``$-1``); with ``accept_reader`` it
    answers ``AUTH`` with ``+OK`` (so the reader's connection is set up and its ``GET``\\s are answered nil)."""

    def __init__(self, port: int, accept_reader: bool) -> None:
        self.accept_reader = accept_reader
        self.gets = 0
        self.commands = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

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
                buf += data
                names, buf = _commands(buf)
                with self._lock:
                    self.commands += len(names)
                    self.gets += sum(name in (b"GET", b"MGET") for name in names)
                replies = b"".join(b"+OK\r\n" if self.accept_reader and name == b"AUTH" else b"$-1\r\n"
                                   for name in names)
                try:
                    conn.sendall(replies)
                except OSError:
                    return

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self.listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)


def _commands(buf: bytes) -> tuple[list[bytes], bytes]:
    """The names (upper case) of the whole RESP commands at the start of ``buf``, and what is left of it."""
    names: list[bytes] = []
    while buf.startswith(b"*") and b"\r\n" in buf:
        head, rest = buf.split(b"\r\n", 1)
        args = []
        for _ in range(int(head[1:])):
            if b"\r\n" not in rest:
                return names, buf
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line[1:])
            if len(rest) < size + 2:
                return names, buf
            args.append(rest[:size])
            rest = rest[size + 2:]
        names.append(args[0].upper())
        buf = rest
    return names, buf


@contextlib.contextmanager
def deployment(root: Path, cluster: bool) -> Iterator[ClusterInfo]:
    """Three TLS masters (or two standalone TLS servers) with read ports; stopped and removed after."""
    nodes = 3 if cluster else 2
    spec = ClusterSpec(nodes=nodes, cluster=cluster, port=free_port_block(nodes, with_bus=cluster, tls=True),
                       state_root=root, timeout_s=60.0, bus_tls=cluster, client_tls=True,
                       read_port_offset=READ_PORT_OFFSET, password=TEST_PASSWORD)
    info = start_cluster(spec)
    try:
        yield info
    finally:
        stop_cluster(spec.port, root)


def _dataset(info: ClusterInfo, name: str) -> CachedDataset:
    tls = client_tls(Path(str(info.tls_dir)))
    assert tls is not None
    return CachedDataset(Source(N), dataset_name=name, hosts=info.hosts, password=TEST_PASSWORD, tls_ca=tls.ca,
                         tls_cert=tls.cert, tls_key=tls.key, writer_buffer_size=8, cache_key=CACHE_KEY,
                         read_port_offset=info.read_port_offset, outage_policy=FAST,
                         connect_timeout_s=0.5)


def _read_all(ds: CachedDataset) -> None:
    for start in range(0, N, 8):
        check_batch(ds, list(range(start, start + 8)))


def _kill(info: ClusterInfo) -> int:
    """Kill the first master (a process this test's deployment started) and wait until its client port and its
    read port are free; its client port."""
    victim = info.masters[0]
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: bindable(victim.port) and bindable(victim.port + READ_PORT_OFFSET), 10.0,
               f"the ports of the killed node {victim.port} to be free")
    return victim.port


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING and r.name.startswith(CACHE_LOGGER))


def _ends(caplog: pytest.LogCaptureFixture) -> int:
    return sum("caching resumes" in r.getMessage() for r in caplog.records
               if r.levelno == logging.INFO and r.name.startswith(CACHE_LOGGER))


def _read_through_the_outage(ds: CachedDataset, squatter: NilSquatter, dead: str) -> None:
    """Read every sample many times, for well over ten tries of the dead node (FAST backs off 50-200 ms); every
    sample checked against the source. Once the node is taken for down, the squatter gets no more reads."""
    breakers: Any = ds.cache_loader.store.breakers  # type: ignore[attr-defined]
    _read_all(ds)
    wait_until(lambda: dead in breakers.down, 10.0, f"{dead} to be taken for down")
    gets = squatter.gets
    deadline = time.monotonic() + 4.0  # 20+ tries at the longest back-off
    passes = 0
    while time.monotonic() < deadline or passes < 3:
        _read_all(ds)
        passes += 1
        time.sleep(0.01)
    assert dead in breakers.down, "the dead node's outage ended while it was dead"
    assert squatter.gets == gets, "a node that is down was read through its read port"


@pytest.mark.parametrize("accept_reader", [False, True], ids=["nil-to-everything", "nil-to-every-get"])
def test_a_squatted_read_port_of_a_dead_master_costs_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, accept_reader: bool) -> None:
    caplog.set_level(logging.INFO, logger=CACHE_LOGGER)
    with deployment(tmp_path, cluster=True) as info:
        warm = _dataset(info, "squatted")
        try:
            _read_all(warm)
            warm.flush()
        finally:
            warm.cache_loader.cleanup()
        port = _kill(info)
        squatter = NilSquatter(port + READ_PORT_OFFSET, accept_reader)
        ds = _dataset(info, "squatted")
        try:
            _read_through_the_outage(ds, squatter, f"127.0.0.1:{port}")
            assert ds.stats.hits > 0 and ds.stats.corrupt == 0, ds.stats  # the live masters' keys hit
            assert ds.stats.errors > 10, ds.stats  # the failures are counted (metrics), not logged
        finally:
            ds.cache_loader.cleanup()
            squatter.close()
    assert squatter.commands > 0  # the squatter was met (the reader's AUTH, and its first GETs)
    assert _warnings(caplog, "is unavailable") == 1, caplog.text
    assert _warnings(caplog, "read port") <= 1, caplog.text
    assert _ends(caplog) == 0, caplog.text  # the master never came back


@pytest.mark.parametrize("accept_reader", [False, True], ids=["nil-to-everything", "nil-to-every-get"])
def test_a_squatted_read_port_of_a_dead_server_costs_one_warning_and_its_return_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, accept_reader: bool) -> None:
    caplog.set_level(logging.INFO, logger=CACHE_LOGGER)
    with deployment(tmp_path, cluster=False) as info:
        port = _kill(info)
        dead = f"127.0.0.1:{port}"
        squatter = NilSquatter(port + READ_PORT_OFFSET, accept_reader)
        ds = _dataset(info, "squatted-server")
        try:
            _read_through_the_outage(ds, squatter, dead)
            assert _warnings(caplog, "is unavailable") == 1 and _ends(caplog) == 0, caplog.text
            squatter.close()
            # The node comes back (from its own configuration, empty: no persistence) and the outage ends.
            conf = info.state_dir / f"node-{port}" / CONFIG_FILE
            secret = f"requirepass {TEST_PASSWORD}\nmasterauth {TEST_PASSWORD}\n".encode()
            with _restarted(conf, secret):
                breakers: Any = ds.cache_loader.store.breakers  # type: ignore[attr-defined]

                def back() -> bool:
                    _read_all(ds)
                    return not breakers.down

                wait_until(back, 30.0, f"{dead} to serve again")
                # The pass that saw the node come back read some of its keys while it was still marked down
                # (from the source, not written): one whole pass with it up writes every one of them again.
                _read_all(ds)
                ds.flush()
                hits = ds.stats.hits
                _read_all(ds)
                assert ds.stats.hits == hits + N, ds.stats  # both nodes hit again
        finally:
            ds.cache_loader.cleanup()
            squatter.close()
    assert _warnings(caplog, "is unavailable") == 1, caplog.text
    assert _ends(caplog) == 1, caplog.text


@contextlib.contextmanager
def _restarted(conf: Path, secret: bytes) -> Iterator[subprocess.Popen[bytes]]:
    """``redis-server`` on a node's own ``redis.conf``, the password on stdin as ``up`` gives it; stopped after."""
    proc = subprocess.Popen([redis_server_binary(), str(conf), "-"], cwd=conf.parent, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert proc.stdin is not None
        proc.stdin.write(secret)
        proc.stdin.close()
        yield proc
    finally:
        stop_process(proc)
