"""``up`` after a crash keeps what is healthy, and ``rotate-secrets`` changes secrets online.

Real processes only: the deployment is ``bagua-lightning up`` with its defaults (3 masters, 1 replica each,
TLS bus) in a private state folder; components are killed with SIGKILL as a crash would, and ``up`` is run
again through the real command line with the same arguments. Everything is stopped after (``down``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bagua_lightning.core import procs
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.pinned_redis import cluster_client, pinned_kwargs
from bagua_lightning.core.redis_server import CLUSTER_SLOTS, client_for, cluster_info
from bagua_lightning.core.services_file import ServicesInfo, read_services_file
from bagua_lightning.services import deploy
from bagua_lightning.services.health import check_autotune
from tests.procs import free_port, free_port_block, wait_until
from tests.services.test_deploy_cluster import private_state

KEYS = 300


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "--log-level", "WARNING", *args],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)


def _secrets(info: ServicesInfo) -> dict[str, str]:
    return {name: procs.read_secret(path) for name, path in info.secrets.items()}


def _tls(info: ServicesInfo) -> dict[str, object]:
    """redis-py's TLS arguments for the deployment's client ports (they speak TLS only)."""
    assert info.tls is not None
    return pinned_kwargs(info.tls)


def _redis_pids(info: ServicesInfo) -> dict[int, int]:
    """``{port: pid}`` of every Redis node, from the Redis deployment's own record."""
    from bagua_lightning.services.redis_records import read_deployments

    (cluster,) = read_deployments(Path(str(info.state_dir)), int(info.redis_hosts[0]["port"]))
    return {n.port: n.pid for n in cluster.nodes}


def _reap(pid: int) -> bool:
    procs.reap(pid)  # `up` ran in this process: its children become our zombies when killed
    return not procs.pid_alive(pid)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _reap(pid), 20, f"pid {pid} to die")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], dict[str, bytes]]]:
    """``up`` through the CLI on free ports, and KEYS keys written to (and replicated by) every shard."""
    tmp = tmp_path_factory.mktemp("recovery")
    with private_state(tmp):
        args = ["--autotune-port", str(free_port()), "--lighthouse-port", str(free_port()), "--redis-port", str(free_port_block(6, tls=True)), "--maxmemory", "64mb",
                "--timeout", "120"]
        result = _cli("up", *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count(": started (pid") == 8, result.stdout  # 6 nodes, autotune, lighthouse
        info = read_services_file()
        assert info is not None
        first = info.redis_hosts[0]
        keys = {f"cached:{i}": os.urandom(16) for i in range(KEYS)}
        with cluster_client([(first["host"], first["port"])], password=_secrets(info)["redis_password"],
                            socket_timeout=10, **_tls(info)) as rc:
            for key, value in keys.items():
                rc.set(key, value)
        for host in info.redis_hosts:  # every write on every replica too, before anything is killed
            with client_for(host["host"], host["port"], _secrets(info)["redis_password"], timeout_s=10,
                            tls=info.tls) as c:
                assert c.execute_command("WAIT", 1, 5000) == 1
        yield args, keys


def _token_works(address: str, token: str) -> None:
    """An authenticated call succeeds with ``token`` and is refused with another one."""
    from bagua_lightning.client.autotune import AutotuneClient
    from bagua_lightning.client.retry import ExponentialBackoff, Retry
    from bagua_lightning.core.errors import AutotuneAuthenticationError

    def client(secret: str) -> AutotuneClient:
        return AutotuneClient(target=address, token=secret, timeout_s=10.0,
                              retry=Retry(backoff=ExponentialBackoff(), retries=0, retryable=lambda e: False))
    with client(token) as ok:
        ok.list_models()
    with client("not-the-token") as bad, pytest.raises(AutotuneAuthenticationError):
        bad.list_models()


def _check_keys(info: ServicesInfo, keys: dict[str, bytes]) -> None:
    first = info.redis_hosts[0]
    with cluster_client([(first["host"], first["port"])], password=_secrets(info)["redis_password"],
                        socket_timeout=10, **_tls(info)) as rc:
        assert {k: rc.get(k) for k in keys} == keys


def test_up_after_the_autotune_service_was_killed_restarts_only_it(
        deployment: tuple[list[str], dict[str, bytes]]) -> None:
    args, keys = deployment
    before = read_services_file()
    assert before is not None
    secrets, redis_pids = _secrets(before), _redis_pids(before)
    _kill(before.pids["autotune"])

    result = _cli("up", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": kept (pid") == 7 and "autotune service" in result.stdout  # 6 nodes, lighthouse
    assert "restarted (pid " in result.stdout and f"was: process {before.pids['autotune']} is gone" in result.stdout

    after = read_services_file()
    assert after is not None and after.deployment == before.deployment
    assert _redis_pids(after) == redis_pids and after.pids["redis"] == before.pids["redis"]
    assert _secrets(after) == secrets
    assert after.pids["autotune"] != before.pids["autotune"]
    assert after.tls is not None  # `up` serves clients over TLS only
    assert check_autotune(str(after.autotune), token=secrets["autotune_token"], tls_ca=Path(after.tls.ca)).healthy
    _token_works(str(after.autotune), secrets["autotune_token"])
    _check_keys(after, keys)


def test_up_after_a_master_was_killed_restarts_only_that_node(
        deployment: tuple[list[str], dict[str, bytes]]) -> None:
    args, keys = deployment
    before = read_services_file()
    assert before is not None
    secrets, redis_pids = _secrets(before), _redis_pids(before)
    victim = int(before.redis_hosts[1]["port"])  # a master (recorded masters first)
    _kill(redis_pids[victim])

    result = _cli("up", *args)  # at once: `up` waits for the replica to take over before restarting the node
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": kept (pid") == 7, result.stdout  # 5 nodes, autotune, lighthouse
    assert f"redis node 127.0.0.1:{victim}: restarted" in result.stdout

    after = read_services_file()
    assert after is not None and _secrets(after) == secrets and after.pids["autotune"] == before.pids["autotune"]
    pids = _redis_pids(after)
    assert {p: pid for p, pid in pids.items() if p != victim} == {p: pid for p, pid in redis_pids.items() if p != victim}
    assert pids[victim] != redis_pids[victim] and procs.pid_alive(pids[victim])
    assert all(h.healthy for h in deploy.running_services(after).values()), deploy.running_services(after)
    password = secrets["redis_password"]

    def rejoined_as_replica() -> bool:
        with client_for("127.0.0.1", victim, password, tls=after.tls) as c:
            repl = c.info("replication")
            return repl["role"] == "slave" and repl["master_link_status"] == "up"
    wait_until(rejoined_as_replica, 60, f"node {victim} to rejoin as the replica of its successor")
    with client_for("127.0.0.1", victim, password, tls=after.tls) as c:
        fields = cluster_info(c)
        assert fields["cluster_state"] == "ok" and int(fields["cluster_slots_ok"]) == CLUSTER_SLOTS
    _check_keys(after, keys)  # the surviving shards, and the failed-over one through its replica


def test_rotate_the_redis_password_online(deployment: tuple[list[str], dict[str, bytes]]) -> None:
    _, keys = deployment
    before = read_services_file()
    assert before is not None
    old = _secrets(before)["redis_password"]
    ports = sorted(_redis_pids(before))

    result = _cli("rotate-secrets", "--redis-password")
    assert result.returncode == 0, result.stderr
    assert "--finish" in result.stdout
    info = read_services_file()
    assert info is not None
    new = _secrets(info)["redis_password"]
    assert new != old and old not in Path(os.environ["BAGUA_LIGHTNING_SERVICES_FILE"]).read_text()
    for port in ports:  # both work during the grace period
        for password in (old, new):
            with client_for("127.0.0.1", port, password, tls=info.tls) as c:
                assert c.ping()
    assert all(h.healthy for h in deploy.running_services(info).values())

    result = _cli("rotate-secrets", "--finish")
    assert result.returncode == 0, result.stderr
    for port in ports:
        with client_for("127.0.0.1", port, old, tls=info.tls) as c, pytest.raises(redis.AuthenticationError):
            c.ping()
        with client_for("127.0.0.1", port, new, tls=info.tls) as c:
            repl = c.info("replication")  # replication keeps authenticating (masterauth follows)
            if repl["role"] == "slave":
                assert repl["master_link_status"] == "up"
    assert not Path(info.secrets["redis_password"] + ".previous").exists()
    assert all(h.healthy for h in deploy.running_services(read_services_file()).values())
    _check_keys(info, keys)
    one = _cli("rotate-secrets", "--finish")
    assert one.returncode == 2 and "no password rotation is open" in one.stderr


def test_up_fresh_starts_over(deployment: tuple[list[str], dict[str, bytes]]) -> None:
    args, _ = deployment
    before = read_services_file()
    assert before is not None
    old = _secrets(before)
    result = _cli("up", *args, "--fresh")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": started (pid") == 8 and "kept" not in result.stdout
    after = read_services_file()
    assert after is not None and after.deployment != before.deployment
    assert _secrets(after)["redis_password"] != old["redis_password"]
    assert not any(procs.pid_alive(p) for p in before.pids["redis"])


def test_partly_running_services_with_other_settings_are_not_restarted(tmp_path: Path) -> None:
    with private_state(tmp_path):
        cfg = deploy.UpConfig(autotune_port=free_port(), redis_port=free_port(), single=True, maxmemory=32 * 1024**2)
        info = deploy.up(cfg)
        _kill(info.pids["autotune"])
        other = deploy.UpConfig(autotune_port=free_port(), redis_port=cfg.redis_port, single=True)
        with pytest.raises(ConfigurationError, match=r"runs partly, with other settings .*--fresh"):
            deploy.up(other)
        assert procs.pid_alive(info.pids["redis"][0])
        lines: list[str] = []
        again = deploy.up(deploy.UpConfig(single=True, maxmemory=32 * 1024**2), report=lines.append)  # no ports
        assert again.autotune == info.autotune and again.redis_hosts == info.redis_hosts
        # the Redis node, the autotune service, the lighthouse
        assert [ln.split(" (")[0].rsplit(": ", 1)[1] for ln in lines] == ["kept", "restarted", "kept"], lines
