"""The engine's autotune controller (``engine/autotune/``) while training: real autotune service processes,
real Gloo multi-process jobs in plain torch loops (the Lightning front door: ``tests/strategy/test_autotune_lightning.py``).

* settings, interval measurements, summaries and reports, in process;
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

import pytest
import torch

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.autotune import (
    AutotuneSettings,
    AutotuneSummary,
    BoundaryReport,
    IntervalMeter,
    batch_size_of,
    model_name_for,
)
from bagua_lightning.proto.plan import BucketPlan, BucketTimingRecord, StepTimings, TensorDeclaration
from tests.engine.autotune.plan_records import check_same_plan_every_step, load_results
from tests.procs import free_port, wait_until
from tests.ranks import run_ranks
from tests.services.conftest import FAST, autotune_service

HERE = Path(__file__).parent
PLAIN_WORKER = str(HERE / "controller_workers.py")
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
    res = load_results(tmp_path, "rank", 4)
    records = check_same_plan_every_step([r["tuned"]["records"] for r in res])
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
    bytegrad = check_same_plan_every_step([r["bytegrad"]["records"] for r in res], delay=1)
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
    run_ranks(str(HERE / "reduce_worker.py"), [str(tmp_path)], world_size=3, log_dir=tmp_path,
              timeout_s=180)
    views = [json.loads((tmp_path / f"reduce{r}.json").read_text()) for r in range(3)]
    assert views[0] == views[1] == views[2]  # every rank holds the same job's view
    view = views[0]
    assert (view["speed"], view["ranks"], view["min"], view["max"]) == (200.0, 3, 100.0, 300.0)
    assert view["std"] == pytest.approx((20000 / 3) ** 0.5)
    # Timings from the two ranks that measured them (rank 2 had none): means and the slowest rank.
    assert view["backward_ms"] == pytest.approx(10.5)
    assert view["timings"] == [[0, 1000, 0.0, 0.0, 0.25, 0.5], [1, 2000, 1.5, 2.0, 0.25, 0.5]]
