"""The deployment's CA is the only root the clients trust: a server whose certificate chains to a CA that the
machine's trust store holds (but that is not the deployment's) gets no password and no token.

Real processes: a ``redis-server`` serving clients over TLS only with a certificate of another CA (it accepts
the deployment's client certificate and knows the password, as a server that took a node's address with a
public CA's certificate would), and a TLS listener with ALPN h2 and that CA's certificate in place of the
autotune service. The clients run in a subprocess whose system trust store is that other CA
(``SSL_CERT_FILE``/``SSL_CERT_DIR``, which OpenSSL's default paths honour, and ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``)
and whose TLS settings come from the environment, as on a cluster node. A control run in the same environment
with redis-py's own ``SSLConnection`` and gRPC's default roots does get through, so the environment really
makes the other CA trusted.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.core.redis_server import NodeConfig, NodeTLS, client_for, launch_node, wait_ready
from bagua_lightning.core.tls_trust import ClientTLS
from bagua_lightning.services.redis_tls import make_node_certificates
from tests.procs import free_port, recording_tls_server, stop_process

PASSWORD = "only-for-the-deployments-own-servers"
TOKEN = "token-only-for-the-deployments-own-service"

CLIENTS = r"""
import json, sys
addr, grpc_addr, mode = sys.argv[1], sys.argv[2], sys.argv[3]
host, port = addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1])
out = {}

def attempt(name, fn):
    try:
        out[name] = "answered: %r" % (fn(),)
    except BaseException as exc:
        out[name] = "%s: %s" % (type(exc).__name__, exc)

if mode == "control":  # the library defaults: the system's roots (here: the other CA) beside the deployment's
    import os, grpc, redis
    attempt("redis-py SSLConnection", lambda: redis.Redis(
        host=host, port=port, password=os.environ["BAGUA_LIGHTNING_REDIS_PASSWORD"], ssl=True,
        ssl_ca_certs=os.environ["BAGUA_LIGHTNING_TLS_CA"], ssl_certfile=os.environ["BAGUA_LIGHTNING_TLS_CERT"],
        ssl_keyfile=os.environ["BAGUA_LIGHTNING_TLS_KEY"], socket_timeout=5).ping())
    def grpc_default_roots():  # the listener speaks no HTTP/2: the channel never gets ready, but talks
        with grpc.secure_channel(grpc_addr, grpc.ssl_channel_credentials()) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=3)
            except grpc.FutureTimeoutError:
                pass
    attempt("grpc default roots", grpc_default_roots)
else:
    from bagua_lightning.client.autotune import AutotuneClient
    from bagua_lightning.client.cache.cluster_nodes import ClusterNodes
    from bagua_lightning.client.cache.options import RedisOptions
    from bagua_lightning.client.cache.store import RedisStore
    from bagua_lightning.client.cache.tls_stream import MemoryTLSConnection
    from bagua_lightning.core.pinned_redis import pinned_kwargs
    from bagua_lightning.core.redis_server import client_for
    from bagua_lightning.core.tls_trust import resolve_client_tls
    from bagua_lightning.services.autotune.persistence import RedisPlanStore
    from bagua_lightning.services.health import check_autotune, check_redis

    tls = resolve_client_tls(None)
    password = __import__("os").environ["BAGUA_LIGHTNING_REDIS_PASSWORD"]
    attempt("RedisStore", lambda: RedisStore(hosts=[addr], retries=0).mget(["k"]))
    attempt("RedisStore ssl=True", lambda: RedisStore(hosts=[addr], retries=0, ssl=True, ssl_ca_certs=tls.ca,
                                                      ssl_certfile=tls.cert, ssl_keyfile=tls.key).mget(["k"]))
    attempt("client_for", lambda: client_for(host, port, password, tls=tls).ping())
    attempt("check_redis", lambda: check_redis([{"host": host, "port": port}], False, password, tls=tls))
    def cluster():
        options = RedisOptions(password=password, retries=0)
        options.resolve_tls([(host, port)])
        return ClusterNodes([(host, port)], options).rc.ping()
    attempt("ClusterNodes", cluster)
    attempt("RedisPlanStore", lambda: RedisPlanStore("redis://" + addr).ping())
    attempt("RedisPlanStore rediss", lambda: RedisPlanStore("rediss://" + addr).ping())
    def held():
        conn = MemoryTLSConnection(host=host, port=port, password=password, **{
            k: v for k, v in pinned_kwargs(tls).items() if k != "connection_class"})
        conn.connect()
    attempt("MemoryTLSConnection", held)
    attempt("AutotuneClient", lambda: AutotuneClient(target=grpc_addr, token=sys.argv[4], timeout_s=5).list_models())
    attempt("check_autotune", lambda: check_autotune(grpc_addr, token=sys.argv[4], tls_ca=tls.ca))
print(json.dumps(out))
"""


@contextlib.contextmanager
def _h2_listener(cert: Path, key: Path, received: bytearray) -> Iterator[int]:
    """A TLS listener as a gRPC server would be (ALPN h2) that records every byte it decrypts."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    with recording_tls_server(context, received) as port:
        yield port


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The deployment's CA and client certificate; a redis-server and an h2 listener with another CA's
    certificates; that CA as the client's system trust store."""
    tmp = tmp_path_factory.mktemp("roots")
    port = free_port()
    make_node_certificates(tmp / "deployment", [port], ["127.0.0.1"], clients=True)
    other = make_node_certificates(tmp / "system", [port], ["127.0.0.1"], service_hosts=["127.0.0.1"])[port]
    deployment = ClientTLS(ca=str(tmp / "deployment" / "ca.crt"), cert=str(tmp / "deployment" / "client.crt"),
                           key=str(tmp / "deployment" / "client.key"))
    # The other CA's server demands a client certificate of the deployment's CA and knows the password.
    node = NodeConfig(port=port, data_dir=tmp / "redis", deployment=f"roots-test-{os.getpid()}", password=PASSWORD,
                      tls=NodeTLS(cert_file=other.cert_file, key_file=other.key_file,
                                  ca_file=Path(deployment.ca), clients=True))
    proc = launch_node(node)
    try:
        admin_tls = ClientTLS(ca=str(other.ca_file), cert=deployment.cert, key=deployment.key)
        wait_ready("127.0.0.1", port, PASSWORD, proc, tls=admin_tls)
        received = bytearray()
        with client_for("127.0.0.1", port, PASSWORD, tls=admin_tls) as admin, _h2_listener(
                tmp / "system" / "autotune.crt", tmp / "system" / "autotune.key", received) as grpc_port:
            (tmp / "empty").mkdir()
            env = {**os.environ, "SSL_CERT_FILE": str(other.ca_file), "SSL_CERT_DIR": str(tmp / "empty"),
                   "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(other.ca_file), "XDG_STATE_HOME": str(tmp / "state"),
                   "BAGUA_LIGHTNING_TLS_CA": deployment.ca, "BAGUA_LIGHTNING_TLS_CERT": str(deployment.cert),
                   "BAGUA_LIGHTNING_TLS_KEY": str(deployment.key), "BAGUA_LIGHTNING_REDIS_PASSWORD": PASSWORD}
            for name in ("BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_AUTOTUNE", "BAGUA_LIGHTNING_SERVICES_FILE"):
                env.pop(name, None)
            yield {"addr": f"127.0.0.1:{port}", "grpc": f"127.0.0.1:{grpc_port}", "env": env, "admin": admin,
                   "received": received}
    finally:
        stop_process(proc)


def _run(world: dict[str, Any], mode: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", CLIENTS, world["addr"], world["grpc"], mode, TOKEN],
                          env=world["env"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _auths(admin: Any) -> int:
    """AUTH (and HELLO, which can carry a password) commands the server has run, the admin's own included."""
    stats = admin.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("auth", "hello"))


def test_a_server_that_only_the_system_trusts_gets_no_password_and_no_token(world: dict[str, Any]) -> None:
    admin, received = world["admin"], world["received"]
    before = _auths(admin)
    outcomes = _run(world, "pinned")
    for name, outcome in outcomes.items():  # refused in the handshake, for not chaining to the deployment's CA
        assert "CERTIFICATE_VERIFY_FAILED" in outcome or (
            name == "check_autotune" and "healthy=False" in outcome and "not this deployment's" in outcome
        ), (name, outcome)
    assert len(outcomes) == 10
    assert _auths(admin) == before, "a pinned client sent AUTH to a server of another CA"
    assert bytes(received) == b"", "the gRPC client sent application bytes to a server of another CA"

    # The same environment with the libraries' defaults: the other CA is trusted, the password goes out.
    control = _run(world, "control")
    assert control == {"redis-py SSLConnection": "answered: True", "grpc default roots": "answered: None"}, control
    assert _auths(admin) > before
    assert bytes(received).startswith(b"PRI * HTTP/2.0"), bytes(received)[:40]  # the handshake passed
