"""decentralized, low_precision_decentralized and async inside real Lightning jobs (Gloo):
``Trainer(strategy=BaguaStrategy(algorithm=...))`` under torchrun (2 ranks), and under Lightning's own
launcher as 2 nodes x 2 devices for the hierarchical paths."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import free_port
from tests.ranks import backend_params, run_commands

WORKER = str(Path(__file__).with_name("lightning_weight_workers.py"))


def _results(tmp_path: Path, mode: str, n: int) -> list[dict[str, Any]]:
    out = [json.loads((tmp_path / f"{mode}_rank{r}.json").read_text()) for r in range(n)]
    for r in out:
        assert "error" not in r, r["error"]
    return out


def _converged(run: dict[str, Any]) -> None:
    assert run["eval_last"] < 0.5 * run["eval_first"], run


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(2))
def test_weight_averaging_algorithms_under_torchrun(tmp_path: Path, backend: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), WORKER, str(tmp_path), "--mode", "torchrun",
           "--accelerator", "gpu" if backend == "nccl" else "cpu"]
    run_commands([cmd], log_dir=tmp_path)
    results = _results(tmp_path, "torchrun", 2)
    for rank, res in enumerate(results):
        # "all": identical weights right after every averaging (before each rank's own optimizer step)
        _converged(res["all"])
        assert not res["all"]["hierarchical"]  # one node: no inter-node step
        assert res["all"]["spreads"] == [0.0] * 16
        assert res["all"]["final_spread"] > 0  # the last local step moved the ranks apart again
        # "shift_one" every 2nd step: with 2 ranks the one peer; identical on communicating steps only
        _converged(res["shift_one"])
        spreads = res["shift_one"]["spreads"]
        assert spreads[0::2] == [0.0] * 8 and all(s > 0 for s in spreads[1::2])

        _converged(res["low_precision"])
        assert res["low_precision"]["final_spread"] < 0.3  # bounded: local steps and quantisation only

        a = res["async"]
        _converged(a)
        assert a["spreads"][:2] == [0.0, 0.0]  # warm-up: synchronous gradient allreduce
        # abort() after step 6 stops the thread; no round runs until resume() after step 10
        rounds = a["rounds_by_batch"]  # completed rounds, read after each step (index = step - 1)
        frozen = a["after_abort"]["rounds"]
        assert a["after_abort"] == {"averaging": False, "threads": [], "rounds": frozen} and frozen >= 1
        assert rounds[6:10] == [frozen] * 4
        assert a["after_resume"] == {"averaging": True, "rounds_before": frozen}
        assert a["rounds"] > frozen
        assert a["threads_after_fit"] == []  # training end stopped the thread on every rank

        for name in ("resume_decentralized", "resume_low_precision"):
            r = res[name]
            # Lightning saves rank 0's weights; on resume every rank starts from them.
            assert r["saved_is_mine"] is (rank == 0), r  # the ranks' weights differ; rank 0's are saved
            assert r["start_spread"] == 0.0 and r["start_is_checkpoint"], r
            assert r["steps_after_resume"] == 8  # the second epoch only
            assert r["eval_last"] < r["eval_at_resume"], r
        assert res["resume_low_precision"]["replicas_match"] is True
        assert res["teardown"] == {"async_threads": []}


@pytest.mark.slow
def test_hierarchical_two_nodes_of_two_under_lightning_launcher(tmp_path: Path) -> None:
    cmd = [sys.executable, WORKER, str(tmp_path), "--mode", "nodes"]
    run_commands([cmd, cmd], log_dir=tmp_path, env={"MASTER_PORT": str(free_port())},
                 per_command_env=[{"NODE_RANK": "0"}, {"NODE_RANK": "1"}])
    for res in _results(tmp_path, "nodes", 4):
        for name in ("all", "shift_one", "low_precision"):
            _converged(res[name])
            assert res[name]["hierarchical"]  # 2 nodes x 2 ranks: the hierarchical path ran
        # With 2 nodes both decentralized modes reach the global mean at every step.
        assert res["all"]["spreads"] == [0.0] * 16
        assert res["shift_one"]["spreads"] == [0.0] * 16
