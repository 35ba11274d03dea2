"""Autotuning while training (issue 5): real autotune service processes, real Gloo multi-process jobs.

* 2 ranks, Lightning (``BaguaStrategy(autotune=True)``): plans change during the fit and every
  rank communicates with the same plan at every step; loss and weights equal a run without
  autotune; ``autotune/*`` metrics reach the trainer's logger; a second job of the same model
  starts on the tuned plan.
* 4 ranks (2 nodes x 2 declared, so hierarchical plans are possible), plain loop: the same
  checks, the service killed (SIGKILL) mid-run and restarted from its state directory, and a
  job with no service at all (one warning); a rank that cannot apply a plan (PlanMismatchError everywhere).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.procs import new_deployment_id
from bagua_lightning.core.services_file import ServicesInfo, write_services_file
from bagua_lightning.engine.autotune import (
    AutotuneSettings,
    AutotuneSummary,
    BoundaryReport,
    IntervalMeter,
    batch_size_of,
    model_name_for,
)
from bagua_lightning.proto.plan import BucketPlan, BucketTimingRecord, StepTimings, TensorDeclaration
from tests.procs import free_port, wait_until
from tests.ranks import run_ranks
from tests.services.conftest import FAST, autotune_service

HERE = Path(__file__).parent
PLAIN_WORKER = str(HERE / "autotune_workers.py")
LIGHTNING_WORKER = str(HERE / "autotune_lightning_worker.py")
# Few samples, no warm-up: tuning completes within ~20 steps at autotune_interval=3.
SERVICE_ARGS = (*FAST, "--max-samples", "4")


# ------------------------------------------------------------------ in-process: configuration and pieces


def test_settings_reject_bad_values_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"autotune_service 'localhost' is not 'host:port'"):
        AutotuneSettings(address="localhost")
    with pytest.raises(ConfigurationError, match=r"autotune_service '127.0.0.1:99999' .* port 99999 is not a TCP port"):
        AutotuneSettings(address="127.0.0.1:99999")
    with pytest.raises(ConfigurationError, match="autotune_token"):
        AutotuneSettings(address="127.0.0.1:1", token=" ")
    with pytest.raises(ConfigurationError, match="root certificates file"):
        AutotuneSettings(address="127.0.0.1:1", root_certificates="/nonexistent/ca.pem")
    with pytest.raises(ConfigurationError, match="autotune_interval must be a positive number of steps, got 0"):
        AutotuneSettings(address="127.0.0.1:1", interval=0)
    with pytest.raises(ConfigurationError, match=r"apply_delay must be a whole number of steps in \[0, autotune_interval=4\), got 4"):
        AutotuneSettings(address="127.0.0.1:1", interval=4, apply_delay=4)
    assert AutotuneSettings(address="h:1", interval=20).delay == 5
    assert AutotuneSettings(address="h:1", interval=3).delay == 0
    assert AutotuneSettings(address="h:1", interval=20, apply_delay=0).delay == 0
    with pytest.raises(ConfigurationError, match="rpc_timeout_s"):
        AutotuneSettings(address="127.0.0.1:1", rpc_timeout_s=0)


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


def _timings(backward_ms: float, comm: list[float]) -> StepTimings:
    return StepTimings(buckets=[BucketTimingRecord(bucket_index=i, bytes=100 * (i + 1), ready_ms=i, comm_ms=c,
                                                   wait_ms=c / 2) for i, c in enumerate(comm)],
                       backward_ms=backward_ms)


def test_interval_meter_means_dedupes_and_excludes_paused_time() -> None:
    m = IntervalMeter()
    assert m.close(1.0).speed is None  # nothing measured
    m.count(32, now=10.0)
    m.count(32, now=10.5)
    first = _timings(4.0, [1.0, 3.0])
    m.add_timings(first, num_buckets=2)
    m.add_timings(first, num_buckets=2)  # the same step read twice counts once
    m.add_timings(_timings(6.0, [3.0, 5.0]), num_buckets=2)
    m.add_timings(_timings(6.0, [3.0]), num_buckets=2)  # another plan's timings: ignored
    m.pause(11.0)
    m.resume(15.0)  # 4 s of validation
    measured = m.close(12.0 + 4.0)
    speed, timings, backward_ms = measured.speed, measured.timings, measured.backward_ms
    assert speed == pytest.approx(64 / 2.0)
    assert backward_ms == pytest.approx(5.0)
    assert [(t.bucket_index, t.bytes, t.comm_ms, t.wait_ms) for t in timings] == [(0, 100, 2.0, 1.0),
                                                                                (1, 200, 4.0, 2.0)]
    assert m.samples == 0 and m.steps == []


def test_reports_summary_and_helpers() -> None:
    t = (TensorDeclaration("a", 10), TensorDeclaration("b", 20))
    plan = BucketPlan(buckets=((t[0],), (t[1],)), bucket_size=64, is_hierarchical_reduce=True, version=3)
    metrics = BoundaryReport(step=9, samples_per_s=120.0, plan=plan, plan_version=3, applied=True,
                             completed=False).metrics()
    assert metrics == {"autotune/completed": 0.0, "autotune/plan_version": 3.0, "autotune/samples_per_s": 120.0,
                       "autotune/bucket_size": 64.0, "autotune/num_buckets": 2.0, "autotune/hierarchical": 1.0}
    line = AutotuneSummary(model_name="M-1", service="h:1", registered=True, plan_version=3, num_buckets=2,
                           bucket_size=64, hierarchical=True, completed=True, plans_applied=4, speed_before=100.0,
                           speed_after=125.0).line()
    assert "service plan v3, 2 buckets" in line and "hierarchical, completed" in line
    assert "last interval on the first plan 100.0 -> on the final plan 125.0 (1.25x)" in line
    # A job that never reached the service says so, and gives no ratio.
    unreached = AutotuneSummary(model_name="M-1", service="h:1", registered=False, plan_version=-1, num_buckets=2,
                                bucket_size=64, hierarchical=False, completed=False, plans_applied=0,
                                speed_before=100.0, speed_after=126.0)
    assert "not reachable" in unreached.line() and "x)" not in unreached.line() and unreached.ratio is None
    one_plan = AutotuneSummary(model_name="M-1", service="h:1", registered=True, plan_version=0, num_buckets=2,
                               bucket_size=64, hierarchical=False, completed=False, plans_applied=1,
                               speed_before=100.0, speed_after=126.0)
    assert one_plan.ratio is None and "nothing to compare" in one_plan.line()
    assert model_name_for("Net", t) == model_name_for("Net", t[::-1]) != model_name_for("Net", t[:1])
    assert batch_size_of((torch.zeros(7, 3), torch.zeros(7))) == 7
    assert batch_size_of({"x": [torch.zeros(5, 2)]}) == 5
    assert batch_size_of("text") == 1


# ------------------------------------------------------------------ multi-process jobs


def _load(out: Path, prefix: str, n: int) -> list[dict[str, Any]]:
    res = [json.loads((out / f"{prefix}{r}.json").read_text()) for r in range(n)]
    for r in res:
        assert "error" not in r, r["error"]
    return res


def _check_same_plan_every_step(records_per_rank: list[list[list[Any]]], interval: int = 3,
                                delay: int = 0) -> list[list[Any]]:
    """Every rank communicated with the same plan at every step; it changed during the run, at apply points."""
    first = records_per_rank[0]
    for other in records_per_rank[1:]:
        assert other == first
    changes = [first[i][0] for i in range(1, len(first)) if first[i][1:] != first[i - 1][1:]]
    assert len(changes) >= 2, f"the plan changed only at steps {changes}"
    assert all(step % interval == delay for step in changes), changes
    return first


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
    res = _load(tmp_path, "lightning_rank", 2)
    records = _check_same_plan_every_step([r["tuned_records"] for r in res])
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


@pytest.mark.slow
def test_four_ranks_service_killed_and_restarted_then_absent(tmp_path: Path) -> None:
    fault_dir, port, dead_port = tmp_path / "faults", free_port(), free_port()
    fault_dir.mkdir()
    args = (*SERVICE_ARGS, "--world-size", "4", "--state", str(tmp_path / "state"))
    errors: list[BaseException] = []
    with ExitStack() as stack:
        _, first = stack.enter_context(autotune_service(*args, port=port, log_path=tmp_path / "service-0.log"))

        def kill_then_restart() -> None:
            try:
                wait_until(lambda: (fault_dir / "kill").exists(), 300, "the job to reach the kill step")
                os.killpg(first.pid, signal.SIGKILL)  # type: ignore[attr-defined]
                first.wait(timeout=10)  # type: ignore[attr-defined]
                (fault_dir / "killed").touch()
                wait_until(lambda: (fault_dir / "restart").exists(), 300, "the job to reach the restart step")
                stack.enter_context(autotune_service(*args, port=port, log_path=tmp_path / "service-1.log"))
            except BaseException as exc:  # surfaced below, after the job
                errors.append(exc)
            finally:
                (fault_dir / "killed").touch()
                (fault_dir / "restarted").touch()

        driver = threading.Thread(target=kill_then_restart, daemon=True)
        driver.start()
        run_ranks(PLAIN_WORKER, [str(tmp_path), "--address", f"127.0.0.1:{port}", "--local-size", "2",
                                 "--steps", "48", "--fault-dir", str(fault_dir), "--fault-steps=17,23",
                                 "--dead-address", f"127.0.0.1:{dead_port}"],
                  world_size=4, log_dir=tmp_path, timeout_s=420)
        driver.join(timeout=60)
        with AutotuneClient(target=f"127.0.0.1:{port}") as client:
            per_rank = client.describe_model("per-rank-net").summary
    assert not errors, errors
    res = _load(tmp_path, "rank", 4)
    records = _check_same_plan_every_step([r["tuned"]["records"] for r in res])
    for r in res:
        assert r["tuned"]["applied"] == res[0]["tuned"]["applied"]
        assert max(abs(a - b) for a, b in zip(r["reference"]["losses"], r["tuned"]["losses"], strict=True)) < 1e-5
        assert r["tuned"]["threads"] == [] and r["absent"]["threads"] == []
    tuned = res[0]["tuned"]
    # Plans are applied only at step boundaries (multiples of the interval, 3).
    assert all(step % 3 == 0 for step, _, _ in tuned["applied"])
    # The outage (steps 17..22) cost one warning on rank 0 and none elsewhere; after the restart the model
    # was registered again and plans flowed again.
    assert len(tuned["warnings"]) == 1 and "failed" in tuned["warnings"][0], tuned["warnings"]
    assert all(r["tuned"]["warnings"] == [] for r in res[1:])
    # The restarted service (same --state) remembered the best plan measured before the kill: the job
    # registered again and switched to it.
    after = [a for a in tuned["applied"] if a[0] > 23]
    assert after and after[0][1] == 0 and after[0][2] in {a[2] for a in tuned["applied"] if a[0] < 17}, \
        tuned["applied"]
    assert "event=plan_restored" in (tmp_path / "service-1.log").read_text()
    assert records[-1][1] >= 0
    # bytegrad (buckets padded to a multiple of the world size) follows service plans just the same; this run
    # applies them one step after each boundary (apply_delay=1).
    bytegrad = _check_same_plan_every_step([r["bytegrad"]["records"] for r in res], delay=1)
    assert bytegrad[-1][1] >= 1
    for r in res:  # same init and batches as the reference: only the uint8 compression error separates them
        assert max(abs(a - b) for a, b in zip(r["bytegrad"]["losses"], r["reference"]["losses"], strict=False)) < 1e-2
    # Per-rank reports (aggregate_reports=False): every rank reported its own intervals (12 steps at interval 3
    # are 3 boundaries: at most 3 reports if only rank 0 reported for the job).
    assert per_rank.reports_accepted >= 4, per_rank
    assert all(r["per_rank"]["registered"] and r["per_rank"]["threads"] == [] for r in res)
    # A rank that cannot apply a plan makes every rank fail loudly at that boundary, none hangs.
    for r in res:
        assert r["mismatch"].startswith("ranks disagree at step 0 on: plan version, plan layout, apply failure"), \
            r["mismatch"]
    assert "apply failed: RuntimeError: injected" in res[1]["mismatch"]
    # No service at all: the default plan throughout, one warning (rank 0), training completes.
    absent = res[0]["absent"]
    assert len(absent["warnings"]) == 1 and f"no autotune service answers at 127.0.0.1:{dead_port}" in \
        absent["warnings"][0]
    assert all(r["absent"]["warnings"] == [] for r in res[1:])
    assert {rec[1] for rec in absent["records"]} == {-1} and len(absent["losses"]) == 12
    assert not absent["registered"] and "the service was not reachable" in absent["summary"]


def test_measurements_reduce_to_the_jobs_view_on_every_rank(tmp_path: Path) -> None:
    run_ranks(str(HERE / "autotune_reduce_worker.py"), [str(tmp_path)], world_size=3, log_dir=tmp_path,
              timeout_s=180)
    views = [json.loads((tmp_path / f"reduce{r}.json").read_text()) for r in range(3)]
    assert views[0] == views[1] == views[2]  # every rank holds the same job's view
    view = views[0]
    assert (view["speed"], view["ranks"], view["min"], view["max"]) == (200.0, 3, 100.0, 300.0)
    assert view["std"] == pytest.approx((20000 / 3) ** 0.5)
    # Timings from the two ranks that measured them (rank 2 had none): means and the slowest rank.
    assert view["backward_ms"] == pytest.approx(10.5)
    assert view["timings"] == [[0, 1000, 0.0, 0.0, 0.25, 0.5], [1, 2000, 1.5, 2.0, 0.25, 0.5]]
