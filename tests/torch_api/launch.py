"""Run a worker case of ``tests/torch_api`` on N real ranks through the one launcher (:mod:`tests.ranks`)."""

from __future__ import annotations

from pathlib import Path

from tests.ranks import run_ranks

WORKERS = Path(__file__).with_name("workers.py")


def run_case(case: str, *, world_size: int, log_dir: Path, local_size: int | None = None,
             args: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 180,
             launcher_env: bool = True, cuda: bool = False,
             drop: tuple[str, ...] = (), script: Path = WORKERS) -> str:
    """Run ``script CASE ARGS`` (default ``workers.py``) as ``world_size`` ranks laid out ``local_size`` per node.

    Besides torchrun's variables (:func:`tests.ranks.run_ranks`; ``launcher_env=False``: none, for cases
    that pass ranks explicitly), each rank gets ``BAGUA_TEST_RANK``, ``BAGUA_TEST_WORLD_SIZE``,
    ``BAGUA_TEST_LOCAL_SIZE`` and ``BAGUA_TEST_BACKEND``. CUDA is hidden, so the ranks use Gloo, unless
    ``cuda`` (NCCL: one GPU per rank). Returns the logs; raises AssertionError with them when a rank fails.
    """
    local = world_size if local_size is None else local_size
    job = {"BAGUA_TEST_BACKEND": "nccl" if cuda else "gloo", "BAGUA_TEST_WORLD_SIZE": str(world_size),
           "BAGUA_TEST_LOCAL_SIZE": str(local), **(env or {})}
    return run_ranks(str(script), [case, *args], world_size=world_size, log_dir=log_dir, timeout_s=timeout_s,
                     env=job, local_size=local, hide_cuda=not cuda, launcher_env=launcher_env, drop=drop,
                     log_name=f"{case}-rank", rank_variable="BAGUA_TEST_RANK")
