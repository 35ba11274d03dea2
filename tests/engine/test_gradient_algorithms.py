"""gradient_allreduce, bytegrad and qadam on real multi-process jobs (no Lightning: the wrapper directly).

Each job runs every scenario in tests/engine/gradient_workers.py once and the
tests assert on the values each rank wrote: 2 ranks flat, 4 ranks as 2 nodes x 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ranks import backend_params, run_ranks

WORKER = str(Path(__file__).with_name("gradient_workers.py"))


def _run(tmp_path: Path, world_size: int, backend: str, local_size: int = 0) -> list[dict[str, Any]]:
    run_ranks(WORKER, [str(tmp_path), "--backend", backend, "--local-size", str(local_size)],
              world_size=world_size, log_dir=tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


def _check(results: list[dict[str, Any]], hierarchical: bool) -> None:
    for res in results:
        assert res["hierarchical"] is hierarchical
        # gradient_allreduce follows DDP step for step (accumulation with no_sync included), whether
        # gradients are bucket views or copied, kept between steps, or re-bucketed mid-training.
        ar = res["allreduce"]
        for name in ("flat", "noflat", "keepgrads", "replan"):
            run = ar[name]
            assert run["diff_vs_ddp"] < 1e-5, (name, run)
            assert run["spread"] == 0.0, (name, run)
            assert run["steps"] == 6
            assert run["timing_ok"] and run["timing_bytes"] == run["param_bytes"], (name, run)
            assert run["timing_buckets"] == run["plan_buckets"] >= 2, (name, run)
        assert ar["flat"]["grads_are_views"] and ar["keepgrads"]["grads_are_views"]
        assert not ar["noflat"]["grads_are_views"]
        assert ar["replan"]["plans"][3:] == [ar["replan"]["plan_buckets"]] * 3  # the applied plan stays
        assert ar["sum"]["diff_vs_ddp"] < 1e-5  # average=False sums

        bg = res["bytegrad"]
        assert 0 < bg["err"] <= bg["bound"], bg  # lossy, within the quantisation bound
        assert bg["identical_result"], "every rank must decode the same reduced values"
        assert bg["loss_last"] < 0.5 * bg["loss_first"], bg
        assert bg["spread"] == 0.0

        qa = res["qadam"]
        assert len(qa["errors"]) == 2
        assert all(e.startswith("Bagua QAdam can only accept one QAdamOptimizer") for e in qa["errors"])
        assert qa["loss_last"] < 0.5 * qa["loss_first"], qa
        assert qa["spread_warmup"] == 0.0 and qa["spread_end"] == 0.0, qa
        assert qa["completed_steps"] == 40 and qa["exp_avg_are_views"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(2))
def test_two_flat_ranks_match_ddp_and_converge(tmp_path: Path, backend: str) -> None:
    _check(_run(tmp_path, 2, backend), hierarchical=False)


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(4))
def test_four_ranks_as_two_nodes_hierarchical(tmp_path: Path, backend: str) -> None:
    _check(_run(tmp_path, 4, backend, local_size=2), hierarchical=True)
