"""No rank waits forever: when one rank of a 2-rank job is killed or raises, the other ends too, with an
error naming the failed rank and what it was doing (Gloo here; NCCL with the ``gpu`` mark).

The harness deadline (``DEADLINE_S``) only bounds a broken run: without the peer watch the survivor would wait
for the process group's 30-minute timeout.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.procs import free_port, stop_process
from tests.ranks import job_env

WORKER = Path(__file__).with_name("failure_workers.py")
DEADLINE_S = 150.0  # generous: the survivor ends within 30 s of the failure


def run_job(case: str, log_dir: Path, *, cuda: bool = False, world_size: int = 2) -> tuple[list[int], list[str]]:
    """Start ``world_size`` ranks of ``failure_workers.py CASE``; their exit codes and logs (all stopped after)."""
    port = free_port()
    deadline = time.monotonic() + DEADLINE_S
    procs, logs = [], []
    for rank in range(world_size):
        env = {"MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
               "BAGUA_TEST_BACKEND": "nccl" if cuda else "gloo", "GLOO_SOCKET_IFNAME": "lo"}
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = log_dir / f"{case}-rank{rank}.log"
        logs.append(log)
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), case], env=job_env(env), stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    try:
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"a rank was still running {DEADLINE_S} s after the job started: {logs}") from None
    finally:
        for p in procs:
            stop_process(p)
    # Raw exit codes: a survivor that torch's NCCL teardown aborts (SIGABRT) after the watch stopped it counts
    # as failed here (tests.ranks.wait_all would read a late teardown abort as success).
    return codes, [x.read_text(errors="replace") for x in logs]


def assert_survivor_named(codes: list[int], logs: list[str], *expected: str) -> None:
    survivor = logs[0]
    assert codes[0] != 0, f"rank 0 ended with exit code 0 after rank 1 failed:\n{survivor[-3000:]}"
    assert codes[1] != 0, f"rank 1 was meant to fail:\n{logs[1][-3000:]}"
    assert "rank 1 of 2" in survivor, survivor[-3000:]
    for text in expected:
        assert text in survivor, f"{text!r} not in rank 0's log:\n{survivor[-3000:]}"


def test_killed_in_allreduce_gloo(tmp_path: Path) -> None:
    codes, logs = run_job("killed", tmp_path)
    assert codes[1] == -9
    assert_survivor_named(codes, logs, "allreduce", "this rank (0)")


def test_raises_in_forward_with_bagua_gloo(tmp_path: Path) -> None:
    codes, logs = run_job("forward", tmp_path)
    assert "boom in the forward pass of rank 1" in logs[1]
    assert_survivor_named(codes, logs, "boom in the forward pass of rank 1", "in forward")


@pytest.mark.slow
def test_raises_in_training_step_strategy_gloo(tmp_path: Path) -> None:
    codes, logs = run_job("strategy", tmp_path)
    assert_survivor_named(codes, logs, "boom in the forward pass of rank 1")


needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA devices")


@pytest.mark.gpu
@needs_two_gpus
def test_killed_in_allreduce_nccl(tmp_path: Path) -> None:
    codes, logs = run_job("killed", tmp_path, cuda=True)
    assert codes[1] == -9
    assert_survivor_named(codes, logs, "allreduce", "this rank (0)")


@pytest.mark.gpu
@needs_two_gpus
def test_raises_in_forward_with_bagua_nccl(tmp_path: Path) -> None:
    codes, logs = run_job("forward", tmp_path, cuda=True)
    assert_survivor_named(codes, logs, "boom in the forward pass of rank 1")


@pytest.mark.gpu
@needs_two_gpus
def test_raises_in_training_step_strategy_nccl(tmp_path: Path) -> None:
    codes, logs = run_job("strategy", tmp_path, cuda=True)
    assert_survivor_named(codes, logs, "boom in the forward pass of rank 1")
