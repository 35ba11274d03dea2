"""Start real multi-process jobs for the strategy tests, and always stop them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.procs import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]


def _env(extra: dict[str, str]) -> dict[str, str]:
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


def _wait_all(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float) -> list[int]:
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
              env: dict[str, str] | None = None) -> str:
    """Run ``world_size`` copies of ``script`` with torchrun's environment variables (no agent: fast).

    Returns the concatenated logs; raises AssertionError with them when a rank fails.
    """
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        log = log_dir / f"rank{rank}.log"
        logs.append(log)
        extra = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                 "LOCAL_WORLD_SIZE": str(world_size), "MASTER_PORT": str(port), **(env or {})}
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen([sys.executable, script, *args], env=_env(extra), stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO))
    codes = _wait_all(procs, logs, timeout_s)
    text = "\n".join(f"--- {x.name}\n{x.read_text(errors='replace')[-4000:]}" for x in logs)
    assert codes == [0] * world_size, f"exit codes {codes}\n{text}"
    return text


def run_commands(commands: Sequence[Sequence[str]], *, log_dir: Path, timeout_s: float = 240,
                 env: dict[str, str] | None = None, per_command_env: Sequence[dict[str, str]] = ()) -> str:
    """Run several launcher commands (torchrun, Lightning's own launcher) side by side; all stopped after."""
    procs, logs = [], []
    for i, cmd in enumerate(commands):
        log = log_dir / f"cmd{i}.log"
        logs.append(log)
        extra = {**(env or {}), **(per_command_env[i] if i < len(per_command_env) else {})}
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen(list(cmd), env=_env(extra), stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=REPO))
    codes = _wait_all(procs, logs, timeout_s)
    text = "\n".join(f"--- {x.name}\n{x.read_text(errors='replace')[-6000:]}" for x in logs)
    assert codes == [0] * len(commands), f"exit codes {codes}\n{text}"
    return text
