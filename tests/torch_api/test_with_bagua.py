"""``with_bagua`` and Bagua's algorithm objects on real Gloo ranks (2 and 4, one or two "nodes")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.procs import free_port
from tests.strategy.launch import REPO, _env, _wait_all

WORKERS = Path(__file__).with_name("module_workers.py")


def run(case: str, tmp_path: Path, world_size: int, local_size: int | None = None,
        timeout_s: float = 240) -> list[dict[str, Any]]:
    """Run ``case`` on ``world_size`` ranks, ``local_size`` per node; every rank's JSON result."""
    local = world_size if local_size is None else local_size
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        log = tmp_path / f"{case}-rank{rank}.log"
        logs.append(log)
        env = _env({"MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": "", "RANK": str(rank),
                    "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local),
                    "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local)})
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen([sys.executable, str(WORKERS), case, str(tmp_path)], env=env, stdout=fh,
                                          stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO))
    codes = _wait_all(procs, logs, timeout_s)
    text = "\n".join(f"--- {x.name}\n{x.read_text(errors='replace')[-4000:]}" for x in logs)
    assert codes == [0] * world_size, f"exit codes {codes}\n{text}"
    return [json.loads((tmp_path / f"{case}-rank{r}.json").read_text()) for r in range(world_size)]


def test_switching_algorithms_on_one_model(tmp_path: Path) -> None:
    results = run("switch", tmp_path, 2)
    # gradient_allreduce (third in the sequence) starts from decentralized's "all" average and keeps
    # replicas identical; every algorithm trained without error.
    assert results[0]["gradient_allreduce"] == results[1]["gradient_allreduce"]
    assert results[0]["decentralized"] != results[1]["decentralized"]  # each rank applies its own gradient
    assert results[0]["buckets"] == [4]


def test_wrapping_broadcasts_parameters_and_optimizer_state(tmp_path: Path) -> None:
    results = run("broadcast", tmp_path, 2)
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["momentum"] == results[1]["momentum"]
    assert any(abs(x) > 0 for x in results[0]["momentum"])


def test_one_algorithm_object_serves_two_models(tmp_path: Path) -> None:
    for res in run("shared", tmp_path, 2):
        for ours, torch_ddp in zip(res["bagua"], res["torch"], strict=True):
            assert torch.allclose(torch.tensor(ours), torch.tensor(torch_ddp), atol=1e-6)


def test_a_users_algorithm_impl_runs(tmp_path: Path) -> None:
    results = run("custom", tmp_path, 2)
    assert results[0]["grads"] == results[1]["grads"]


@pytest.mark.parametrize("local_size", [4, 2])
def test_hierarchical_has_baguas_meaning(tmp_path: Path, local_size: int) -> None:
    results = run("hierarchical", tmp_path, 4, local_size=local_size)
    for res in results:
        if local_size == 4:
            # One node: bytegrad compresses nothing (exactly gradient_allreduce).
            assert res["bytegrad"] == res["gradient_allreduce"]
        else:
            assert res["bytegrad"] != res["gradient_allreduce"]
    for name in ("bytegrad", "gradient_allreduce"):
        assert all(r[name] == results[0][name] for r in results)
    # Low precision communicates after the optimizer step: every rank of a node ends with its node's weights.
    name = "low_precision_decentralized"
    assert all(results[r][name] == results[r - r % local_size][name] for r in range(4))
    if local_size == 2:
        assert results[0]["low_precision_decentralized"] != results[2]["low_precision_decentralized"]


def test_async_on_a_group_without_the_last_rank(tmp_path: Path) -> None:
    run("partial", tmp_path, 3)
