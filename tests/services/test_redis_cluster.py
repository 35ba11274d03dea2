"""Local Redis tooling: real redis-server processes, a cluster serving all slots, the CLI, clean stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from bagua_lightning.cli import main as cli_main
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.services import redis_cluster
from bagua_lightning.services.redis_cluster import ClusterSpec, is_redis_pid, start_cluster, stop_cluster
from tests.client.conftest import free_port_block


def test_module_imports_without_torch() -> None:
    code = ("import sys, bagua_lightning.services.redis_cluster, bagua_lightning.services.redis_cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False"


def test_single_master_cluster_serves_every_slot_and_stops_cleanly(tmp_path: Path) -> None:
    spec = ClusterSpec(nodes=1, port=free_port_block(1), state_root=tmp_path, password="pw")
    info = start_cluster(spec)
    try:
        assert info.cluster and info.password_set and len(info.masters) == 1
        recorded = json.loads((info.state_dir / "deployment.json").read_text())
        assert "pw" not in json.dumps(recorded)  # the password is never recorded
        with redis.RedisCluster(host="127.0.0.1", port=spec.port, password="pw") as rc:
            rc.mset_nonatomic({f"k{i}": i for i in range(100)})
            assert int(rc.get("k42") or 0) == 42
        status = redis_cluster.cluster_status(spec.port, tmp_path, password="pw")
        assert status[0]["cluster_state"] == "ok" and status[0]["slots_ok"] == 16384
        with pytest.raises(ConfigurationError, match="already running"):
            start_cluster(spec)
    finally:
        stopped = stop_cluster(spec.port, tmp_path)
    assert stopped == info.pids and not any(is_redis_pid(p) for p in info.pids)
    assert not info.state_dir.exists()


def test_cli_up_status_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port_block(6)
    common = ["--state-dir", str(tmp_path)]
    try:
        assert cli_main(["redis", "up", "--nodes", "3", "--replicas", "1", "--port", str(port),
                         "--maxmemory", "64mb", *common]) == 0
        out = capsys.readouterr().out
        hosts = ",".join(f"127.0.0.1:{port + i}" for i in range(3))
        assert f"hosts: {hosts}" in out and f"BAGUA_LIGHTNING_REDIS_HOSTS={hosts}" in out
        assert cli_main(["redis", "status", "--json", *common]) == 0
        (entry,) = json.loads(capsys.readouterr().out)["deployments"]
        assert entry["cluster_state"] == "ok" and entry["slots_ok"] == 16384
        assert [n["role"] for n in entry["nodes"]] == ["master"] * 3 + ["replica"] * 3
        password = Path(entry["password_file"]).read_text()  # made by `up`: authentication is on by default
        with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis(port=port, password=password) as c:
            assert int(c.config_get("maxmemory")["maxmemory"]) == 64 * 1024 * 1024
    finally:
        assert cli_main(["redis", "down", *common]) == 0
    assert "stopped 6 redis-server" in capsys.readouterr().out
    assert cli_main(["redis", "status", *common]) == 1


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"nodes": 0}, "at least one node"),
    ({"replicas": -1}, "negative"),
    ({"replicas": 1, "cluster": False}, "needs a cluster"),
    ({"port": 55534, "nodes": 3}, r"1\.\.55535"),
    ({"port": 0}, r"ports 0\.\.2"),
])
def test_bad_specs_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        ClusterSpec(**kwargs)  # type: ignore[arg-type]


def test_cli_rejects_bad_sizes_and_single_with_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["redis", "up", "--maxmemory", "lots"])
    err = capsys.readouterr().err
    assert "'lots' is not bytes" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["redis", "up", "--single", "--nodes", "3"]) == 2
