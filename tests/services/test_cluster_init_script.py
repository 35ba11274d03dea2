"""services/redis-cluster-init.sh (compose's one-shot ``redis-init``), run natively against real redis-servers.

The case it must survive: a Redis container restarts (a crash under ``restart: unless-stopped``, or an operator's
``docker compose restart``) and its tmpfs, ``nodes.conf`` included, is new. The node comes back alone, with no
slot, while its replica has taken over. The next ``compose up`` runs the script again; before, it tried to
create the cluster anew and failed, and the autotune service, which waits for it, never started. Now the node is
added back as a replica, and every key of the cluster is still there.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from bagua_lightning.core.pinned_redis import close_cluster, cluster_client
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, running_cluster
from tests.procs import free_port_block, stop_process, wait_until

SCRIPT = Path(__file__).resolve().parents[2] / "services" / "redis-cluster-init.sh"
PASSWORD = "init-script-test-password"

pytestmark = pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli (redis-tools)")


def run_init(info: ClusterInfo, folder: Path) -> subprocess.CompletedProcess[str]:
    # As compose runs it: the password in a secret file, which the script hands redis-cli on stdin (--askpass).
    password_file = folder / "init-password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    ports = [n.port for n in info.nodes]  # masters first
    env = {"PATH": os.environ["PATH"], "BAGUA_LIGHTNING_REDIS_PASSWORD_FILE": str(password_file),
           "BAGUA_LIGHTNING_REDIS_HOST": "127.0.0.1",
           "BAGUA_LIGHTNING_REDIS_MASTERS": " ".join(map(str, ports[:3])),
           "BAGUA_LIGHTNING_REDIS_REPLICAS": " ".join(map(str, ports[3:])),
           "BAGUA_LIGHTNING_REDIS_INIT_TIMEOUT_S": "60"}
    return subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False)


def test_the_script_never_puts_the_password_in_an_environment() -> None:
    text = SCRIPT.read_text()
    assert "export REDISCLI_AUTH" not in text and "REDISCLI_AUTH=" not in text
    assert "redis-cli --askpass" in text


def test_an_unreadable_password_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-password"
    result = subprocess.run(["sh", str(SCRIPT)], env={"PATH": os.environ["PATH"],
                                                       "BAGUA_LIGHTNING_REDIS_PASSWORD_FILE": str(missing)},
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1 and str(missing) in result.stderr, result.stderr


def node(port: int) -> redis.Redis:
    return redis.Redis(port=port, password=PASSWORD, socket_timeout=5, socket_connect_timeout=2)


def cluster_info(port: int) -> dict[str, str]:
    with node(port) as client:
        text = client.execute_command("CLUSTER", "INFO")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def serves(port: int) -> bool:
    info = cluster_info(port)
    return info.get("cluster_state") == "ok" and info.get("cluster_slots_ok") == "16384"


def test_a_node_restarted_without_its_cluster_state_is_added_back_as_a_replica(tmp_path: Path) -> None:
    spec = ClusterSpec(nodes=3, replicas=1, port=free_port_block(6), state_root=tmp_path, password=PASSWORD)
    with running_cluster(spec) as info:
        first = run_init(info, tmp_path)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "already serves all 16384 slots" in first.stdout

        rc = cluster_client([(n["host"], n["port"]) for n in info.hosts], password=PASSWORD, socket_timeout=5)
        try:
            keys = {f"init-script:{i}": f"value {i}".encode() for i in range(300)}  # on every master's slots
            for key, value in keys.items():
                rc.set(key, value)
        finally:
            close_cluster(rc)

        victim = info.masters[0]
        old_id = victim.node_id
        os.kill(victim.pid, signal.SIGKILL)  # a redis-server this test's cluster started
        # The container comes back at once with a new tmpfs: same port and password, no nodes.conf, no data;
        # its old identity may still hold its slots (the failover takes the node timeout), and the script waits.
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        config = f'requirepass "{PASSWORD}"\nmasterauth "{PASSWORD}"\n'
        proc = subprocess.Popen(["redis-server", "-", "--port", str(victim.port), "--bind", "127.0.0.1",
                                 "--dir", str(fresh), "--save", "", "--appendonly", "no", "--cluster-enabled", "yes",
                                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            assert proc.stdin is not None
            proc.stdin.write(config.encode())
            proc.stdin.close()
            wait_until(lambda: bool(node(victim.port).ping()), 30, "the restarted node to answer")
            assert cluster_info(victim.port)["cluster_known_nodes"] == "1"

            again = run_init(info, tmp_path)
            assert again.returncode == 0, again.stdout + again.stderr
            assert f"node {victim.port} restarted without its cluster state" in again.stdout

            # Back as a replica (of the master that took its slots), every node serving every slot, the failed
            # entry of its old identity forgotten everywhere.
            with node(victim.port) as client:
                assert client.info("replication")["role"] == "slave"
            for n in info.nodes:
                assert serves(n.port), n.port
                with node(n.port) as client:
                    table = client.execute_command("CLUSTER", "NODES")
                table = table.decode() if isinstance(table, bytes) else str(table)
                assert old_id not in table and "fail" not in table, (n.port, table)
                assert len(table.strip().splitlines()) == 6, (n.port, table)
            rc = cluster_client([(n["host"], n["port"]) for n in info.hosts[1:]], password=PASSWORD,
                                socket_timeout=5)
            try:
                assert {key: rc.get(key) for key in keys} == keys  # the healthy nodes kept everything
            finally:
                close_cluster(rc)

            third = run_init(info, tmp_path)  # and the next `compose up` finds nothing to do
            assert third.returncode == 0 and "already serves all 16384 slots" in third.stdout, third.stdout
        finally:
            stop_process(proc)
