"""Deployments that cannot be fooled: stale records, copied folders, other users, bad values.

Every test runs the real CLI (``python -m bagua_lightning.cli``) against real processes in a private
state folder; the innocent processes are started here (``exec -a`` renames a ``sleep``; a real
``redis-server`` started without bagua-lightning) and must survive whatever the CLI is asked to do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning import procs
from bagua_lightning.core.procs import ProcessRecord
from bagua_lightning.core.services_file import ServicesInfo, write_services_file
from tests.client.conftest import free_port_block
from tests.procs import free_port, stop_process, wait_until
from tests.services.conftest import CLI, cli, one_line_error


@pytest.fixture
def decoys() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Innocent processes whose command lines look like ours, and a redis-server nobody here started."""
    redis_port = free_port()
    argvs = [
        ["bash", "-c", 'exec -a "vim /etc/redis/redis-server.conf" sleep 300'],
        ["bash", "-c", 'exec -a "python my_train.py --autotune --serve-metrics" sleep 300'],
        ["bash", "-c", "exec -a redis-server sleep 300"],
        ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
    ]
    started = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
               for a in argvs]
    try:
        wait_until(lambda: all(procs.pid_alive(p.pid) for p in started), 10, "the decoys")
        yield started
    finally:
        for p in started:
            stop_process(p)


def test_stale_services_file_leaves_innocent_processes_alone(env: dict[str, str], tmp_path: Path,
                                                             decoys: list[subprocess.Popen[bytes]]) -> None:
    state = Path(env["XDG_STATE_HOME"]) / "bagua-lightning"
    services_file = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    procs.private_dir(state)
    procs.write_marker(state, "stale", services_file=str(services_file.resolve()))
    # Their real pids and start times, with this deployment's id (which they do not carry), and a pid
    # whose start time differs (a recycled pid).
    records = [procs.record(p.pid, "stale") for p in decoys]
    recycled = ProcessRecord(pid=decoys[0].pid, create_time=records[0].create_time - 100, deployment="stale")
    write_services_file(ServicesInfo(
        autotune=f"127.0.0.1:{free_port()}", redis_hosts=[{"host": "127.0.0.1", "port": free_port()}],
        state_dir=str(state), deployment="stale",
        processes={"autotune": [records[1]], "redis": [recycled, *records[2:]]}), services_file)

    result = cli(env, "down")
    assert result.returncode == 0, result.stderr
    assert all(p.poll() is None for p in decoys), "down signalled a process it did not start"
    status = cli(env, "status", "--json")
    assert status.returncode == 1  # nothing of ours runs


def test_old_format_services_file_is_an_error_not_a_kill(env: dict[str, str],
                                                          decoys: list[subprocess.Popen[bytes]]) -> None:
    services_file = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    services_file.write_text(json.dumps({
        "version": 1, "autotune": "127.0.0.1:29600", "redis": {"hosts": [{"host": "127.0.0.1", "port": 7000}]},
        "pids": {"autotune": decoys[1].pid, "redis": [p.pid for p in decoys]}}))
    for command in ("down", "status"):
        one_line_error(cli(env, command), 2, str(services_file), "delete it")
    assert services_file.exists() and all(p.poll() is None for p in decoys)


def test_redis_down_on_a_copied_state_folder_leaves_the_original(env: dict[str, str], tmp_path: Path) -> None:
    original, copy = tmp_path / "a", tmp_path / "b"
    port = free_port_block(1, with_bus=False)
    up = cli(env, "redis", "up", "--single", "--port", str(port), "--state-dir", str(original))
    assert up.returncode == 0, up.stderr
    try:
        (record,) = json.loads((original / "redis" / str(port) / "deployment.json").read_text())["nodes"]
        server = ProcessRecord.from_json(record["process"])
        shutil.copytree(original, copy, symlinks=True)

        down = cli(env, "redis", "down", "--port", str(port), "--state-dir", str(copy))
        assert down.returncode == 0 and "stopped 0" in down.stdout, down.stdout + down.stderr
        assert procs.is_running(server), "the original deployment's server was stopped from a copy"
        assert (original / "redis" / str(port) / "deployment.json").is_file()
        status = cli(env, "redis", "status", "--state-dir", str(original))
        assert status.returncode == 0, status.stdout
    finally:
        cli(env, "redis", "down", "--state-dir", str(original))
    assert not procs.is_running(server)
    assert not (original / "redis" / str(port)).exists()


def test_down_from_a_copied_state_folder_stops_nothing(env: dict[str, str], tmp_path: Path) -> None:
    up = cli(env, "up", "--single", "--autotune-port", str(free_port()), "--redis-port", str(free_port()),
             "--maxmemory", "32mb")
    assert up.returncode == 0, up.stderr
    services_file = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    info = json.loads(services_file.read_text())
    records = [ProcessRecord.from_json(r) for rs in info["processes"].values() for r in rs]
    try:
        copy = tmp_path / "copy"
        shutil.copytree(tmp_path / "state", copy / "state", symlinks=True)
        shutil.copy(services_file, copy / "services.json")
        copied_env = {**env, "XDG_STATE_HOME": str(copy / "state"),
                      "BAGUA_LIGHTNING_SERVICES_FILE": str(copy / "services.json")}
        one_line_error(cli(copied_env, "down"), 2, "nothing was stopped")
        assert all(procs.is_running(r) for r in records)
    finally:
        assert cli(env, "down").returncode == 0
    assert not any(procs.is_running(r) for r in records)


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("redis-cli") is None,
                    reason="needs root (to become `nobody`), setpriv and redis-cli")
def test_another_local_user_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)  # `nobody` may look in; the state folder itself is 0700
    port = free_port_block(1, with_bus=False)
    state = tmp_path / "state"
    up = cli(env, "redis", "up", "--single", "--port", str(port), "--state-dir", str(state))
    assert up.returncode == 0, up.stderr
    try:
        password_file = state / "redis" / str(port) / "password"
        password = password_file.read_text()
        assert oct(password_file.stat().st_mode & 0o777) == "0o600"
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                assert password not in Path(f"/proc/{pid}/cmdline").read_text(), "the password is on a command line"
            except OSError:
                continue
        assert password not in (state / "redis" / str(port) / f"node-{port}" / "redis.conf").read_text()

        refused = _as_nobody("redis-cli", "-p", str(port), "CONFIG", "SET", "requirepass", "mine")
        assert "NOAUTH" in refused.stdout + refused.stderr
        written = _as_nobody("redis-cli", "-p", str(port), "SET", "sample:0", "forged")
        assert "NOAUTH" in written.stdout + written.stderr
        unreadable = _as_nobody("cat", str(password_file))
        assert unreadable.returncode != 0 and password not in unreadable.stdout
        owner = subprocess.run(["redis-cli", "-p", str(port), "--no-auth-warning", "-a", password, "PING"],
                               capture_output=True, text=True, timeout=30)
        assert owner.stdout.strip() == "PONG"  # the owner still gets in
    finally:
        cli(env, "redis", "down", "--state-dir", str(state))


def test_node_local_server_is_listed_and_stopped(env: dict[str, str]) -> None:
    start = ("from bagua_lightning.core.local_redis import ensure_server; "
             "s = ensure_server(1 << 60, timeout_s=30); print(s.pid, s.maxmemory)")
    made = subprocess.run([sys.executable, "-c", start], env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    pid, maxmemory = (int(v) for v in made.stdout.split())
    import psutil

    assert maxmemory < psutil.virtual_memory().total  # capped at a share of the machine, not 2**60
    record = json.loads((Path(env["XDG_STATE_HOME"]) / "bagua-lightning" / "redis-local" / "server.json").read_text())
    server = ProcessRecord.from_json(record["process"])
    try:
        status = cli(env, "status", "--json")
        assert json.loads(status.stdout)["node-local redis"]["healthy"] is True
        listed = cli(env, "redis", "status")
        assert f"pid {pid}" in listed.stdout and "node-local cache server" in listed.stdout
        down = cli(env, "down")
        assert down.returncode == 0 and str(pid) in down.stdout, down.stdout
        assert not procs.is_running(server)
        assert not (Path(env["XDG_STATE_HOME"]) / "bagua-lightning" / "redis-local").exists()
        assert cli(env, "redis", "status").returncode == 1
    finally:
        procs.stop(server)


def test_stale_redis_deployment_record_leaves_innocent_processes_alone(env: dict[str, str], tmp_path: Path,
                                                                     decoys: list[subprocess.Popen[bytes]]) -> None:
    # A deployment folder of its own (marker and all) whose records name processes it did not start.
    folder = tmp_path / "state" / "redis" / "7000"
    procs.private_dir(folder)
    procs.write_marker(folder, "stale")
    nodes = [{"host": "127.0.0.1", "port": 7000 + i, "role": "standalone",
              "process": procs.record(p.pid, "stale").to_json()} for i, p in enumerate(decoys)]
    (folder / "deployment.json").write_text(json.dumps({"nodes": nodes, "cluster": False, "deployment": "stale"}))
    status = cli(env, "redis", "status", "--state-dir", str(tmp_path / "state"))
    assert status.returncode == 1 and "port 7000" in status.stdout
    down = cli(env, "redis", "down", "--state-dir", str(tmp_path / "state"))
    assert down.returncode == 0 and "stopped 0" in down.stdout, down.stdout + down.stderr
    assert all(p.poll() is None for p in decoys), "redis down signalled a process it did not start"
    assert not folder.exists()  # the folder was this deployment's own: its data is removed


@pytest.fixture
def deployment_process() -> Iterator[tuple[subprocess.Popen[bytes], ProcessRecord]]:
    """A live process carrying deployment ``other``'s id: what another deployment's service looks like."""
    proc = subprocess.Popen(["sleep", "300"], env=procs.child_env("other"), start_new_session=True)
    try:
        wait_until(lambda: procs.pid_alive(proc.pid), 10, "the other deployment's process")
        yield proc, procs.record(proc.pid, "other")
    finally:
        stop_process(proc)


@pytest.mark.parametrize("where", ["nowhere", "missing", "another folder", "no marker"])
def test_services_file_with_a_foreign_state_dir_stops_nothing(
        env: dict[str, str], tmp_path: Path, where: str,
        deployment_process: tuple[subprocess.Popen[bytes], ProcessRecord]) -> None:
    proc, record = deployment_process
    services_file = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    other = tmp_path / "other-state"
    state = {"nowhere": None, "missing": str(tmp_path / "gone"), "another folder": str(other),
             "no marker": str(tmp_path / "bare")}[where]
    if where == "another folder":  # a real deployment folder, but its marker names another services file
        procs.private_dir(other)
        procs.write_marker(other, "other", services_file=str(tmp_path / "elsewhere.json"))
    if where == "no marker":
        (tmp_path / "bare").mkdir()
    write_services_file(ServicesInfo(autotune=f"127.0.0.1:{free_port()}", state_dir=state, deployment="other",
                                     processes={"autotune": [record]}), services_file)

    one_line_error(cli(env, "down"), 2, "nothing was stopped", str(services_file))
    assert proc.poll() is None and procs.is_running(record), "down stopped another deployment's process"
    assert services_file.exists()
    # Once its processes are gone, the leftover file is simply removed.
    stop_process(proc)
    result = cli(env, "down")
    assert result.returncode == 0, result.stderr
    assert not services_file.exists()


def test_dead_node_local_server_is_a_stale_record_until_down(env: dict[str, str]) -> None:
    up = cli(env, "up", "--single", "--autotune-port", str(free_port()), "--redis-port", str(free_port()),
             "--maxmemory", "32mb")
    assert up.returncode == 0, up.stderr
    try:
        start = "from bagua_lightning.core.local_redis import ensure_server; print(ensure_server(1 << 26).pid)"
        made = subprocess.run([*CLI[:1], "-c", start], env=env, capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        os.kill(int(made.stdout), 9)
        wait_until(lambda: not procs.pid_alive(int(made.stdout)), 10, "the node-local server to die")
        folder = Path(env["XDG_STATE_HOME"]) / "bagua-lightning" / "redis-local"

        status = cli(env, "status")
        assert status.returncode == 0, status.stdout + status.stderr  # a leftover record is not a failure
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith("node-local redis"))
        assert "stale record" in line and "UNHEALTHY" not in line and "down" in line, line
        report = json.loads(cli(env, "status", "--json").stdout)["node-local redis"]
        assert report["stale"] is True and report["healthy"] is False
        assert (folder / "server.json").exists()  # status reports it, only down cleans it
    finally:
        assert cli(env, "down").returncode == 0
    assert not folder.exists()
