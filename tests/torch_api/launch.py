"""Run a worker case of ``tests/torch_api`` on N real Gloo ranks (torchrun's variables, no agent), always stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.procs import free_port
from tests.strategy.launch import REPO, _env, _wait_all

WORKERS = Path(__file__).with_name("workers.py")


def run_case(case: str, *, world_size: int, log_dir: Path, local_size: int | None = None,
             args: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 180,
             launcher_env: bool = True, cuda: bool = False,
             drop: tuple[str, ...] = (), script: Path = WORKERS) -> str:
    """Run ``script CASE ARGS`` (default ``workers.py``) as ``world_size`` ranks laid out ``local_size`` per node.

    Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` as
    torchrun sets them (``launcher_env=False``: only ``BAGUA_TEST_RANK``, for cases that pass ranks
    explicitly; ``drop`` removes some). CUDA is hidden, so the ranks use Gloo, unless ``cuda`` (NCCL: one GPU per rank). Returns the logs; raises AssertionError with them
    when a rank fails.
    """
    local = world_size if local_size is None else local_size
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        log = log_dir / f"{case}-rank{rank}.log"
        logs.append(log)
        extra = {"MASTER_PORT": str(port), "BAGUA_TEST_RANK": str(rank),
                 "BAGUA_TEST_BACKEND": "nccl" if cuda else "gloo",
                 "BAGUA_TEST_WORLD_SIZE": str(world_size), "BAGUA_TEST_LOCAL_SIZE": str(local)}
        if not cuda:
            extra["CUDA_VISIBLE_DEVICES"] = ""
        if launcher_env:
            extra.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local),
                         LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local))
        extra.update(env or {})
        full = _env(extra)
        for name in drop:  # variables this launcher does not set
            full.pop(name, None)
        if not launcher_env:
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
                full.pop(name, None)
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen([sys.executable, str(script), case, *args], env=full, stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO))
    codes = _wait_all(procs, logs, timeout_s)
    text = "\n".join(f"--- {x.name}\n{x.read_text(errors='replace')[-4000:]}" for x in logs)
    assert codes == [0] * world_size, f"exit codes {codes}\n{text}"
    return text
