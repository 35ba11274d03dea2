"""Secrets only to servers that prove they are the deployment's: TLS with the CA that ``up`` makes, pinned in
the services file.

The reproduction, with real processes: ``up`` (3 masters, 1 replica each, TLS on by default), kill -9 the
first master and the autotune service, wait for the replica to take over, then another user (``nobody``;
the tests run as root) binds both dead ports with a listener that records every byte. A ``RedisStore()``,
a ``CachedDataset`` and an ``AutotuneClient()`` (all finding the deployment through the services file) send
it no password and no token, and the cache keeps serving through the surviving nodes. A TLS server with a
certificate of another CA is refused before any AUTH or token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.core import procs
from bagua_lightning.core.errors import UntrustedServerError
from bagua_lightning.core.redis_server import CLUSTER_SLOTS, client_for, cluster_info
from bagua_lightning.core.services_file import ServicesInfo, read_services_file
from bagua_lightning.services import deploy
from bagua_lightning.services.health import check_autotune, check_redis
from bagua_lightning.services.redis_tls import make_node_certificates
from tests.procs import recording_tls_server, stop_process, wait_until
from tests.services.test_deploy_cluster import default_deployment

# A listener as another user would run it: bind the port, record every byte, answer garbage (as a squatter
# that wants the client to go on talking would).
LISTENER = r"""
import socket, sys, threading
path, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen(64)
print("listening", flush=True)
lock = threading.Lock()
def handle(conn):
    with conn:
        conn.settimeout(10)
        try:
            while data := conn.recv(65536):
                with lock, open(path, "ab") as f:
                    f.write(data)
                conn.sendall(b"-ERR not a redis server\r\n")
        except OSError:
            pass
while True:
    conn, _ = s.accept()
    threading.Thread(target=handle, args=(conn,), daemon=True).start()
"""


@contextlib.contextmanager
def squatter(port: int) -> Iterator[Path]:
    """A listener on ``port`` run as ``nobody``; yields the file of the bytes it received."""
    if os.geteuid() != 0:
        pytest.skip("binding a dead server's port as another user needs root (to switch to nobody)")
    # An interpreter that another user may run (the test's own may live in a private home).
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no system python3 that the user nobody can run")
    folder = Path(tempfile.mkdtemp(prefix="squatter-"))
    os.chmod(folder, 0o777)
    record = folder / "received"
    record.touch()
    os.chmod(record, 0o666)
    proc = subprocess.Popen([python, "-c", LISTENER, str(record), str(port)], user="nobody",
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, cwd=folder)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"listening", "the squatter could not bind the dead port"
        yield record
    finally:
        stop_process(proc)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServicesInfo]:
    """``up`` with its defaults (TLS on) in a private state folder; ``down`` after."""
    yield from default_deployment(tmp_path_factory, "tls")


def test_up_pins_its_ca_and_keeps_every_file_private(deployment: ServicesInfo) -> None:
    tls = deployment.tls
    assert tls is not None and tls.cert and tls.key
    recorded = read_services_file()
    assert recorded is not None and recorded.tls == tls
    for path in (tls.ca, tls.cert, tls.key):
        assert oct(Path(path).stat().st_mode & 0o777) == "0o600", path
    assert oct(Path(tls.ca).parent.stat().st_mode & 0o777) == "0o700"
    assert not (Path(tls.ca).parent / "ca.key").exists()  # nobody can sign another server
    # The services answer only over TLS, and the checks the services file drives say healthy.
    health = deploy.running_services(deployment)
    assert all(h.healthy for h in health.values()), health
    assert not check_autotune(str(deployment.autotune), timeout_s=2.0).healthy  # plaintext gets no answer
    # The autotune certificate names the address clients are given; the client certificate is for clients.
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(Path(tls.ca).parent / "autotune.crt")],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text and "TLS Web Server Authentication" in text
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", tls.cert], capture_output=True, text=True,
                          check=True).stdout
    assert "TLS Web Client Authentication" in text and "Server Authentication" not in text


def test_a_server_with_another_cas_certificate_gets_nothing(deployment: ServicesInfo, tmp_path: Path) -> None:
    from bagua_lightning.client.autotune import AutotuneClient
    from bagua_lightning.client.cache.store import RedisStore

    tls = deployment.tls
    assert tls is not None
    make_node_certificates(tmp_path / "other", [1], ["127.0.0.1"], service_hosts=["127.0.0.1"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "other" / "autotune.crt", tmp_path / "other" / "autotune.key")
    received = bytearray()
    with _tls_server(context, received) as port:
        address = f"127.0.0.1:{port}"
        store = RedisStore(hosts=[address], password="sent-only-to-proven-servers", tls_ca=tls.ca, tls_cert=tls.cert,
                           tls_key=tls.key, retries=0, connect_timeout_s=5.0)
        try:
            with pytest.raises(UntrustedServerError, match=rf"{address} is not this deployment's"):
                store.mget(["k"])
        finally:
            store.shutdown()
        client = AutotuneClient(target=address, token="token-only-to-proven-servers", tls_ca=tls.ca, timeout_s=5.0)
        try:
            with pytest.raises(UntrustedServerError, match=rf"{address} is not this deployment's"):
                client.list_models()
        finally:
            client.close()
        health = check_redis([{"host": "127.0.0.1", "port": port}], False, "pw", tls=tls)
        assert not health.healthy and "not this deployment's" in health.detail
    assert bytes(received) == b"", "a server that failed the handshake received application bytes"


@contextlib.contextmanager
def _tls_server(context: ssl.SSLContext, received: bytearray) -> Iterator[int]:
    """A TLS server (another CA's certificate) that records every byte it decrypts."""

    with recording_tls_server(context, received) as port:
        yield port


def test_a_squatter_on_dead_ports_receives_no_secret_and_the_cache_keeps_serving(deployment: ServicesInfo) -> None:
    # Last test of the module: it kills the first master and the autotune service (down() stops the rest).
    from bagua_lightning.client.autotune import AutotuneClient
    from bagua_lightning.client.cache.dataset import CachedDataset
    from bagua_lightning.client.cache.store import RedisStore

    tls = deployment.tls
    assert tls is not None and deployment.autotune
    password = procs.read_secret(deployment.secrets["redis_password"])
    token = procs.read_secret(deployment.secrets["autotune_token"])
    first, second = deployment.redis_hosts[0], deployment.redis_hosts[1]
    values = {f"squat:{i}": f"value-{i}".encode() for i in range(60)}  # over every master's slots
    store = RedisStore()  # the deployment, through the services file: TLS, the pinned CA, the password
    try:
        store.mset(values)
    finally:
        store.shutdown()
    samples = [float(i) for i in range(16)]
    dataset = CachedDataset(samples, dataset_name="squat")
    assert [float(dataset[i]) for i in range(16)] == samples  # loaded from the source, written to the cache
    dataset.cache_loader.cleanup()
    for host in deployment.redis_hosts:  # every write has reached the replica before its master dies
        with client_for(host["host"], host["port"], password, tls=tls) as c:
            assert c.execute_command("WAIT", 1, 10_000) == 1

    os.kill(deployment.processes["redis"][0].pid, signal.SIGKILL)
    os.kill(deployment.processes["autotune"][0].pid, signal.SIGKILL)

    def failed_over() -> bool:
        with client_for(second["host"], second["port"], password, tls=tls) as c:
            if cluster_info(c).get("cluster_state") != "ok":
                return False
            slots = c.execute_command("CLUSTER SLOTS")
        owners = {(int(e[0]), int(e[1])): int(e[2][1]) for e in slots}
        return first["port"] not in owners.values() and sum(hi - lo + 1 for lo, hi in owners) == CLUSTER_SLOTS
    wait_until(failed_over, 60, "the replica of the killed master to take over its slots")

    autotune_port = int(deployment.autotune.rpartition(":")[2])
    with squatter(int(first["port"])) as redis_record, squatter(autotune_port) as autotune_record:
        store = RedisStore()  # the services file still names the dead master first
        try:
            assert store.mget(list(values)) == list(values.values())  # through the promoted replica
        finally:
            store.shutdown()
        dataset = CachedDataset(samples, dataset_name="squat")
        assert [float(dataset[i]) for i in range(16)] == samples
        dataset.cache_loader.cleanup()
        client = AutotuneClient()  # the recorded address, the recorded token and CA
        try:
            assert client.target == deployment.autotune
            with pytest.raises(UntrustedServerError, match=rf"{deployment.autotune} is not this deployment's"):
                client.list_models()
        finally:
            client.close()
        # The squatters were talked to (a TLS ClientHello), and got nothing else.
        got_redis, got_autotune = redis_record.read_bytes(), autotune_record.read_bytes()
    assert got_redis and got_autotune, "the clients never reached the squatters"
    for got in (got_redis, got_autotune):
        assert password.encode() not in got and token.encode() not in got
        assert b"AUTH" not in got and b"authorization" not in got.lower()
