"""The fault-tolerance coordinator (torchft's Lighthouse) as a service of ``bagua-lightning up``: started, listed by
``status``, restarted by ``up`` after kill -9, stopped by ``down``, found by ``FaultTolerance()`` through the
services file; and the ``lighthouse`` command itself, torch-free and loopback by default. Real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from bagua_lightning.core import procs
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.services_file import ENV_FILE, ENV_LIGHTHOUSE, read_services_file
from bagua_lightning.lighthouse import torchft_extension
from bagua_lightning.services import deploy
from bagua_lightning.services.deploy_config import lighthouse_warning
from bagua_lightning.services.health import check_lighthouse
from tests.procs import bindable, free_port, stop_process, wait_until


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "services.json"))
    for name in ("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_REDIS_PASSWORD",
                 ENV_LIGHTHOUSE):
        monkeypatch.delenv(name, raising=False)
    try:
        yield tmp_path
    finally:
        deploy.down(timeout_s=5)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bagua_lightning.cli", *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=180)


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def _joins_a_quorum(address: str) -> list[str]:
    """A torchft client asks the Lighthouse for a quorum: the replica ids of the quorum it forms."""
    client = torchft_extension().LighthouseClient(f"http://{address}", timedelta(seconds=10))
    quorum = client.quorum(replica_id="probe0", timeout=timedelta(seconds=20), world_size=1)
    return [member.replica_id for member in quorum.participants]


def test_up_starts_the_lighthouse_status_lists_it_up_restarts_it_after_kill_9_down_stops_it(state: Path) -> None:
    port = free_port()
    args = ["up", "--single", "--autotune-port", str(free_port()), "--redis-port", str(free_port()),
            "--lighthouse-port", str(port), "--maxmemory", "32mb", "--timeout", "120"]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr
    address = f"127.0.0.1:{port}"
    assert f"lighthouse {address}: started (pid " in first.stdout
    assert f"TORCHFT_LIGHTHOUSE=http://{address}" in first.stdout
    info = read_services_file()
    assert info is not None and info.lighthouse == address
    pid = info.pids["lighthouse"]
    assert _listening(pid) == {("127.0.0.1", port)}  # loopback only
    assert (state / "bagua-lightning" / deploy.LIGHTHOUSE_LOG).is_file()

    status = _cli("status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["lighthouse"]["healthy"] is True
    # A real torchft client forms a quorum with it, and trainers find it through the services file.
    assert _joins_a_quorum(address) == ["probe0"]
    from bagua_lightning.engine.fault_tolerance import FaultTolerance

    assert FaultTolerance(node_id="node0").resolved().lighthouse == f"http://{address}"

    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not procs.pid_alive(pid), 30, "the killed lighthouse")
    dead = _cli("status")
    assert dead.returncode == 1 and f"lighthouse: UNHEALTHY (process {pid} is gone)" in dead.stdout, dead.stdout
    assert "autotune: healthy" in dead.stdout and "redis: healthy" in dead.stdout

    again = _cli(*args)
    assert again.returncode == 0, again.stderr
    assert f"lighthouse {address}: restarted (pid " in again.stdout and f"was: process {pid} is gone" in again.stdout
    assert again.stdout.count(": kept (pid") == 2, again.stdout  # the Redis node and the autotune service
    after = read_services_file()
    assert after is not None and after.lighthouse == address and after.deployment == info.deployment
    assert after.pids["lighthouse"] != pid and after.pids["autotune"] == info.pids["autotune"]
    assert check_lighthouse(address).healthy
    assert _joins_a_quorum(address) == ["probe0"]

    down = _cli("down")
    assert down.returncode == 0, down.stderr
    assert str(after.pids["lighthouse"]) in down.stdout
    assert not procs.pid_alive(after.pids["lighthouse"]) and bindable(port)
    assert not check_lighthouse(address, timeout_s=1.0).healthy


_NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'lightning'):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, NoTorch())
from bagua_lightning.cli import main
sys.exit(main(['lighthouse', '--port', '0']))
"""


def test_the_lighthouse_command_runs_without_torch_on_loopback(tmp_path: Path) -> None:
    # As in the torch-free services image: only torchft's extension module is loaded.
    log = tmp_path / "lighthouse.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _NO_TORCH], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        # Our own line, not torchft's: its Rust logger writes its own "listening on" to the same file.
        ours = re.compile(rb"lighthouse listening on http://(\S+?:\d+)")
        wait_until(lambda: ours.search(log.read_bytes()) is not None or proc.poll() is not None, 60, "the lighthouse")
        found = ours.search(log.read_bytes())
        assert found is not None, log.read_text()
        address = found.group(1).decode()
        assert address.startswith("127.0.0.1:") and "WARNING" not in log.read_text()
        assert check_lighthouse(address).healthy
        assert _listening(proc.pid) == {("127.0.0.1", int(address.rpartition(":")[2]))}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        stop_process(proc)


def test_beyond_loopback_one_line_says_what_the_lighthouse_exposes() -> None:
    assert lighthouse_warning("127.0.0.1", 29510) is None and lighthouse_warning("::1", 29510) is None
    warning = lighthouse_warning("10.0.0.5", 29511)
    assert warning is not None and "\n" not in warning
    assert "port 29511" in warning and "no credentials and no TLS" in warning and "private network" in warning
    cfg = deploy.UpConfig(host="10.0.0.5", lighthouse_port=29511)
    assert "`up --no-lighthouse` starts none" in str(deploy._lighthouse_warning(cfg))
    assert deploy._lighthouse_warning(deploy.UpConfig(host="10.0.0.5", lighthouse=False)) is None


def test_a_lighthouse_port_that_collides_is_refused_naming_both() -> None:
    with pytest.raises(ConfigurationError, match=r"lighthouse_port 29600 collides .*--autotune-port"):
        deploy.UpConfig(autotune_port=29600, lighthouse_port=29600)
    with pytest.raises(ConfigurationError, match=r"lighthouse_port 17001 collides .*cluster bus"):
        deploy.UpConfig(redis_port=7000, lighthouse_port=17001)


def test_a_status_page_that_is_not_torchfts_is_unhealthy(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "status").write_text("hello")
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_until(lambda: not bindable(port), 30, "the stand-in HTTP server")
        health = check_lighthouse(f"127.0.0.1:{port}")
        assert not health.healthy and "not as torchft's Lighthouse" in health.detail
    finally:
        stop_process(proc)
