"""``bagua-lightning demo``, the main job, end to end against real services it starts itself.

The demo runs with a private state folder (``XDG_STATE_HOME``, ``BAGUA_LIGHTNING_SERVICES_FILE``) and
free ports, so it finds no services and starts a Redis Cluster and the autotune service (the code of
``bagua-lightning up``), then trains two 2-process Gloo jobs. The test checks what it printed and wrote
against the measurements, and always takes the services down (``bagua-lightning down``, then any
recorded pid still alive).
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_lightning import cli
from bagua_lightning.core import procs as processes
from bagua_lightning.core.services_file import ENV_FILE, read_services_file
from bagua_lightning.demo_report import JobResult, load_job
from bagua_lightning.services.redis_cluster import stop_cluster
from tests.integration.conftest import free_port_block, stop_recorded
from tests.procs import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICK_SAMPLES, BATCH, RANKS = 512, 32, 2


def _private_env(state: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_REDIS_PASSWORD"):
        env.pop(name, None)
    env.update({"XDG_STATE_HOME": str(state), ENV_FILE: str(state / "services.json"),
                "NO_PROXY": "127.0.0.1,localhost"})
    return env


def _take_down(env: dict[str, str], state: Path, redis_port: int) -> list[int]:
    """``bagua-lightning down``, then kill what the services file recorded; the pids that were recorded."""
    info = read_services_file(state / "services.json")
    pids = [int(p) for p in [info.pids.get("autotune"), *(info.pids.get("redis") or [])] if p] if info else []
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "down"], env=env, capture_output=True,
                       timeout=120)
    stop_recorded(info)  # safety net: nothing the demo started may outlive the test
    stop_cluster(redis_port, state / "bagua-lightning")
    return pids


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC, "not a PNG file"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _check_job_measurements(job: JobResult) -> None:
    assert (job.processes, job.backend, job.batch_size) == (RANKS, "gloo", BATCH)
    assert [e.epoch for e in job.epochs] == [1, 2]
    for e in job.epochs:
        assert e.samples == QUICK_SAMPLES  # both ranks together, one pass over the dataset
        assert e.hits + e.misses == QUICK_SAMPLES
        assert e.seconds > 0 and e.samples_per_s == pytest.approx(e.samples / e.seconds)
        assert e.loss > 0
    assert job.first_batch_samples == RANKS * BATCH
    # Speeds the strategy reported at its step boundaries (the set-up boundary has none).
    speeds = [r.samples_per_s for r in job.reports if r.samples_per_s is not None]
    assert job.reports[0].step == 0 and speeds and all(s > 0 for s in speeds)
    assert job.plans and job.plans[0].step == 0
    names = {n for bucket in job.plans[0].tensors for n in bucket}
    assert len(names) == 10 and all(n.startswith("net.") for n in names)  # DemoNet's 5 linear layers
    for plan in job.plans:  # every plan covers the same gradients, however it cuts them
        assert {n for bucket in plan.tensors for n in bucket} == names
        assert sum(plan.bucket_bytes) == sum(job.plans[0].bucket_bytes) > 0
    assert job.autotune_summary.startswith("autotune [DemoNet-")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_demo_end_to_end(tmp_path: Path) -> None:
    state, out = tmp_path / "state", tmp_path / "out"
    env = _private_env(state)
    redis_port = free_port_block(6)
    try:
        for attempt in range(3):
            # 3 masters + 3 replicas: client ports base..base+5, bus ports +10000 (TLS ports are checked by `up`).
            autotune_port, redis_port = free_port(), (redis_port if attempt == 0 else free_port_block(6))
            cmd = [sys.executable, "-m", "bagua_lightning.cli", "demo", "--quick", "--out", str(out),
                   "--autotune-port", str(autotune_port), "--redis-port", str(redis_port)]
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
            output = result.stdout + result.stderr
            # Another process (a parallel test worker's client) may take a port between the check and the start:
            # `up` refuses it before starting anything, so pick other ports.
            if not (result.returncode == 2 and "is not free" in output):
                break
        assert result.returncode == 0, output[-6000:]

        # It started the services itself, on the ports it was given, and left them running.
        assert "services (started by this demo)" in result.stdout
        info = read_services_file(state / "services.json")
        assert info is not None and info.autotune == f"127.0.0.1:{autotune_port}"
        assert [h["port"] for h in info.redis_hosts] == [redis_port + i for i in range(3)]

        job1, job2 = load_job(out / "job1.json"), load_job(out / "job2.json")
        for job in (job1, job2):
            _check_job_measurements(job)
        # Job 1 computes every sample in its first epoch and reads them back in its second.
        assert (job1.epochs[0].hits, job1.epochs[0].misses) == (0, QUICK_SAMPLES)
        assert job1.first_batch_hits == 0 and not job1.first_sample_cached
        assert job1.epochs[1].hit_rate == 1.0
        # Job 2 is served by the cache from its very first sample on.
        assert job2.first_sample_cached and job2.first_batch_hits == RANKS * BATCH
        assert (job2.epochs[0].hits, job2.epochs[0].misses) == (QUICK_SAMPLES, 0)
        # Job 2 registers the same model: its own tuning session (versions count from 0 again) starts on a
        # plan job 1 measured (the best the service keeps for the model's shape).
        assert job2.plans[0].version == 0
        assert job2.plans[0].tensors in [plan.tensors for plan in job1.plans]
        # Measured, not constants: four epochs, four different durations.
        assert len({e.seconds for j in (job1, job2) for e in j.epochs}) == 4

        # The printed summary is the measured one.
        for job in (job1, job2):
            rows = re.findall(r"^ +(\d) +([\d.]+) +([\d.]+)% +(\d+) / (\d+)", result.stdout.split(f"== {job.job}:")[1],
                              re.MULTILINE)[:2]
            assert [(int(r[0]), r[1], r[2], int(r[3]), int(r[4])) for r in rows] == [
                (e.epoch, f"{e.samples_per_s:.1f}", f"{100 * e.hit_rate:.1f}", e.hits, e.misses) for e in job.epochs]
        assert "job2, epoch 1: the cache served it from the first sample on (first batches 64/64 hits" in result.stdout
        assert "first sample: from the cache (hit)" in result.stdout
        assert (out / "summary.txt").read_text().count("== job") == 2
        # Output into a pipe: no progress bar redrawn with carriage returns, one line per epoch instead.
        assert "\r" not in output
        assert len(re.findall(r"^epoch \d/2: \d+ batches in [\d.]+ s, ", result.stdout, re.MULTILINE)) == 4

        # The plot is a real PNG of the run.
        png = out / "autotune.png"
        assert f"autotune trajectory plot: {png}" in result.stdout
        data = png.read_bytes()
        assert len(data) > 20_000 and _png_size(data) == (900, 600)
    finally:
        pids = _take_down(env, state, redis_port)
    assert pids and not [p for p in pids if processes.pid_alive(p)]
    assert read_services_file(state / "services.json") is None


def test_demo_rejects_bad_options_before_starting_anything(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "services.json"))
    for flag in ("--epochs", "--devices"):  # refused by the parser: one line, exit 2, nothing started
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["demo", flag, "0", "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and "'0' is not a positive integer" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "services.json").exists()


def test_demo_names_unreachable_services_from_the_environment(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Services named in the environment are the user's: the demo reports them down instead of starting others.
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "services.json"))
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_HOSTS", f"127.0.0.1:{free_port()}")
    assert cli.main(["demo", "--quick", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "the services named by BAGUA_LIGHTNING_AUTOTUNE_SERVICE/BAGUA_LIGHTNING_REDIS_HOSTS do not answer" in err
    assert "unset both variables" in err
    assert not (tmp_path / "services.json").exists()
