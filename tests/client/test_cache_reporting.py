"""What the cache says, and where: no warning for its defaults, one report per outage for a training process and
its DataLoader workers (naming the command that starts the services), nothing at exit."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis

from bagua_lightning.client import RedisStore
from bagua_lightning.client.cache.store import DEFAULT_CAPACITY
from bagua_lightning.services.redis_cluster import ClusterSpec, start_cluster, stop_cluster
from tests.client.conftest import free_port_block

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.client.cache_reporting", *args], cwd=REPO,
                            env=dict(os.environ), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            **kwargs)  # type: ignore[call-overload]


def _maxmemory(store: RedisStore) -> int:
    (host, port), = store.hosts
    with redis.Redis(host=host, port=port, password=store.options.password) as admin:
        return int(admin.config_get("maxmemory")["maxmemory"])


def test_the_default_capacity_fits_the_machine_without_a_warning(local_state: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    store = RedisStore(hosts=None)
    try:
        expected = min(DEFAULT_CAPACITY, psutil.virtual_memory().total // 4)
        assert store.capacity_per_node == _maxmemory(store)
        assert abs(store.capacity_per_node - expected) <= 1
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        store.shutdown()


def test_a_capacity_the_user_set_beyond_the_machine_is_capped_with_a_warning(
        local_state: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    asked = psutil.virtual_memory().total * 2
    store = RedisStore(hosts=None, capacity_per_node=asked)
    try:
        assert _maxmemory(store) <= psutil.virtual_memory().total // 4 + 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"capacity_per_node={asked}" in warnings[0], warnings
    finally:
        store.shutdown()
    with pytest.raises(ValueError, match="capacity_per_node=True"):
        RedisStore(hosts=["127.0.0.1:1"], capacity_per_node=True)


def _outage_warnings(text: str) -> list[str]:
    # A spawned worker does not inherit the job's logging set-up: Python prints its warnings bare.
    return [line for line in text.splitlines() if "is unavailable" in line]


@pytest.mark.slow
def test_an_outage_is_reported_once_for_a_process_and_its_forked_workers(tmp_path: Path) -> None:
    port = free_port_block(1, with_bus=False)
    err = _outage_job(port, tmp_path, "fork", 3)
    phases = err.split("phase: ")
    assert [p.split("\n", 1)[0] for p in phases[1:]] == ["down", "up", "down again"], err
    down, up, down_again = phases[1:]
    for phase in (down, down_again):  # 2 epochs x 2 workers, each a process meeting the outage: one warning
        warnings = _outage_warnings(phase)
        assert len(warnings) == 1 and warnings[0].startswith("WARNING"), phase
        assert f"127.0.0.1:{port}" in warnings[0] and "`bagua-lightning up` starts the services" in warnings[0]
    assert "is back" in up and not _outage_warnings(up), up  # said by a worker that never met the outage


@pytest.mark.slow
def test_spawned_workers_share_the_report_of_their_process(tmp_path: Path) -> None:
    port = free_port_block(1, with_bus=False)
    err = _outage_job(port, tmp_path, "spawn", 1)
    assert len(_outage_warnings(err)) == 1, err  # 2 epochs x 2 spawned workers


def _outage_job(port: int, state: Path, start_method: str, phases: int) -> str:
    job = _job("outages", str(port), str(state), start_method, str(phases))
    try:
        out, err = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        stop_cluster(port, state)
    assert job.returncode == 0 and out == "", err
    assert "Traceback" not in err, err
    return err


def test_entries_left_in_the_buffer_are_dropped_quietly_at_exit_when_redis_is_gone(tmp_path: Path) -> None:
    spec = ClusterSpec(nodes=1, cluster=False, port=free_port_block(1, with_bus=False), state_root=tmp_path)
    info = start_cluster(spec)
    job = _job("exit_after_outage", info.hosts_string, stdin=subprocess.PIPE)
    try:
        assert job.stdout is not None and job.stdout.readline() == "buffered\n"
        stop_cluster(spec.port, tmp_path)
        _out, err = job.communicate("\n", timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        stop_cluster(spec.port, tmp_path)
    assert job.returncode == 0 and err == "", err
