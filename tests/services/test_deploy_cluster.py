"""The default Redis deployment of ``bagua-lightning up``: replicas that take over a killed master, a cluster
bus over mutual TLS that a rogue node cannot join, and ``status`` naming a foreign node when one is in.

Real processes only: the deployment is ``deploy.up`` itself, the rogue a password-less ``redis-server``
(run as ``nobody`` when the tests run as root) that sends ``CLUSTER MEET`` to the bus; all are stopped after.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from bagua_lightning.core import procs
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.pinned_redis import cluster_client, pinned_kwargs
from bagua_lightning.core.redis_server import (
    CLUSTER_SLOTS,
    NodeConfig,
    NodeTLS,
    client_for,
    cluster_info,
)
from bagua_lightning.core.services_file import ENV_FILE, ServicesInfo, read_services_file
from bagua_lightning.core.tls_trust import TLS_ENV, ClientTLS
from bagua_lightning.services import deploy
from tests.procs import free_port, free_port_block, stop_process, wait_until

ROGUE_WATCH_S = 8.0  # how long the rogue keeps trying before we conclude it stayed out


@contextlib.contextmanager
def private_state(tmp: Path) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(tmp))
        mp.setenv(ENV_FILE, str(tmp / "services.json"))
        for name in ("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "BAGUA_LIGHTNING_REDIS_HOSTS",
                     "BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN", *TLS_ENV):
            mp.delenv(name, raising=False)
        try:
            yield
        finally:
            deploy.down(timeout_s=5)


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServicesInfo]:
    """``up`` with its defaults (3 masters, 1 replica each, TLS bus) on free ports; ``down`` after."""
    yield from default_deployment(tmp_path_factory, "ha")


def default_deployment(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[ServicesInfo]:
    """``up`` with its defaults on free ports in a private state folder (for a module fixture); ``down`` after."""
    with private_state(tmp_path_factory.mktemp(name)):
        yield deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port_block(6, tls=True),
                                        maxmemory=64 * 1024**2, timeout_s=120))


def _password(info: ServicesInfo) -> str:
    return procs.read_secret(info.secrets["redis_password"])


def _known_nodes(host: str, port: int, password: str, tls: ClientTLS | None = None) -> dict[str, dict[str, str]]:
    """``CLUSTER NODES`` of one node: ``{node id: {"address", "flags"}}``."""
    with client_for(host, port, password, tls=tls) as c:
        c.set_response_callback("CLUSTER NODES", lambda response, **_: response)  # the raw text
        text = c.execute_command("CLUSTER NODES").decode()
    out = {}
    for line in text.splitlines():
        fields = line.split()
        out[fields[0]] = {"address": fields[1], "flags": fields[2]}
    return out


@contextlib.contextmanager
def rogue_node() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A password-less cluster-enabled redis-server, as an unprivileged user would start one."""
    port = free_port_block(1)  # its port and its bus port
    folder = Path(tempfile.mkdtemp(prefix="rogue-redis-"))  # in /tmp: reachable by `nobody`
    os.chmod(folder, 0o777)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-config-file", "rogue-nodes.conf", "--dir", str(folder), "--save", "", "--appendonly", "no"]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        rogue = redis.Redis(port=port, socket_timeout=2)
        wait_until(lambda: bool(rogue.ping()), 20, "the rogue redis-server")
        yield port, proc
    finally:
        stop_process(proc)
        shutil.rmtree(folder, ignore_errors=True)


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "status", *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------ settings


def test_localhost_is_resolved_and_a_wildcard_announces_a_reachable_address() -> None:
    assert deploy.UpConfig(host="localhost").host == "127.0.0.1"
    with pytest.raises(ConfigurationError, match=r"--announce-ip 127\.0\.0\.1 with --host 0\.0\.0\.0"):
        deploy.UpConfig(host="0.0.0.0", announce_ip="127.0.0.1")
    with pytest.raises(ConfigurationError, match=r"--announce-ip 10\.9\.8\.7 with --host 127\.0\.0\.1"):
        deploy.UpConfig(host="127.0.0.1", announce_ip="10.9.8.7")
    try:
        cfg = deploy.UpConfig(host="0.0.0.0")
    except ConfigurationError as exc:  # a machine without any non-loopback address
        assert "--announce-ip" in str(exc)
    else:
        assert cfg.announce_ip and not deploy.is_loopback(cfg.announce_ip)
        assert cfg.autotune_address.startswith(cfg.announce_ip)
    cfg = deploy.UpConfig(host="0.0.0.0", announce_ip="10.9.8.7")
    assert cfg.client_host == "10.9.8.7" and cfg.replicas == 1
    assert deploy.UpConfig(single=True).replicas == 0
    text = NodeConfig(port=7000, data_dir=Path("/d"), deployment="x", cluster=True, announce_ip="10.9.8.7",
                      tls=NodeTLS(cert_file=Path("/c"), key_file=Path("/k"), ca_file=Path("/a"))).config_text()
    for line in ("cluster-announce-ip 10.9.8.7", "tls-cluster yes", "tls-replication yes", "tls-auth-clients yes",
                 "cluster-port 17000", "tls-port 27000", "port 7000"):
        assert line in text.splitlines()
    # TLS for clients too (up's default): the plain port closed, the node's port speaks TLS only.
    text = NodeConfig(port=7000, data_dir=Path("/d"), deployment="x", cluster=True,
                      tls=NodeTLS(cert_file=Path("/c"), key_file=Path("/k"), ca_file=Path("/a"), clients=True)
                      ).config_text()
    for line in ("port 0", "tls-port 7000", "cluster-port 17000", "tls-cluster yes", "tls-replication yes",
                 "tls-auth-clients yes"):
        assert line in text.splitlines()


# --------------------------------------------------------------------------------- the HA deployment


def test_up_starts_masters_with_replicas_over_a_tls_bus(ha: ServicesInfo) -> None:
    password, tls = _password(ha), ha.tls
    assert tls is not None
    base = int(ha.redis_hosts[0]["port"])
    assert [h["port"] for h in ha.redis_hosts] == [base, base + 1, base + 2]
    assert len(ha.redis_node_ids) == 6 and len(ha.processes["redis"]) == 6
    roles = {}
    for port in range(base, base + 6):
        with client_for("127.0.0.1", port, password, tls=tls) as c:
            repl = c.info("replication")
            roles[port] = repl["role"]
            if repl["role"] == "slave":  # replication runs over TLS to the master's (TLS-only) port
                assert repl["master_link_status"] == "up"
                assert int(repl["master_port"]) in set(range(base, base + 3))
    assert sorted(roles.values()) == ["master"] * 3 + ["slave"] * 3
    # The plain port is closed: nothing answers a plaintext client on a node's port.
    with pytest.raises(redis.ConnectionError), redis.Redis(port=base, password=password, socket_timeout=2,
                                                            socket_connect_timeout=2) as plain:
        plain.ping()
    # A TLS client is given the TLS ports (= the nodes' ports) by the cluster.
    def every_node_is_listed() -> bool:  # replicas show once gossip has told every master about them
        with cluster_client([("127.0.0.1", base)], password=password, socket_timeout=5,
                            **pinned_kwargs(tls)) as rc:
            return {n.port for n in rc.get_nodes()} == set(range(base, base + 6))
    wait_until(every_node_is_listed, 30, "CLUSTER SLOTS to list all six nodes at their TLS ports")
    with cluster_client([("127.0.0.1", base)], password=password, socket_timeout=5, **pinned_kwargs(tls)) as rc:
        rc.set("deploy-test:key", b"v")
        assert rc.get("deploy-test:key") == b"v"
    # The bus demands TLS: a plain connection to it is dropped without an answer.
    with socket.create_connection(("127.0.0.1", base + 10000), timeout=5) as s:
        s.sendall(b"PING\r\n")
        s.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert not s.recv(100).startswith(b"+PONG")
    # Certificates: 0600 files in a 0700 folder, the CA's key already deleted, none on a command line.
    tls = Path(ha.state_dir or "") / deploy.SECRETS_DIR / deploy.REDIS_TLS_DIR
    assert oct(tls.stat().st_mode & 0o777) == "0o700" and not (tls / "ca.key").exists()
    files = sorted(tls.iterdir())
    # six nodes, the trainers' client key and the autotune service's key
    assert sorted(f.name for f in files if f.suffix == ".key") == sorted(
        [f"node-{p}.key" for p in range(base, base + 6)] + ["client.key", "autotune.key"])
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in files)
    for rec in ha.processes["redis"]:
        assert not any(str(tls) in arg or arg.endswith((".key", ".crt")) for arg in psutil.Process(rec.pid).cmdline())


def test_a_rogue_node_cannot_join_through_the_bus(ha: ServicesInfo) -> None:
    password = _password(ha)
    ours = set(ha.redis_node_ids)
    target = ha.redis_hosts[0]
    with rogue_node() as (rogue_port, _):
        rogue = redis.Redis(port=rogue_port, socket_timeout=2)
        rogue_id = rogue.execute_command("CLUSTER MYID").decode()
        assert rogue.execute_command("CLUSTER MEET", "127.0.0.1", target["port"], target["port"] + 10000)
        deadline = time.monotonic() + ROGUE_WATCH_S
        while time.monotonic() < deadline:  # it must never appear, not only be gone at the end
            for host in ha.redis_hosts:
                known = _known_nodes(host["host"], host["port"], password, ha.tls)
                assert set(known) == ours, f"foreign node in CLUSTER NODES of {host}: {set(known) - ours}"
                assert rogue_id not in known
            time.sleep(0.2)
        # The rogue never completed its handshake either: it learned none of our nodes' ids (a node met but not
        # yet greeted stands in its table under a random id with the flag "handshake"; its TCP link to the TLS
        # bus may read "connected" meanwhile, which says nothing about the handshake).
        rogue_view = rogue.execute_command("CLUSTER NODES")
        learned = {v.get("node_id") for v in rogue_view.values()} & ours
        assert not learned, f"the rogue learned our node ids {learned}: {rogue_view}"
    status = _status("--json")
    assert json.loads(status.stdout)["redis"]["healthy"] is True, status.stdout


def test_a_killed_master_is_failed_over_to_its_replica(ha: ServicesInfo) -> None:
    # Last test of the module: it kills one of the fixture's masters (down() stops the rest).
    password = _password(ha)
    first, victim = ha.redis_hosts[0], ha.redis_hosts[1]
    victim_rec = ha.processes["redis"][1]  # recorded in port order, masters first
    assert victim["port"] == first["port"] + 1
    os.kill(victim_rec.pid, signal.SIGKILL)

    def served_by_live_masters() -> bool:
        with client_for(first["host"], first["port"], password, tls=ha.tls) as c:
            if cluster_info(c).get("cluster_state") != "ok":
                return False
            slots = c.execute_command("CLUSTER SLOTS")
        owners = {(int(e[0]), int(e[1])): int(e[2][1]) for e in slots}  # [lo, hi, [host, port, id], ...]
        return (victim["port"] not in owners.values()
                and sum(hi - lo + 1 for lo, hi in owners) == CLUSTER_SLOTS)
    wait_until(served_by_live_masters, 60, "the replica of the killed master to take over its slots")
    assert ha.tls is not None
    with cluster_client([(first["host"], first["port"])], password=password, socket_timeout=5,
                        **pinned_kwargs(ha.tls)) as rc:
        for i in range(50):  # keys in every master's slots, the failed-over ones included
            rc.set(f"after-failover:{i}", str(i))
            assert rc.get(f"after-failover:{i}") == str(i).encode()


# ------------------------------------------------------------------------------ status: foreign nodes


def test_status_names_a_foreign_node_in_the_cluster(tmp_path: Path) -> None:
    # A deployment with a plain bus (no TLS, no replicas): the rogue really joins, and status must say so.
    with private_state(tmp_path / "state"):
        info = deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port_block(3, tls=True), replicas=0,
                                         bus_tls=False, maxmemory=32 * 1024**2, timeout_s=120))
        assert _status().returncode == 0
        password = _password(info)
        target = info.redis_hosts[0]
        with rogue_node() as (rogue_port, _):
            rogue = redis.Redis(port=rogue_port, socket_timeout=2)
            rogue_id = rogue.execute_command("CLUSTER MYID").decode()
            rogue.execute_command("CLUSTER MEET", "127.0.0.1", target["port"], target["port"] + 10000)
            wait_until(lambda: rogue_id in _known_nodes(target["host"], target["port"], password), 30,
                       "the rogue to join the plain bus")
            status = _status()
            assert status.returncode == 1, status.stdout + status.stderr
            line = next(ln for ln in status.stdout.splitlines() if ln.startswith("redis:"))
            assert "UNHEALTHY" in line and "foreign" in line and rogue_id in line, line
        recorded = read_services_file()
        assert recorded is not None and recorded.redis_node_ids == info.redis_node_ids
