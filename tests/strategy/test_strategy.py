"""BaguaStrategy inside real Lightning jobs (Gloo): launched by torchrun, and by Lightning's own launcher
as 2 nodes x 2 devices. Construction errors and the registry are checked in-process."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.core.errors import ConfigurationError
from tests.procs import free_port
from tests.ranks import backend_params, run_commands

WORKER = str(Path(__file__).with_name("lightning_workers.py"))


def _results(tmp_path: Path, mode: str, n: int) -> list[dict[str, Any]]:
    out = [json.loads((tmp_path / f"{mode}_rank{r}.json").read_text()) for r in range(n)]
    for r in out:
        assert "error" not in r, r["error"]
    return out


def test_bagua_is_registered_and_kwargs_are_checked_at_construction() -> None:
    import lightning as L

    import bagua_lightning
    from bagua_lightning.strategy import BaguaStrategy

    t = L.Trainer(strategy="bagua", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, BaguaStrategy) and t.strategy.algorithm_name == "gradient_allreduce"
    assert bagua_lightning.BaguaStrategy is BaguaStrategy
    with pytest.raises(ConfigurationError, match=r"unknown argument\(s\) \['sync_interval_ms'\].*'average'"):
        BaguaStrategy("bytegrad", sync_interval_ms=5)
    with pytest.raises(ConfigurationError, match=r"unknown Bagua algorithm 'allreduce'.*gradient_allreduce"):
        BaguaStrategy("allreduce")
    with pytest.raises(ConfigurationError, match="bucket_size"):
        BaguaStrategy(bucket_size=0)
    s = BaguaStrategy("qadam", hierarchical=False, start_method="spawn", process_group_backend="gloo")
    assert s.process_group_backend == "gloo"


def test_settings_are_a_validated_dataclass_the_strategy_keeps() -> None:
    from bagua_lightning.strategy import BaguaStrategy
    from bagua_lightning.strategy.settings import BaguaSettings

    with pytest.raises(ConfigurationError, match="flatten must be a bool, got 'yes'"):
        BaguaSettings(flatten="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"auto_candidates=\['bytegrad'\] needs algorithm='auto'"):
        BaguaSettings(auto_candidates=["bytegrad"])
    auto = BaguaSettings(algorithm="auto", auto_candidates=["bytegrad", "gradient_allreduce"])
    assert auto.algorithm_names == ("bytegrad", "gradient_allreduce") and auto.autotune_settings is None
    assert [c.name for c in auto.algorithm_classes] == ["bytegrad", "gradient_allreduce"]
    strategy = BaguaStrategy("bytegrad", bucket_size=1 << 20, average=False)
    assert (strategy.settings.bucket_size, strategy.settings.bagua_kwargs) == (1 << 20, {"average": False})


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "bytegrad", "decentralized",
                                       "low_precision_decentralized", "qadam", "async"])
def test_one_registered_alias_per_algorithm(algorithm: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    from bagua_lightning.strategy import BaguaStrategy

    name = f"bagua_{algorithm}"
    assert algorithm in StrategyRegistry[name]["description"]
    t = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, BaguaStrategy) and t.strategy.algorithm_name == algorithm


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(2))
def test_lightning_features_under_torchrun(tmp_path: Path, backend: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), WORKER, str(tmp_path), "--mode", "torchrun",
           "--accelerator", "gpu" if backend == "nccl" else "cpu"]
    run_commands([cmd], log_dir=tmp_path)
    for res in _results(tmp_path, "torchrun", 2):
        assert res["strategy_class"] == "BaguaStrategy"
        acc = res["accumulate"]
        # Accumulation communicates only on the boundary, exactly as DDP; clipping and a mid-run plan
        # change (autotune's hook point) leave the result equal to DDP's.
        assert acc["synced_pattern"] == acc["ddp_synced_pattern"] == [False, True] * 6
        assert acc["diff_vs_ddp"] < 1e-6 and acc["spread"] == 0.0
        assert acc["plan_buckets"][:6] == [1] * 6 and acc["plan_buckets"][6:] == [6] * 6
        assert acc["timings"] == 6
        assert res["manual"]["diff_vs_ddp"] < 1e-6 and res["manual"]["spread"] == 0.0
        for name in ("resume_adam", "resume_qadam"):
            assert res[name]["diff"] < 1e-6 < res[name]["moved"], (name, res[name])
            assert res[name]["spread"] == 0.0
        for name in ("bytegrad", "qadam", "bf16") + (("fp16",) if backend == "nccl" else ()):
            assert res[name]["loss_last"] < 0.5 * res[name]["loss_first"], (name, res[name])
            assert res[name]["spread"] == 0.0, name
        assert len(res["qadam_errors"]) == 2
        assert all(e.startswith("Bagua QAdam can only accept one QAdamOptimizer") for e in res["qadam_errors"])
        assert res["validate"][0]["val_loss"] > 0 and res["test"][0]["test_loss"] > 0
        assert res["predict_batches"] == 1
        assert res["reduce"] == {"sum": 3.0, "mean": 1.5, "avg": 1.5, "min": 1.0, "max": 2.0, "product": 2.0}
        assert res["broadcast"] == {"from": 1}
        assert res["teardown"] == {"comm_threads": [], "comm_none": True, "model_unwrapped": True}


@pytest.mark.slow
def test_lightning_launcher_two_nodes_hierarchical(tmp_path: Path) -> None:
    cmd = [sys.executable, WORKER, str(tmp_path), "--mode", "nodes"]
    run_commands([cmd, cmd], log_dir=tmp_path, env={"MASTER_PORT": str(free_port())},
                 per_command_env=[{"NODE_RANK": "0"}, {"NODE_RANK": "1"}])
    for res in _results(tmp_path, "nodes", 4):
        assert res["hierarchical_possible"]
        assert res["allreduce"]["diff_vs_ddp"] < 1e-6 and res["allreduce"]["spread"] == 0.0
        for name in ("bytegrad", "qadam"):
            assert res[name]["loss_last"] < 0.5 * res[name]["loss_first"], (name, res[name])
            assert res[name]["spread"] == 0.0, name
