"""The peer watch on every way a job is launched, and ranks that finish at different times.

For each launch path (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment without
torchrun, as Bagua's launcher and many clusters start ranks; torchrun with one agent per "node"; Lightning's own
launcher; ``multiprocessing`` as Bagua's tests do) rank 1 is SIGKILLed or raises while training, and the
surviving rank must end with the watch's error naming rank 1. The deadline only bounds a broken run; the
process group's own timeout is 30 minutes, so an end before it comes from the watch (the asserted line is the
watch's).

A rank that has finished is not a dead one: ranks leave after their last collective at different times, with
and without an exit mark, quiet and under load, and every rank must end well, its watch having seen the others
leave (``departed``) without taking them for failures.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.procs import free_port, stop_process
from tests.ranks import REPO, job_env

WORKER = str(Path(__file__).with_name("peer_watch_workers.py"))
DEADLINE_S = 150.0  # a broken run only: the watch ends a survivor within seconds, Gloo's timeout is 30 min
NOT_TORCHRUN = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def run(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], log_dir: Path) -> tuple[list[int], str]:
    """Start each command with its environment; wait (bounded) for all; their exit codes and logs."""
    procs, logs = [], []
    for i, (cmd, extra) in enumerate(zip(commands, envs, strict=True)):
        log = log_dir / f"proc{i}.log"
        logs.append(log)
        env = job_env({"CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo", **extra})
        for name in NOT_TORCHRUN:
            if name not in extra:
                env.pop(name, None)
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen(list(cmd), env=env, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=REPO))
    codes: list[int] = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=DEADLINE_S))
    except subprocess.TimeoutExpired:
        codes = [p.poll() if p.poll() is not None else -999 for p in procs]
    finally:
        for p in procs:
            stop_process(p)
    text = "\n".join(f"--- {x.name}\n{x.read_text(errors='replace')}" for x in logs)
    assert -999 not in codes, f"still running {DEADLINE_S} s after the start (the watch did not end it):\n{text}"
    return codes, text


def env_launch(scenario: Sequence[str], world_size: int, log_dir: Path) -> tuple[list[int], str]:
    port = str(free_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": str(world_size), "MASTER_PORT": port} for r in range(world_size)]
    return run([[sys.executable, WORKER, *scenario]] * world_size, envs, log_dir)


def torchrun_launch(scenario: Sequence[str], log_dir: Path) -> tuple[list[int], str]:
    """One torchrun agent per rank, as on two nodes: an agent restarts or stops only its own worker."""
    port = str(free_port())
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(r),
             "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, "--max_restarts", "0",
             WORKER, *scenario] for r in range(2)]
    return run(cmds, [{}, {}], log_dir)


EXPECTED = {
    "kill": "bagua_lightning: rank 1 of 2 died (process",
    "raise": "bagua_lightning: rank 1 of 2 failed with RuntimeError: boom at step 5 of rank 1",
}


def assert_named(failure: str, codes: list[int], text: str, survivor_code: int | None = None) -> None:
    assert EXPECTED[failure] in text, text[-6000:]
    assert "this rank (0)" in text, text[-6000:]  # the survivor's line: its own rank and where it was
    assert "rank 0 finished" not in text, text[-6000:]
    if survivor_code is not None:
        assert survivor_code != 0, text[-6000:]


@pytest.mark.parametrize("failure", ["kill", "raise"])
def test_env_launched(tmp_path: Path, failure: str) -> None:
    codes, text = env_launch(["train", failure], 2, tmp_path)
    assert codes[1] == (-9 if failure == "kill" else 1), text[-4000:]
    assert_named(failure, codes, text, survivor_code=codes[0])


@pytest.mark.parametrize("failure", ["kill", "raise"])
def test_torchrun(tmp_path: Path, failure: str) -> None:
    codes, text = torchrun_launch(["train", failure], tmp_path)
    assert_named(failure, codes, text, survivor_code=codes[0])


@pytest.mark.parametrize("failure", ["kill", "raise"])
def test_lightning_launcher(tmp_path: Path, failure: str) -> None:
    codes, text = run([[sys.executable, WORKER, "fit", failure]], [{"MASTER_PORT": str(free_port())}], tmp_path)
    assert_named(failure, codes, text, survivor_code=codes[0])


@pytest.mark.parametrize("failure", ["kill", "raise"])
def test_multiprocessing(tmp_path: Path, failure: str) -> None:
    codes, text = run([[sys.executable, WORKER, "mp", f"train_{failure}", "2"]], [{}], tmp_path)
    line = next((ln for ln in text.splitlines() if ln.startswith("exit codes ")), "")
    ranks = [int(c) for c in line.removeprefix("exit codes [").rstrip("]").split(",")] if line else []
    assert len(ranks) == 2 and ranks[0] != 0, text[-6000:]
    assert ranks[1] == (-9 if failure == "kill" else 1), text[-6000:]
    assert_named(failure, codes, text)


@pytest.fixture
def load() -> Iterator[None]:
    """Two busy processes beside the job (the 2-core machine then has more runnable threads than cores)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
               for _ in range(2)]
    try:
        yield
    finally:
        for p in burners:
            stop_process(p)


def _assert_all_finished(codes: list[int], text: str, world_size: int, saw: str) -> None:
    assert codes == [0] * len(codes), f"exit codes {codes}\n{text[-8000:]}"
    for r in range(world_size):
        assert f"rank {r} finished" in text, text[-8000:]
    assert "bagua_lightning: rank" not in text, text[-8000:]  # no failure line anywhere
    assert f"rank 0 saw leave: {saw}; failure: None" in text, text[-8000:]


def test_ranks_finish_at_different_times_under_load(tmp_path: Path, load: None) -> None:
    codes, text = env_launch(["finish"], 4, tmp_path)
    _assert_all_finished(codes, text, 4, "{1: 'exited', 2: 'exited', 3: 'died'}")


def test_multiprocessing_rank_finishes_first(tmp_path: Path) -> None:
    codes, text = run([[sys.executable, WORKER, "mp", "finish_mp", "2"]], [{}], tmp_path)
    assert "exit codes [0, 0]" in text, text[-6000:]
    _assert_all_finished(codes, text, 2, "{1: 'exited'}")
