"""A secret from the services file reaches only the addresses that the same file records.

Every case points a real client (the CLI's ``status``, ``AutotuneClient``, ``RedisStore``, ``CachedDataset``,
the strategy's autotune client) at a listener that records what it is sent, and checks the deployment's
secrets are not in it, unless the user passed the secret explicitly (argument or environment variable).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from bagua_lightning.core import procs, services_file
from bagua_lightning.core.services_file import ServicesInfo
from tests.procs import free_port

PASSWORD = "recorded-redis-password-5b1f0c"
TOKEN = "recorded-autotune-token-9e27aa"
CACHE_KEY = "recorded-cache-key-41c3d0"
SECRET_ENV = ("BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "BAGUA_LIGHTNING_CACHE_KEY",
              "BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_AUTOTUNE_SERVICE")


class RespRecorder:
    """A TCP listener on 127.0.0.1 that records every byte it is sent and answers each read with an error
    reply, as a hostile or mistaken server on a port the user typed would."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.received = bytearray()
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5.0)
            with contextlib.suppress(OSError):
                while data := conn.recv(65536):
                    with self._lock:
                        self.received += data
                    conn.sendall(b"-ERR not a redis server\r\n")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop = True
        self.sock.close()


class GrpcRecorder:
    """A real gRPC server on a free port that records the metadata of every call and refuses it."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        recorder = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, handler_call_details: Any) -> Any:
                recorder.metadata.append(dict(handler_call_details.invocation_metadata))

                def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "recorded")
                    return b""
                return grpc.unary_unary_rpc_method_handler(refuse)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[Handler()])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tokens(self) -> list[str]:
        return [m.get("authorization", "") for m in self.metadata]

    def close(self) -> None:
        self.server.stop(None)


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServicesInfo:
    """A services file naming a Redis on port R (nothing listens there) and an autotune service, with its
    three secrets in 0600 files."""
    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("BAGUA_LIGHTNING_SERVICES_FILE", str(tmp_path / "services.json"))
    secrets = tmp_path / "secrets"
    paths = {name: str(procs.write_private(secrets / name, value))
             for name, value in (("redis_password", PASSWORD), ("autotune_token", TOKEN), ("cache_key", CACHE_KEY))}
    info = ServicesInfo(autotune=f"127.0.0.1:{free_port()}",
                        redis_hosts=[{"host": "127.0.0.1", "port": free_port()}, {"host": "::1", "port": 7001}],
                        redis_cluster=True, state_dir=str(tmp_path / "state"), deployment="d" * 32, secrets=paths)
    services_file.write_services_file(info)
    return info


@pytest.fixture
def resp() -> Iterator[RespRecorder]:
    server = RespRecorder()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def rpc() -> Iterator[GrpcRecorder]:
    server = GrpcRecorder()
    try:
        yield server
    finally:
        server.close()


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bagua_lightning.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, check=False)


# ------------------------------------------------------------------------------------- the resolvers


def test_the_recorded_password_goes_only_to_recorded_nodes(recorded: ServicesInfo) -> None:
    mine = recorded.redis_hosts
    assert services_file.resolve_redis_password(mine) == PASSWORD
    assert services_file.resolve_redis_password(mine[:1]) == PASSWORD  # a subset is still the deployment
    # Other spellings of the same addresses: a tuple, "host:port", the IPv6 node in brackets and in full.
    assert services_file.resolve_redis_password([("127.0.0.1", mine[0]["port"])]) == PASSWORD
    assert services_file.resolve_redis_password(["[::1]:7001", "[0:0:0:0:0:0:0:1]:7001"]) == PASSWORD
    assert services_file.resolve_redis_password([f"127.0.0.1:{free_port()}"]) is None
    assert services_file.resolve_redis_password([*mine, {"host": "127.0.0.2", "port": 7000}]) is None
    assert services_file.resolve_redis_password([]) is None


def test_the_recorded_token_goes_only_to_the_recorded_service(recorded: ServicesInfo) -> None:
    assert recorded.autotune is not None
    assert services_file.resolve_autotune_token(recorded.autotune) == TOKEN
    port = recorded.autotune.rpartition(":")[2]
    assert services_file.resolve_autotune_token(f"127.0.0.1:{int(port) + 1}") is None
    assert services_file.resolve_autotune_token(f"127.0.0.2:{port}") is None


def test_explicit_environment_secrets_go_wherever_the_user_points(recorded: ServicesInfo,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", "given")
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "given-token")
    assert services_file.resolve_redis_password(["127.0.0.1:1234"]) == "given"
    assert services_file.resolve_autotune_token("127.0.0.1:1234") == "given-token"


def test_the_cache_key_belongs_to_the_recorded_redis(recorded: ServicesInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    assert services_file.resolve_cache_key() == CACHE_KEY.encode()
    assert services_file.resolve_cache_key(recorded.redis_hosts) == CACHE_KEY.encode()
    assert services_file.resolve_cache_key(["127.0.0.1:1234"]) is None
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_HOSTS", "127.0.0.1:1234")
    assert services_file.resolve_cache_key() is None
    node = recorded.redis_hosts[0]
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_HOSTS", f"{node['host']}:{node['port']}")
    assert services_file.resolve_cache_key() == CACHE_KEY.encode()


# ------------------------------------------------------------------------------- real clients, real wires


def test_status_sends_no_recorded_secret_to_addresses_the_user_typed(recorded: ServicesInfo, resp: RespRecorder,
                                                                      rpc: GrpcRecorder) -> None:
    done = cli("status", "--redis", resp.address, "--single", "--timeout", "2")
    assert done.returncode != 0  # the recorder is no Redis
    done = cli("status", "--autotune", rpc.address, "--timeout", "2")
    assert done.returncode != 0
    assert resp.received, "status did not talk to the Redis it was pointed at"
    assert PASSWORD.encode() not in resp.received
    assert rpc.metadata, "status did not call the service it was pointed at"
    assert not any(TOKEN in t for t in rpc.tokens())


def test_status_sends_secrets_the_user_passes_explicitly(recorded: ServicesInfo, resp: RespRecorder,
                                                         rpc: GrpcRecorder) -> None:
    env = {"BAGUA_LIGHTNING_REDIS_PASSWORD": "explicit-password-77", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN": "explicit-tok"}
    cli("status", "--redis", resp.address, "--single", "--timeout", "2", env=env)
    cli("status", "--autotune", rpc.address, "--timeout", "2", env=env)
    assert b"explicit-password-77" in resp.received
    assert "Bearer explicit-tok" in rpc.tokens()


def test_autotune_client_and_strategy_client_send_no_recorded_token_elsewhere(recorded: ServicesInfo,
                                                                             rpc: GrpcRecorder) -> None:
    from bagua_lightning.client.autotune import AutotuneClient
    from bagua_lightning.engine.autotune.controller import AutotuneSettings, default_client

    client = AutotuneClient(target=rpc.address, timeout_s=2.0)
    try:
        with pytest.raises(Exception, match="recorded"):
            client.list_models()
    finally:
        client.close()
    strategy_client = default_client(AutotuneSettings(address=rpc.address))
    try:
        with pytest.raises(Exception, match="recorded"):
            strategy_client.list_models()
    finally:
        strategy_client.close()
    assert len(rpc.metadata) >= 2
    assert not any(TOKEN in t for t in rpc.tokens())


def test_autotune_client_sends_the_recorded_token_to_the_recorded_service(tmp_path: Path,
                                                                          recorded: ServicesInfo,
                                                                          rpc: GrpcRecorder) -> None:
    from bagua_lightning.client.autotune import AutotuneClient

    # Record the listener as the deployment's autotune service: now it is the deployment's address.
    services_file.write_services_file(ServicesInfo(**{**recorded.__dict__, "autotune": rpc.address}))
    client = AutotuneClient(target=rpc.address, timeout_s=2.0)
    try:
        with pytest.raises(Exception, match="recorded"):
            client.list_models()
    finally:
        client.close()
    assert f"Bearer {TOKEN}" in rpc.tokens()


def test_redis_store_and_cached_dataset_send_no_recorded_password_elsewhere(recorded: ServicesInfo,
                                                                            resp: RespRecorder) -> None:
    from bagua_lightning.client.cache.dataset import CachedDataset
    from bagua_lightning.client.cache.store import RedisStore

    store = RedisStore(hosts=[resp.address], retries=0, socket_timeout_s=1.0, connect_timeout_s=1.0)
    try:
        assert store.options.password is None
        values, error = store.fetch(["k"])
        assert values == [None] and error is not None
    finally:
        store.shutdown()
    dataset = CachedDataset([1.0, 2.0], hosts=[resp.address], retries=0, socket_timeout_s=1.0,
                            connect_timeout_s=1.0)
    assert [float(dataset[i]) for i in range(2)] == [1.0, 2.0]  # from the source, the store being no Redis
    dataset.cache_loader.cleanup()
    assert resp.received, "the store did not talk to the server it was given"
    assert PASSWORD.encode() not in resp.received


def test_redis_store_sends_an_explicit_password_anywhere(recorded: ServicesInfo, resp: RespRecorder) -> None:
    from bagua_lightning.client.cache.store import RedisStore

    store = RedisStore(hosts=[resp.address], password="explicit-arg-pw", retries=0, socket_timeout_s=1.0,
                       connect_timeout_s=1.0)
    try:
        store.fetch(["k"])
    finally:
        store.shutdown()
    assert b"explicit-arg-pw" in resp.received
    assert PASSWORD.encode() not in resp.received
