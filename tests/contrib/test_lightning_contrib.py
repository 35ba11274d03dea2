"""BaguaStrategy with contrib pieces in a real 2-rank Lightning job (CPU, Gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.procs import free_port
from tests.ranks import run_commands

WORKER = str(Path(__file__).with_name("lightning_contrib_workers.py"))


def test_sync_batchnorm_fused_optimizer_balanced_loader_and_moe(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), WORKER, str(tmp_path)]
    run_commands([cmd], log_dir=tmp_path, timeout_s=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(ranks):
        assert "error" not in res, res["error"]
        for name in ("sync_bn", "sync_bn_fused"):
            # Trainer(sync_batchnorm=True) on CPU: our SyncBatchNorm, equal to one BatchNorm over both batches.
            assert res[name]["bn"] == ["SyncBatchNorm"], res[name]
            assert res[name]["diff_vs_reference"] < 1e-5, res[name]
            assert res[name]["seen_first"] == list(range(r, 16, 2))
        assert res["async_sync_bn"] == {"bn": ["SyncBatchNorm"], "finite": True}, res["async_sync_bn"]
        # The loader kept our batch sampler: each rank saw exactly its load-balanced batches.
        assert res["balanced"]["seen"] == res["balanced"]["expected"]
        # MoE under BaguaStrategy: shared weights averaged, experts (one set per rank) left alone and trained.
        moe = res["moe"]
        assert moe["shared_spread"] == 0.0 and moe["expert_spread"] > 0.0 and moe["experts_trained"], moe
        assert moe["loss_best_late"] < 0.8 * moe["loss_first"], moe
    first = [set(i for b in res["balanced"]["seen"] for i in b) for res in ranks]
    assert not first[0] & first[1] and len(first[0] | first[1]) == 64
