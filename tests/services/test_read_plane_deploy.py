"""Open reads on a real ``bagua-lightning up``: every node's plaintext read port lets the password-less reader
GET cache entries and nothing else, the services file records the offset, and the read port survives the
partial recovery (a killed node restarted by ``up``) and ``rotate-secrets``.

Real processes only: ``up`` through the command line in a private state folder on a free port block (each
node's port, bus port +10000 and read port +20000 reserved); ``down`` stops everything after, also on failure.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bagua_lightning.core import procs
from bagua_lightning.core.errors import ConfigurationError, ServiceUnavailableError
from bagua_lightning.core.pinned_redis import cluster_client, pinned_kwargs
from bagua_lightning.core.read_plane import (
    READ_PORT_OFFSET_ENV,
    READER_USER,
    SEALED_KEY_PREFIX,
    reader_acl_rules,
)
from bagua_lightning.core.redis_server import (
    TLS_PORT_OFFSET,
    NodeConfig,
    NodeTLS,
    check_reader,
    client_for,
    read_port_offset,
)
from bagua_lightning.core.services_file import (
    ServicesInfo,
    read_services_file,
    resolve_redis_read_port_offset,
    services_file_path,
)
from bagua_lightning.services import deploy
from bagua_lightning.services.deploy_config import deployment_ports
from tests.procs import free_port, free_port_block, wait_until
from tests.services.test_deploy_cluster import private_state
from tests.services.test_deploy_recovery import _cli, _kill, _redis_pids, _secrets

KEYS = 200
PROTECTED = "bagua_lightning:autotune:plan:x"  # the autotune service's plans: never readable by the reader
SEALED = SEALED_KEY_PREFIX
# values in clear: RedisStore.set("cfg", ...), an unkeyed cache's entry, one named like a sealed key otherwise
CLEAR = ("cfg", "bagua-cache:v1:0000", "sealed:bagua-cache:v1:0000", "%21sealed:x", "!sealed")


@pytest.fixture(autouse=True)
def _no_offset_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(READ_PORT_OFFSET_ENV, raising=False)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], dict[str, bytes]]]:
    """``up`` (3 masters, 3 replicas, TLS) through the CLI, and KEYS cache-style keys written over TLS."""
    with pytest.MonkeyPatch.context() as mp, private_state(tmp_path_factory.mktemp("read-plane")):
        mp.delenv(READ_PORT_OFFSET_ENV, raising=False)
        args = ["--autotune-port", str(free_port()), "--lighthouse-port", str(free_port()), "--redis-port", str(free_port_block(6, tls=True)),
                "--maxmemory", "64mb", "--timeout", "120"]
        result = _cli("up", *args)
        assert result.returncode == 0, result.stderr
        info = _info()
        keys = {f"{SEALED}bagua-cache:v1:{i:04d}": os.urandom(32) for i in range(KEYS)}
        with _admin_cluster(info) as rc:
            for key, value in keys.items():
                rc.set(key, value)
            rc.set(PROTECTED, b"plan")
            for key in CLEAR:
                rc.set(key, b"db_password=swordfish")
        for host in info.redis_hosts:  # on every replica too
            with _admin(info, int(host["port"])) as c:
                assert c.execute_command("WAIT", 1, 5000) == 1
        yield args, keys


def _info() -> ServicesInfo:
    info = read_services_file()
    assert info is not None
    return info


def _admin(info: ServicesInfo, port: int) -> redis.Redis:
    """A TLS connection with the deployment's password (administration, writes)."""
    return client_for("127.0.0.1", port, _secrets(info)["redis_password"], timeout_s=10, tls=info.tls)


def _admin_cluster(info: ServicesInfo) -> Any:
    assert info.tls is not None
    first = info.redis_hosts[0]
    return cluster_client([(first["host"], first["port"])], password=_secrets(info)["redis_password"],
                          socket_timeout=10, **pinned_kwargs(info.tls))


def _reader(read_port: int, **kwargs: Any) -> redis.Redis:
    """A plaintext connection to a read port; as the reader (empty password) unless told otherwise."""
    options: dict[str, Any] = {"username": READER_USER, "password": "", "socket_timeout": 5} | kwargs
    # No retries: a refused AUTH is a ConnectionError to redis-py, which it would retry with backoff.
    return redis.Redis(host="127.0.0.1", port=read_port, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0),
                       **{k: v for k, v in options.items() if v is not None})


def _owned_keys(info: ServicesInfo, port: int, keys: dict[str, bytes]) -> list[str]:
    """The keys whose slot the master on ``port`` serves."""
    with _admin(info, port) as c:
        return [k for k in keys if c.execute_command("CLUSTER KEYSLOT", k) in _slots(c, port)]


def _slots(c: redis.Redis, port: int) -> set[int]:
    out: set[int] = set()
    for entry in c.execute_command("CLUSTER SLOTS"):  # [lo, hi, [host, port, id], replicas...]
        if int(entry[2][1]) == port:
            out.update(range(int(entry[0]), int(entry[1]) + 1))
    return out


def _masters(info: ServicesInfo) -> list[dict[str, Any]]:
    """The nodes that are masters now (after a failover not the recorded ones)."""
    return [{"host": "127.0.0.1", "port": p} for p in sorted(_redis_pids(info)) if _role(info, p) == "master"]


def _role(info: ServicesInfo, port: int) -> str:
    with _admin(info, port) as c:
        return str(c.info("replication")["role"])


def _assert_reader_only(read_port: int) -> None:
    """On ``read_port``: the reader may PING; writes, the protected keys, every key outside the sealed prefix,
    KEYS/CONFIG/FLUSHALL are refused; the default user needs its password."""
    with _reader(read_port) as r:
        assert r.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set(f"{SEALED}bagua-cache:v1:forged", b"x")
        for key in (PROTECTED, *CLEAR):  # no clear value is readable without the password
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.get(key)
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.mget([f"{SEALED}bagua-cache:v1:0000", PROTECTED])
        for command in (("KEYS", "*"), ("CONFIG", "GET", "requirepass"), ("FLUSHALL",),
                        ("DEL", f"{SEALED}bagua-cache:v1:0000"),
                        ("ACL", "LIST"), ("CLUSTER", "SLOTS")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*command)
    with _reader(read_port, username=None, password="not-the-password") as wrong, \
            pytest.raises(redis.AuthenticationError):
        wrong.ping()
    with _reader(read_port, username="default", password="not-the-password") as wrong, \
            pytest.raises(redis.AuthenticationError):
        wrong.ping()
    with _reader(read_port, username=None, password=None) as anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.get(f"{SEALED}bagua-cache:v1:0000")  # the default user without AUTH: NOAUTH


def _assert_reads(info: ServicesInfo, port: int, keys: dict[str, bytes]) -> None:
    """The reader GETs (and MGETs) what the node serves: a master its keys; a replica redirects (MOVED to the
    master's read port: the reader has no READONLY), never NOPERM."""
    offset = info.redis_read_port_offset
    assert offset is not None
    with _reader(port + offset) as r:
        if _role(info, port) == "master":
            owned = _owned_keys(info, port, keys)
            assert owned, f"node {port} serves none of the keys"
            assert [r.get(k) for k in owned] == [keys[k] for k in owned]
            with _admin(info, port) as c:  # MGET needs one slot
                slot = c.execute_command("CLUSTER KEYSLOT", owned[0])
                same = [k for k in owned if c.execute_command("CLUSTER KEYSLOT", k) == slot]
            assert r.mget(same) == [keys[k] for k in same]
        else:  # sent on to the owner's read port: the node announces read ports to plaintext clients
            with pytest.raises(redis.exceptions.MovedError) as moved:
                r.get(next(iter(keys)))
            assert moved.value.port - offset in {int(h["port"]) for h in _masters(info)}


def test_every_node_has_a_read_port_that_lets_the_reader_read_and_nothing_else(
        deployment: tuple[list[str], dict[str, bytes]]) -> None:
    _, keys = deployment
    info = _info()
    base = int(info.redis_hosts[0]["port"])
    assert info.redis_read_port_offset == read_port_offset(base, 6) == TLS_PORT_OFFSET
    raw = json.loads(services_file_path().read_text())
    assert raw["redis"]["read_port_offset"] == TLS_PORT_OFFSET
    ports = sorted(_redis_pids(info))
    assert ports == list(range(base, base + 6))
    assert sorted(_role(info, p) for p in ports) == ["master"] * 3 + ["slave"] * 3
    for port in ports:
        _assert_reader_only(port + TLS_PORT_OFFSET)
        _assert_reads(info, port, keys)
        with _admin(info, port) as c:  # the user as configured: no password, exactly the rules of read_plane
            user = c.acl_getuser(READER_USER)
        assert {"on", "nopass"} <= set(user["flags"]) and user["passwords"] == [] and user["channels"] == []
        rules = reader_acl_rules()
        assert sorted(user["commands"]) == sorted(r for r in rules if r.startswith("+"))
        assert user["categories"] == ["-@all"]
        assert user["keys"] == [r for r in rules if r.startswith("%R~")]
    # The TLS port stays TLS only: a plaintext client gets nothing there.
    with _reader(base, socket_timeout=1) as plain, pytest.raises(redis.ConnectionError):
        plain.ping()


def test_no_secret_is_in_any_process_environment_or_command_line(
        deployment: tuple[list[str], dict[str, bytes]]) -> None:
    """The secrets reach the deployment's processes as files (the autotune service: --token-file and
    $BAGUA_LIGHTNING_REDIS_PASSWORD_FILE) or on stdin (redis-server), never where /proc/PID/environ or ps
    shows them."""
    info = _info()
    secrets = _secrets(info)
    records = [r for rs in info.processes.values() for r in rs]
    assert len(records) == 8 and all(procs.is_running(r) for r in records)  # 6 nodes, autotune, lighthouse
    for rec in records:
        proc = psutil.Process(rec.pid)
        shown = " ".join([*proc.cmdline(), *proc.environ().values()])
        assert not any(value in shown for value in secrets.values()), proc.cmdline()
    autotune = psutil.Process(info.pids["autotune"])
    assert autotune.cmdline()[autotune.cmdline().index("--token-file") + 1] == info.secrets["autotune_token"]
    assert autotune.environ()["BAGUA_LIGHTNING_REDIS_PASSWORD_FILE"] == info.secrets["redis_password"]


def test_processes_a_deployment_starts_never_inherit_the_secrets_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in procs.SECRET_ENV:
        monkeypatch.setenv(name, "value-given-at-up")
        monkeypatch.setenv(name + "_FILE", "/some/file")
    env = procs.child_env("d" * 32)
    assert not any(name.startswith(procs.SECRET_ENV) for name in env) and env[procs.ENV_DEPLOYMENT] == "d" * 32


def test_the_services_file_offset_follows_its_hosts_and_the_variable_overrides_it(
        deployment: tuple[list[str], dict[str, bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    info = _info()
    recorded = info.redis_hosts
    assert resolve_redis_read_port_offset(recorded) == TLS_PORT_OFFSET
    assert resolve_redis_read_port_offset([f"127.0.0.1:{recorded[0]['port']}"]) == TLS_PORT_OFFSET
    assert resolve_redis_read_port_offset([("127.0.0.1", 1)]) is None  # not a recorded node
    assert resolve_redis_read_port_offset([*recorded, {"host": "127.0.0.1", "port": 1}]) is None
    assert resolve_redis_read_port_offset([]) is None
    monkeypatch.setenv(READ_PORT_OFFSET_ENV, "1000")
    assert resolve_redis_read_port_offset([("10.1.2.3", 7000)]) == 1000  # the user's choice, for any host
    assert resolve_redis_read_port_offset(recorded) == 1000
    monkeypatch.setenv(READ_PORT_OFFSET_ENV, "-20000")
    assert resolve_redis_read_port_offset(recorded) == -20000
    for off in ("none", "None", ""):
        monkeypatch.setenv(READ_PORT_OFFSET_ENV, off)
        assert resolve_redis_read_port_offset(recorded) is None
    for bad in ("abc", "0", "70000", "1.5", "+-3"):
        monkeypatch.setenv(READ_PORT_OFFSET_ENV, bad)
        with pytest.raises(ConfigurationError, match=READ_PORT_OFFSET_ENV) as caught:
            resolve_redis_read_port_offset(recorded)
        assert bad in str(caught.value)
    # A services file whose offset is not one is refused, naming the value.
    for bad_value in ("20000", 0, 70000, True):
        data = json.loads(services_file_path().read_text())
        data["redis"]["read_port_offset"] = bad_value
        with pytest.raises(ValueError, match=re.escape(f"'redis.read_port_offset' {bad_value!r}")):
            ServicesInfo.from_json(data)


def test_status_names_the_read_ports_and_counts_those_that_answer(
        deployment: tuple[list[str], dict[str, bytes]]) -> None:
    info = _info()
    result = _cli("status")
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("redis read ports:")]
    for host in info.redis_hosts:
        assert f"127.0.0.1:{int(host['port']) + TLS_PORT_OFFSET}" in line
    assert READER_USER in line and "3 of 3 answer" in line, line
    as_json = json.loads(_cli("status", "--json").stdout)
    assert as_json["redis"]["healthy"] is True
    assert as_json["redis"]["read_ports"] == [f"127.0.0.1:{int(h['port']) + TLS_PORT_OFFSET}" for h in info.redis_hosts]


def test_a_node_restarted_by_up_has_its_read_port_and_reader_again(
        deployment: tuple[list[str], dict[str, bytes]]) -> None:
    args, keys = deployment
    before = _info()
    pids = _redis_pids(before)
    victim = int(before.redis_hosts[1]["port"])  # a master: it comes back as its successor's replica
    _kill(pids[victim])
    def refused() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", victim + TLS_PORT_OFFSET)) != 0

    # its read port dies with it (the fd table goes with the last of its threads, a moment after the pid)
    wait_until(refused, 10, f"the read port of the killed node {victim} to close")

    result = _cli("up", *args)
    assert result.returncode == 0, result.stderr
    assert f"redis node 127.0.0.1:{victim}: restarted" in result.stdout, result.stdout
    after = _info()
    assert after.redis_read_port_offset == TLS_PORT_OFFSET
    assert _redis_pids(after)[victim] != pids[victim]
    _assert_reader_only(victim + TLS_PORT_OFFSET)

    def rejoined() -> bool:
        with _admin(after, victim) as c:
            repl = c.info("replication")
            return repl["role"] == "slave" and repl["master_link_status"] == "up"
    wait_until(rejoined, 60, f"node {victim} to rejoin as a replica")
    for port in sorted(_redis_pids(after)):  # the masters now (the successor included) serve the reader
        _assert_reads(after, port, keys)


def test_rotate_secrets_leaves_the_reader_alone(deployment: tuple[list[str], dict[str, bytes]]) -> None:
    _, keys = deployment
    before = _info()
    old = _secrets(before)["redis_password"]
    rules = {}
    for port in _redis_pids(before):
        with _admin(before, port) as c:
            rules[port] = c.execute_command("ACL", "GETUSER", READER_USER)
    assert _cli("rotate-secrets", "--redis-password").returncode == 0
    assert _cli("rotate-secrets", "--finish").returncode == 0
    after = _info()
    assert _secrets(after)["redis_password"] != old
    for port in sorted(_redis_pids(after)):
        with _admin(after, port) as c:
            assert c.execute_command("ACL", "GETUSER", READER_USER) == rules[port]
        _assert_reader_only(port + TLS_PORT_OFFSET)
        _assert_reads(after, port, keys)
        with _reader(port + TLS_PORT_OFFSET, username=None, password=old) as stale, \
                pytest.raises(redis.AuthenticationError):
            stale.ping()  # the old password is gone from the read port too


# ------------------------------------------------------------------------ single, --no-auth, down, settings


def test_a_single_server_has_a_read_port_until_down(tmp_path: Path) -> None:
    with private_state(tmp_path):
        info = deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port_block(1, tls=True),
                                         single=True, maxmemory=32 * 1024**2, timeout_s=120))
        port = int(info.redis_hosts[0]["port"])
        offset = info.redis_read_port_offset
        assert offset == read_port_offset(port, 1)
        with _admin(info, port) as c:
            c.set(f"{SEALED}bagua-cache:v1:single", b"sealed")
            for key in (PROTECTED, *CLEAR):
                c.set(key, b"db_password=swordfish")
        with _reader(port + offset) as r:
            assert r.get(f"{SEALED}bagua-cache:v1:single") == b"sealed"
        _assert_reader_only(port + offset)
        pids = info.pids["redis"]
        deploy.down(timeout_s=5)
        assert not any(procs.pid_alive(p) for p in pids)
        with pytest.raises(ServiceUnavailableError):
            check_reader("127.0.0.1", port + offset, timeout_s=1)


def test_no_auth_means_no_read_port(tmp_path: Path) -> None:
    with private_state(tmp_path):
        info = deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port_block(1, tls=True),
                                         single=True, auth=False, maxmemory=32 * 1024**2, timeout_s=120))
        assert info.redis_read_port_offset is None
        assert "read_port_offset" not in json.loads(services_file_path().read_text())["redis"]
        assert resolve_redis_read_port_offset(info.redis_hosts) is None
        port = int(info.redis_hosts[0]["port"])
        with socket.socket() as probe:  # nothing listens where the read port would be
            assert probe.connect_ex(("127.0.0.1", port + read_port_offset(port, 1))) != 0


def test_up_warns_in_one_line_where_read_ports_listen_beyond_loopback() -> None:
    assert deploy.read_port_warning(deploy.UpConfig()) is None
    assert deploy.read_port_warning(deploy.UpConfig(host="10.1.2.3", read_ports=False)) is None
    assert deploy.UpConfig(host="10.1.2.3", read_ports=False).read_port_offset is None
    for host in ("10.1.2.3", "0.0.0.0"):
        line = deploy.read_port_warning(deploy.UpConfig(host=host))
        assert line is not None and "\n" not in line
        assert f"--host {host}" in line and "sealed cache entries only" in line and "--no-read-ports" in line


def test_read_port_settings_are_checked() -> None:
    # up: read ports with client TLS and a password only; they are ports the deployment must find free.
    assert deploy.UpConfig(redis_port=7000).read_port_offset == TLS_PORT_OFFSET
    assert deploy.UpConfig(redis_port=50000, nodes=1, replicas=0).read_port_offset == -TLS_PORT_OFFSET
    assert deploy.UpConfig(bus_tls=False).read_port_offset is None
    assert deploy.UpConfig(auth=False).read_port_offset is None
    cfg = deploy.UpConfig()
    wanted = dict((p, flag) for flag, p in deployment_ports(cfg, 29600, 7000))
    assert all("read port" in wanted[p + TLS_PORT_OFFSET] for p in range(7000, 7006))
    with pytest.raises(ConfigurationError, match="no read port offset"):
        read_port_offset(10000, 40000)  # 49999 + 20000 > 65535 and 10000 - 20000 < 1
    assert read_port_offset(45530, 10) == -TLS_PORT_OFFSET  # one node past 65535 - 20000: all go down
    tls = NodeTLS(cert_file=Path("/c"), key_file=Path("/k"), ca_file=Path("/a"), clients=True)
    node = {"port": 7000, "data_dir": Path("/d"), "deployment": "x", "cluster": True, "tls": tls, "password": "pw"}
    lines = NodeConfig(**node, read_port=27000).config_text().splitlines()  # type: ignore[arg-type]
    assert "port 27000" in lines and "tls-port 7000" in lines
    assert f"user {READER_USER} {' '.join(reader_acl_rules())}" in lines
    assert "port 0" in NodeConfig(**node).config_text().splitlines()  # type: ignore[arg-type]
    for bad, why in ((7000, "its client port"), (17000, "its cluster bus port"), (70000, "out of range"),
                     (True, "out of range")):
        with pytest.raises(ConfigurationError, match=why):
            NodeConfig(**node, read_port=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs TLS on the client port"):
        NodeConfig(**node | {"tls": NodeTLS(cert_file=Path("/c"), key_file=Path("/k"), ca_file=Path("/a"))},
                   read_port=27000)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="without a password"):
        NodeConfig(**node | {"password": None}, read_port=27000)  # type: ignore[arg-type]
