"""Autotuning through Lightning's front door: ``BaguaStrategy``'s autotune arguments (validated, resolved from
the argument, the environment, the services file), and a real 2-rank Lightning fit tuned by a real autotune
service process (plans change during the fit, every rank on the same plan at every step, loss and weights as
without autotune, ``autotune/*`` metrics in the trainer's logger, a second job starting on the tuned plan).
The controller itself is tested in ``tests/engine/autotune/``."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import ConcatDataset, DataLoader, Subset

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.client.cache.dataset import CachedDataset
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.procs import new_deployment_id
from bagua_lightning.core.services_file import ServicesInfo, write_services_file
from bagua_lightning.engine.autotune import AutotuneSettings
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from bagua_lightning.strategy.logged_metrics import cached_datasets, training_metrics
from tests.engine.autotune.plan_records import check_same_plan_every_step, load_results
from tests.ranks import run_ranks
from tests.services.conftest import FAST, autotune_service

LIGHTNING_WORKER = str(Path(__file__).with_name("autotune_lightning_worker.py"))
# Few samples, no warm-up: tuning completes within ~20 steps at autotune_interval=3.
SERVICE_ARGS = (*FAST, "--max-samples", "4")


def test_strategy_autotune_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import lightning.pytorch  # noqa: F401  # loads first, so its import hook registers the strategy

    from bagua_lightning.strategy import BaguaStrategy

    # Weight-averaging algorithms have no gradient bucket plan: a clear error, not a silent no-op.
    for algorithm in ("decentralized", "low_precision_decentralized", "async"):
        with pytest.raises(ConfigurationError, match=rf"autotune=True needs .*{algorithm!r} averages weights"):
            BaguaStrategy(algorithm, autotune=True)
    with pytest.raises(ConfigurationError, match="autotune_interval"):
        BaguaStrategy(autotune=True, autotune_interval=-1)
    # Address: argument, else env, else the services file, else the default.
    monkeypatch.setenv("BAGUA_LIGHTNING_SERVICES_FILE", str(tmp_path / "none.json"))
    monkeypatch.delenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", raising=False)
    assert BaguaStrategy(autotune=True).settings.autotune_settings.address == "127.0.0.1:29600"  # type: ignore[union-attr]
    write_services_file(ServicesInfo(autotune="10.0.0.2:7", deployment=new_deployment_id()), tmp_path / "services.json")
    monkeypatch.setenv("BAGUA_LIGHTNING_SERVICES_FILE", str(tmp_path / "services.json"))
    assert BaguaStrategy(autotune=True).settings.autotune_settings.address == "10.0.0.2:7"  # type: ignore[union-attr]
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "10.0.0.1:5")
    assert BaguaStrategy(autotune=True).settings.autotune_settings.address == "10.0.0.1:5"  # type: ignore[union-attr]
    s = BaguaStrategy("qadam", autotune=True, autotune_service="h:1", autotune_interval=7)
    tuning = s.settings.autotune_settings
    assert tuning is not None and (tuning.address, tuning.interval) == ("h:1", 7)
    assert BaguaStrategy().settings.autotune_settings is None
    with pytest.raises(ConfigurationError, match=r"'127\.0\.0\.1:99999'"):
        BaguaStrategy(autotune=True, autotune_service="127.0.0.1:99999")
    with pytest.raises(ConfigurationError, match="autotune_tls"):
        BaguaStrategy(autotune=True, autotune_tls=1)  # type: ignore[arg-type]
    tuned = BaguaStrategy(autotune=True, autotune_service="h:1", autotune_token="t0k", autotune_tls=True)
    assert tuned.settings.autotune_settings is not None
    assert (tuned.settings.autotune_settings.token, tuned.settings.autotune_settings.tls) == ("t0k", True)


def test_model_name_and_job_id_are_validated() -> None:
    import lightning.pytorch  # noqa: F401  # loads first, so its import hook registers the strategy

    from bagua_lightning.strategy import BaguaStrategy

    named = BaguaStrategy(autotune=True, autotune_service="h:1", autotune_model_name="resnet50 / imagenet")
    tuning = named.settings.autotune_settings
    assert tuning is not None and tuning.model_name == "resnet50 / imagenet"
    for bad, match in (("a\nb", "control character"), ("x" * 201, "201 characters long"), ("  ", "non-empty")):
        with pytest.raises(ConfigurationError, match=f"autotune_model_name.*{match}"):
            BaguaStrategy(autotune=True, autotune_service="h:1", autotune_model_name=bad)
        with pytest.raises(ConfigurationError, match="autotune_model_name"):
            BaguaStrategy(autotune_model_name=bad)  # checked even before autotune is switched on
    with pytest.raises(ConfigurationError, match="job_id"):
        AutotuneSettings(address="h:1", job_id="x\ty")


def test_cache_hit_rate_found_through_dataset_wrappers() -> None:
    cached = CachedDataset(list(range(10)), dataset_name="wrapped", hosts=["127.0.0.1:1"])
    loaders = [DataLoader(Subset(ConcatDataset([list(range(3)), cached]), [1, 2])), {"b": DataLoader(cached)}]
    assert cached_datasets(loaders) == [cached]
    assert cached_datasets(DataLoader(list(range(5)))) == []
    plan = BucketPlan(buckets=((TensorDeclaration("a", 4),),), version=2)
    assert training_metrics(plan, None, []) == {"bagua/plan_version": 2.0, "bagua/num_buckets": 1.0}
    assert training_metrics(None, None, [cached]) == {"cache/hits": 0.0, "cache/misses": 0.0, "cache/hit_rate": 0.0}


@pytest.mark.slow
def test_lightning_two_ranks_tune_match_log_and_second_job(tmp_path: Path) -> None:
    with autotune_service(*SERVICE_ARGS, "--world-size", "2", log_path=tmp_path / "service.log") as (target, _):
        run_ranks(LIGHTNING_WORKER, [str(tmp_path), "--address", target], world_size=2, log_dir=tmp_path,
                  timeout_s=420, env={"GROUP_RANK": "0"})
        with AutotuneClient(target=target) as client:
            # Two fits, two jobs: each its own session; the first (tuned) measured plans, the second started
            # from its final plan without inheriting its completion: it measured that plan itself.
            models = sorted(client.list_models(), key=lambda m: m.samples)
            assert len(models) == 2 and models[0].samples >= 1 and models[1].completed
            assert len({m.job_id for m in models}) == 2 and len({m.model_name for m in models}) == 1
            samples = client.describe_model(models[1].model_name, models[1].job_id).samples
    # Reports are aggregated: one per interval for the job (rank 0, after an all_gather), not one per rank.
    # The first plan was measured over one interval: one report (two ranks reporting their own would be two).
    assert samples and samples[0].reports == 1, samples
    res = load_results(tmp_path, "lightning_rank", 2)
    records = check_same_plan_every_step([r["tuned_records"] for r in res])
    for r in res:
        # Re-bucketing changes nothing but float summation order.
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5
        assert r["summary_completed"], r["summary"]
        assert "completed" in r["summary"] and "samples/s per rank" in r["summary"]
        # A second job of the same model starts on the plan the first one settled on (in its own session:
        # same layout, its own version numbers).
        final = records[-1]
        assert r["second_records"][0][2:] == final[2:]
    metrics = res[0]["metrics"]
    assert {int(m["step"]) for m in metrics} >= {0, 3, 6, 9}
    assert metrics[-1]["autotune/completed"] == "1.0"
    assert {"autotune/samples_per_s", "autotune/bucket_size", "autotune/num_buckets",
            "autotune/hierarchical"} <= set(metrics[-1])
    assert float(metrics[-1]["autotune/samples_per_s"]) > 0
    log = (tmp_path / "rank0.log").read_text()
    assert log.count("autotune [TunedNet-") == 2  # one summary line per fit, from rank 0 only
    assert "autotune [" not in (tmp_path / "rank1.log").read_text()
