"""The one launcher of multi-rank test jobs: real processes with torchrun's variables, always stopped.

* :func:`run_ranks`: ``world_size`` copies of a script (one process per rank, no agent: fast);
* :func:`run_function`: a module-level function on every rank of a Gloo group, results returned by rank;
* :func:`run_commands`: whole launcher commands (torchrun, Lightning's launcher) side by side;
* :func:`backend_params`: the backends a multi-rank test runs on (Gloo; NCCL where GPUs allow).

Every job is waited for with one deadline and its processes stopped whatever happens; a failed rank
fails the test with every rank's log.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.procs import free_port, stop_process

REPO = Path(__file__).resolve().parents[1]


def job_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a rank: one OpenMP thread, loopback rendezvous, the repo importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


TEARDOWN_ABORT = "terminate called without an active exception"


def _aborted_after_finishing(code: int, log: Path) -> bool:
    """True for a rank killed by SIGABRT in torch's interpreter teardown, after its program had finished.

    Rarely (about once per full suite run on this 2-core machine), a Gloo rank whose work is done, whose
    groups are destroyed and which has passed its last barrier still dies in C++ static destruction with
    only this line on stderr (the failure pytorch/pytorch#179291 describes). Every test checks its ranks'
    results separately (result files, printed markers), so such a rank is counted by what it produced;
    any other abort, and any abort with more output after its results, still fails the test.
    """
    if code not in (-6, 134):
        return False
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return bool(lines) and lines[-1] == TEARDOWN_ABORT


def wait_all(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float) -> list[int]:
    # A fast machine (the GPU box) may shorten how long a stuck job is given before it is killed.
    timeout_s = float(os.environ.get("BAGUA_LIGHTNING_TEST_JOB_TIMEOUT_S", timeout_s))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            left = deadline - time.monotonic()
            p.wait(timeout=max(left, 0.1))
            if p.returncode != 0:  # one failed: the others may be stuck in a collective
                break
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 5)) for p in procs]
        return [0 if _aborted_after_finishing(code, log) else code for code, log in zip(codes, logs, strict=True)]
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"job did not finish in {timeout_s} s; logs: {[str(x) for x in logs]}") from None
    finally:
        for p in procs:
            stop_process(p)


def run_ranks(script: str, args: Sequence[str], *, world_size: int, log_dir: Path, timeout_s: float = 180,
              env: dict[str, str] | None = None, local_size: int | None = None, hide_cuda: bool = False,
              launcher_env: bool = True, drop: Sequence[str] = (), log_name: str = "rank",
              rank_variable: str | None = None) -> str:
    """Run ``world_size`` copies of ``python script ARGS`` as ranks laid out ``local_size`` per node.

    Each rank gets ``MASTER_ADDR``/``MASTER_PORT`` and, as torchrun sets them, ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (``launcher_env=False``: none of these, for
    scripts that pass ranks explicitly; ``drop`` removes some); ``rank_variable`` names one more variable
    holding the rank, also without ``launcher_env``; ``hide_cuda`` hides the GPUs (Gloo).
    Logs go to ``log_dir/{log_name}{rank}.log``. Returns the logs; raises AssertionError with them
    when a rank fails.
    """
    local = world_size if local_size is None else local_size
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        log = log_dir / f"{log_name}{rank}.log"
        logs.append(log)
        extra = {"MASTER_PORT": str(port), **({rank_variable: str(rank)} if rank_variable else {})}
        if hide_cuda:
            extra["CUDA_VISIBLE_DEVICES"] = ""
        if launcher_env:
            extra.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local),
                         LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local))
        full = job_env({**extra, **(env or {})})
        for name in drop:  # variables this launcher does not set
            full.pop(name, None)
        if not launcher_env:
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
                full.pop(name, None)
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen([sys.executable, script, *args], env=full, stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO))
    codes = wait_all(procs, logs, timeout_s)
    text = "\n".join(f"--- {x.name}\n{x.read_text(errors='replace')[-4000:]}" for x in logs)
    assert codes == [0] * world_size, f"exit codes {codes}\n{text}"
    return text


def run_function(fn: Callable[..., Any], *args: Any, world_size: int, log_dir: Path | None = None,
                 local_size: int | None = None, timeout_s: float = 180) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks of a Gloo group (CUDA hidden); its return values by rank.

    ``fn`` must be importable by name (a module-level function) and return what ``torch.save`` stores
    with ``weights_only`` loading (tensors, numbers, strings, lists, dicts).
    """
    import torch

    with tempfile.TemporaryDirectory(prefix="ranks-") as scratch:
        folder = log_dir if log_dir is not None else Path(scratch)
        call = folder / "call.pt"
        torch.save((fn, args), call)
        run_ranks(__file__, [str(call)], world_size=world_size, log_dir=folder, timeout_s=timeout_s,
                  local_size=local_size, hide_cuda=True, env={"GLOO_SOCKET_IFNAME": "lo"})
        return [torch.load(folder / f"result{rank}.pt", weights_only=True) for rank in range(world_size)]


def _function_rank(call: Path) -> None:
    """One rank of :func:`run_function`: join the group, call, agree that every rank finished, save."""
    import torch
    import torch.distributed as dist

    fn, args = torch.load(call, weights_only=False)  # written by this test run's run_function
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        value = fn(*args)
        dist.barrier()
        torch.save(value, call.with_name(f"result{dist.get_rank()}.pt"))
    finally:
        dist.destroy_process_group()


def run_commands(commands: Sequence[Sequence[str]], *, log_dir: Path, timeout_s: float = 240,
                 env: dict[str, str] | None = None, per_command_env: Sequence[dict[str, str]] = ()) -> str:
    """Run several launcher commands (torchrun, Lightning's own launcher) side by side; all stopped after."""
    procs, logs = [], []
    for i, cmd in enumerate(commands):
        log = log_dir / f"cmd{i}.log"
        logs.append(log)
        extra = {**(env or {}), **(per_command_env[i] if i < len(per_command_env) else {})}
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen(list(cmd), env=job_env(extra), stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=REPO))
    codes = wait_all(procs, logs, timeout_s)
    text = "\n".join(f"--- {x.name}\n{x.read_text(errors='replace')[-6000:]}" for x in logs)
    assert codes == [0] * len(commands), f"exit codes {codes}\n{text}"
    return text


if __name__ == "__main__":
    _function_rank(Path(sys.argv[1]))


def backend_params(world_size: int) -> list[object]:
    """``gloo`` and a ``gpu``-marked ``nccl`` that skips without ``world_size`` CUDA devices."""
    import pytest  # here, not at the top: every rank of run_function runs this file as its script
    import torch

    enough = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    return [
        pytest.param("gloo", id="gloo"),
        pytest.param(
            "nccl",
            id="nccl",
            marks=[pytest.mark.gpu,
                   pytest.mark.skipif(not enough, reason=f"needs {world_size} CUDA devices and NCCL")],
        ),
    ]
