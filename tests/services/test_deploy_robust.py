"""``up``, ``down`` and the demo on an ordinary, shared machine: default ports taken by another deployment,
IPv6 loopback, a full disk, a stale record; each with real processes in a private state folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.core import procs
from bagua_lightning.core.errors import ServiceUnavailableError
from bagua_lightning.core.pinned_redis import pinned_kwargs, redis_client
from bagua_lightning.core.procs import ProcessRecord
from bagua_lightning.core.services_file import ServicesInfo, read_services_file, write_services_file
from bagua_lightning.services import deploy
from bagua_lightning.services.deploy_config import UpConfig, deployment_ports
from bagua_lightning.services.deploy_ports import claimed
from bagua_lightning.services.health import Health, wait_healthy
from tests.procs import free_port, free_port_block, wait_until
from tests.services.conftest import cli, one_line_error
from tests.services.test_deploy_cluster import private_state


@contextlib.contextmanager
def listening(*ports: int, host: str = "127.0.0.1", or_taken: bool = True) -> Iterator[None]:
    """Another program's listeners on ``ports`` for the block (``or_taken``: a port that some other process
    of this shared machine took first is just as taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = []
    try:
        for port in ports:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            try:
                s.bind((host, port))
            except OSError as exc:
                s.close()
                if or_taken and exc.errno == errno.EADDRINUSE:
                    continue
                raise
            s.listen()
            held.append(s)
        yield
    finally:
        for s in held:
            s.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ ports


def test_no_port_named_takes_another_free_block_when_the_first_is_taken() -> None:
    cfg = UpConfig()  # a cluster of 6 nodes with TLS: client (TLS) and bus ports
    with claimed(cfg) as first:
        assert first.autotune_port and first.redis_port
    taken_bus = first.redis_port + 3 + 10000
    with listening(taken_bus, first.autotune_port), claimed(cfg) as second:
        assert second.autotune_port and second.redis_port
        ports = [p for _, p in deployment_ports(second, second.autotune_port, second.redis_port)]
        assert taken_bus not in ports and first.autotune_port not in ports
        assert len(ports) == 2 + 6 * 3  # the autotune and lighthouse ports; per node: client, bus, read port
        assert second.lighthouse_port in ports and len(set(ports)) == len(ports)
        assert second.redis_port + 6 - 1 + 10000 <= 65535


def test_up_with_no_port_named_records_the_ports_it_picked(tmp_path: Path) -> None:
    with private_state(tmp_path):
        with claimed(UpConfig(single=True)) as would:
            assert would.autotune_port and would.redis_port
        with listening(would.autotune_port, would.redis_port):  # another deployment holds them
            info = deploy.up(UpConfig(single=True, maxmemory=32 * 1024**2))
        assert info.autotune != f"127.0.0.1:{would.autotune_port}"
        assert info.redis_hosts[0]["port"] != would.redis_port
        assert read_services_file() == info
        assert deploy.up(UpConfig(single=True, maxmemory=32 * 1024**2)) == info  # the recorded ports again


def test_a_named_port_whose_bus_port_is_taken_fails_in_one_line(env: dict[str, str]) -> None:
    base = free_port_block(6, tls=True)
    with listening(base + 2 + 10000):
        one_line_error(cli(env, "up", "--redis-port", str(base), "--autotune-port", str(free_port())), 2,
                       f"port {base + 2 + 10000} on 127.0.0.1 is not free", "cluster bus")
    assert not Path(env["BAGUA_LIGHTNING_SERVICES_FILE"]).exists()


def test_up_after_everything_died_with_a_port_taken_says_which_then_fresh_starts_elsewhere(
        env: dict[str, str]) -> None:
    import signal

    first = cli(env, "up", "--single", "--maxmemory", "32mb")
    assert first.returncode == 0, first.stderr
    services = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    before = read_services_file(services)
    assert before is not None
    try:
        pids = [before.pids["autotune"], before.pids["lighthouse"], *before.pids["redis"]]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(procs.pid_alive(p) for p in pids), 30, "the killed services")
        port = before.redis_hosts[0]["port"]

        def bindable() -> bool:  # another test's process may hold it a moment: wait, then hold it ourselves
            with contextlib.suppress(OSError), socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                return True
            return False
        wait_until(bindable, 30, f"port {port} to be free to hold")
        with listening(port, or_taken=False):  # someone else took a recorded port
            one_line_error(cli(env, "up", "--single", "--maxmemory", "32mb"), 2,
                           f"deployment {before.deployment[:12]} is stopped", f"port {port} on 127.0.0.1",
                           "`up --fresh`")
            assert read_services_file(services) == before  # nothing changed: it can still come back
            again = cli(env, "up", "--single", "--maxmemory", "32mb", "--fresh")
        assert again.returncode == 0, again.stderr
        assert again.stdout.count(": started (pid") == 3 and "kept" not in again.stdout  # redis, autotune, lighthouse
        after = read_services_file(services)
        assert after is not None and after.deployment != before.deployment
        assert after.redis_hosts[0]["port"] != before.redis_hosts[0]["port"]
    finally:
        assert cli(env, "down").returncode == 0


@pytest.mark.parametrize("text", [" 80", "80 ", "8 0", "\uff17\uff10\uff10\uff10"])
def test_ports_parse_strictly(env: dict[str, str], text: str) -> None:
    for command in ("up", "demo"):
        one_line_error(cli(env, command, "--redis-port", text), 2, repr(text), "not a TCP port")


def test_the_demo_starts_its_services_on_free_ports(tmp_path: Path) -> None:
    from bagua_lightning.demo import find_or_start_services

    with claimed(UpConfig()) as would:
        pass
    with private_state(tmp_path):
        assert would.autotune_port and would.redis_port
        with listening(would.redis_port + 10000):  # the bus port of the first free block, as in the report
            endpoints = find_or_start_services(UpConfig(maxmemory=32 * 1024**2, timeout_s=120))
        assert endpoints.how == "started"
        recorded = read_services_file()
        assert recorded is not None and recorded.autotune == endpoints.autotune
        assert recorded.redis_hosts[0]["port"] != would.redis_port
        assert all(h.healthy for h in deploy.running_services(recorded).values())


# ------------------------------------------------------------------------------------------------- IPv6


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_up_on_ipv6_loopback_works_end_to_end(env: dict[str, str]) -> None:

    result = cli(env, "up", "--host", "[::1]", "--single", "--maxmemory", "32mb", "--timeout", "60")
    try:
        assert result.returncode == 0, result.stderr
        assert "[::1]:" in result.stdout
        status = cli(env, "status")
        assert status.returncode == 0 and "autotune: healthy" in status.stdout and "redis: healthy" in status.stdout
        services = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
        info = read_services_file(services)
        assert info is not None and info.redis_hosts[0]["host"] == "::1"
        password = procs.read_secret(info.secrets["redis_password"])
        assert info.tls is not None
        with redis_client("::1", info.redis_hosts[0]["port"], password=password, **pinned_kwargs(info.tls)) as r:
            r.set("v6", b"ok")
            assert r.get("v6") == b"ok"
    finally:
        assert cli(env, "down").returncode == 0


# ----------------------------------------------------------------------------------------------- disk


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -Urm (a private tmpfs for a full disk)")
@pytest.mark.parametrize("size", ["16k", "24k"])  # full after the secrets were written / after redis.conf
def test_a_full_disk_names_the_path_and_leaves_nothing_behind(env: dict[str, str], tmp_path: Path,
                                                              size: str) -> None:
    state = tmp_path / "small"
    state.mkdir()
    python = f"{sys.executable} -m bagua_lightning.cli --log-level WARNING"
    # In a private mount namespace: a tiny tmpfs as the state folder; `up`, then what is left in it, then
    # `down` (which stops whatever `up` might have left running).
    script = (f"mount -t tmpfs -o size={size} tmpfs {state} || exit 99; "
              f"{python} up --single --maxmemory 32mb --timeout 30; echo rc=$? >&2; "
              f"find {state} -type f -printf 'left %p\\n'; {python} down >/dev/null")
    result = subprocess.run(["unshare", "-Urm", "sh", "-c", script], env={**env, "XDG_STATE_HOME": str(state)},
                            capture_output=True, text=True, timeout=300)
    assert "rc=2" in result.stderr, result.stdout + result.stderr
    line = next(ln for ln in result.stderr.splitlines() if "error" in ln)
    assert "No space left on device" in line and str(state) in line and "Traceback" not in result.stderr
    assert "left " not in result.stdout, result.stdout  # no secret, no half-made file
    assert not Path(env["BAGUA_LIGHTNING_SERVICES_FILE"]).exists()


# ----------------------------------------------------------------------------------------------- down


def test_down_stops_everything_and_reports_every_record(env: dict[str, str]) -> None:
    up = cli(env, "up", "--redis-port", str(free_port_block(6, tls=True)), "--autotune-port", str(free_port()),
             "--maxmemory", "32mb", "--timeout", "120")
    assert up.returncode == 0, up.stderr
    info = read_services_file(Path(env["BAGUA_LIGHTNING_SERVICES_FILE"]))
    assert info is not None
    started = time.monotonic()
    down = cli(env, "down")
    print(f"down of 6 Redis nodes and the autotune service: {time.monotonic() - started:.2f} s")  # measured only
    assert down.returncode == 0, down.stderr
    pids = [info.pids["autotune"], info.pids["lighthouse"], *info.pids["redis"]]
    assert f"stopped 8 process(es): {' '.join(map(str, sorted(pids)))}" in down.stdout
    assert f"removed {env['BAGUA_LIGHTNING_SERVICES_FILE']} (deployment" in down.stdout
    assert "removed the Redis deployment's folder" in down.stdout and "3 secret file(s)" in down.stdout
    assert not any(procs.pid_alive(p) for p in pids)


def test_down_says_when_it_removes_a_stale_record_of_another_run(env: dict[str, str], tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    services = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    write_services_file(ServicesInfo(
        autotune=f"127.0.0.1:{free_port()}", state_dir=str(tmp_path / "elsewhere"), deployment="an-old-run",
        processes={"autotune": [ProcessRecord(pid=gone.pid, create_time=1.0, deployment="an-old-run")]}), services)
    down = cli(env, "down")
    assert down.returncode == 0, down.stderr
    assert f"removed {services}: a stale record of deployment an-old-run" in down.stdout, down.stdout
    assert not services.exists()


def test_down_says_when_it_removes_a_stale_node_local_record(env: dict[str, str]) -> None:
    import json

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = Path(env["XDG_STATE_HOME"]) / "bagua-lightning" / "redis-local"
    procs.private_dir(folder)
    procs.write_marker(folder, "an-old-run")
    procs.write_private(folder / "password", "x" * 32)
    record = ProcessRecord(pid=gone.pid, create_time=1.0, deployment="an-old-run")
    procs.write_private(folder / "server.json", json.dumps({
        "host": "127.0.0.1", "port": free_port(), "binds": ["127.0.0.1"], "maxmemory": 0,
        "process": record.to_json()}))
    down = cli(env, "down")
    assert down.returncode == 0, down.stderr
    assert f"removed the node-local cache server's record {folder} (stale: its process {gone.pid}" in down.stdout
    assert not folder.exists()


# ------------------------------------------------------------------------------- failing fast


def test_waiting_for_a_service_ends_when_its_process_exits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        with pytest.raises(ServiceUnavailableError, match="exited with code 3"):
            # The deadline is far: only the exit can end the wait.
            wait_healthy(lambda: Health(False, "not answering"), time.monotonic() + 600, "the service", proc)
    finally:
        proc.wait()


_LEFTOVERS = """
import json, os, sys
dep = json.load(open(sys.argv[1]))["deployment"]
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
    except OSError:
        continue
    if f"BAGUA_LIGHTNING_DEPLOYMENT={dep}".encode() in env:
        print("left running", pid, flush=True)
        os.kill(int(pid), 9)  # ours: it carries the deployment's id; never left behind by the test
"""


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -Urm (a private tmpfs for a full disk)")
def test_recovery_on_a_full_disk_leaves_nothing_running_unrecorded(env: dict[str, str], tmp_path: Path) -> None:
    state, services = tmp_path / "small", env["BAGUA_LIGHTNING_SERVICES_FILE"]
    state.mkdir()
    (tmp_path / "leftovers.py").write_text(_LEFTOVERS)
    python = f"{sys.executable} -m bagua_lightning.cli --log-level WARNING"
    read_pid = f"{sys.executable} -c \"import json; print(json.load(open('{services}'))['processes']['redis'][0]['pid'])\""
    # In a private mount namespace: up on a small tmpfs, kill -9 its Redis node, fill the disk, up again
    # (it must fail in one line), free the disk, down; then whatever of the deployment still runs is named.
    script = (f"mount -t tmpfs -o size=16m tmpfs {state} || exit 99; "
              f"{python} up --single --maxmemory 32mb --timeout 60 >/dev/null || exit 98; "
              f"pid=$({read_pid}); kill -9 $pid; i=0; while kill -0 $pid 2>/dev/null && [ $i -lt 200 ]; do "
              "sleep 0.05; i=$((i+1)); done; "
              f"dd if=/dev/zero of={state}/filler bs=4k 2>/dev/null; "
              f"{python} up --single --maxmemory 32mb --timeout 60; echo rc=$? >&2; "
              f"rm -f {state}/filler; cp {services} {tmp_path}/record.json; {python} down >/dev/null; "
              f"{sys.executable} {tmp_path}/leftovers.py {tmp_path}/record.json")
    result = subprocess.run(["unshare", "-Urm", "sh", "-c", script], env={**env, "XDG_STATE_HOME": str(state)},
                            capture_output=True, text=True, timeout=300)
    assert "rc=2" in result.stderr or "rc=1" in result.stderr, result.stdout + result.stderr
    errors = [ln for ln in result.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "left running" not in result.stdout, result.stdout + result.stderr


def test_down_stops_a_deployment_whose_state_folder_was_deleted(env: dict[str, str]) -> None:
    first = cli(env, "up", "--single", "--maxmemory", "32mb")
    assert first.returncode == 0, first.stderr
    services = Path(env["BAGUA_LIGHTNING_SERVICES_FILE"])
    info = read_services_file(services)
    assert info is not None
    pids = [info.pids["autotune"], info.pids["lighthouse"], *info.pids["redis"]]
    try:
        shutil.rmtree(Path(env["XDG_STATE_HOME"]) / "bagua-lightning")  # the state folder, records and all
        services.unlink()
        result = cli(env, "down")
        assert result.returncode == 0, result.stderr
        assert "was deleted" in result.stdout and info.deployment[:12] in result.stdout, result.stdout
        assert all(str(pid) in result.stdout for pid in pids), result.stdout
        wait_until(lambda: not any(procs.pid_alive(p) for p in pids), 30, "the deployment's processes to stop")
        assert "nothing to stop" in cli(env, "down").stdout
    finally:
        for rec in procs.orphans(Path(env["XDG_STATE_HOME"]) / "bagua-lightning"):  # only if down failed
            procs.stop(rec, timeout_s=5)
