"""Many jobs, one autotune service: a real service process and real 2-rank Gloo jobs.

* Two concurrent jobs of the same model (one named by the launcher's run id, one by the id
  its rank 0 makes) get separate tuning sessions; the better of their best plans is shared,
  and a third job starts from it.
* A job whose world size changes (the same run id, 2 ranks then 1) re-registers and goes on
  with increasing plan versions.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.engine.autotune import AutotuneState, launcher_job_id
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from tests.ranks import run_ranks
from tests.services.conftest import FAST, autotune_service

HERE = Path(__file__).parent
WORKER = str(HERE / "jobs_worker.py")
SERVICE_ARGS = (*FAST, "--max-samples", "4")
STEPS = 24
INTERVAL = 3


# ------------------------------------------------------------------ in-process: names, state, metrics


def test_the_job_id_comes_from_the_launcher() -> None:
    assert launcher_job_id({}) is None
    assert launcher_job_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun without --rdzv-id
    assert launcher_job_id({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "7"}) == "torchrun-abc"
    assert launcher_job_id({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}) == "slurm-7.2"
    assert launcher_job_id({"BAGUA_LIGHTNING_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "abc"}) == "mine"
    assert launcher_job_id({"BAGUA_LIGHTNING_JOB_ID": "bad\x07", "SLURM_JOB_ID": "7"}) == "slurm-7"


def test_the_checkpointed_state_round_trips_and_checks_the_model() -> None:
    tensors = [TensorDeclaration("a", 4), TensorDeclaration("b", 8), TensorDeclaration("c", 2)]
    plan = BucketPlan(buckets=((tensors[2], tensors[0]), (tensors[1],)), bucket_size=64, version=5)
    state = AutotuneState.of(job_id="job-1", model_name="m", model_fingerprint="f", plan=plan, version=5,
                             completed=False, plans_applied=3)
    again = AutotuneState.from_dict(state.to_dict())
    assert again == state and again.bucket_plan(tensors) == plan
    with pytest.raises(ValueError, match="tensor 'c'"):
        again.bucket_plan(tensors[:2])
    with pytest.raises(ValueError, match="malformed"):
        AutotuneState.from_dict({**state.to_dict(), "job_id": "a\x00b"})
    default = AutotuneState.of(job_id="j", model_name="m", model_fingerprint="f", plan=plan, version=-1,
                               completed=False, plans_applied=0)
    assert default.plan is None and default.bucket_plan(tensors) is None  # the default plan is not resumed


# ------------------------------------------------------------------ real jobs against a real service


def _job(tmp_path: Path, target: str, prefix: str, *, world_size: int = 2, steps: int = STEPS,
         env: dict[str, str] | None = None, meet: str = "") -> list[dict[str, Any]]:
    logs = tmp_path / prefix
    logs.mkdir()
    run_ranks(WORKER, [str(tmp_path), "--address", target, "--prefix", prefix, "--steps", str(steps),
                       *(["--meet", meet] if meet else [])],
              world_size=world_size, log_dir=logs, timeout_s=300, env=env)
    res = [json.loads((tmp_path / f"{prefix}rank{r}.json").read_text()) for r in range(world_size)]
    for r in res:
        assert "error" not in r, r["error"]
    assert len({r["job_id"] for r in res}) == 1, "the ranks of one job must agree on its id"
    return res


@pytest.mark.slow
def test_concurrent_jobs_tune_apart_and_a_third_starts_from_their_best(tmp_path: Path) -> None:
    with autotune_service(*SERVICE_ARGS, log_path=tmp_path / "service.log") as (target, _):
        results: dict[str, list[dict[str, Any]]] = {}
        errors: list[BaseException] = []

        def job(prefix: str, env: dict[str, str]) -> None:
            try:
                # Both jobs register before either reports: neither starts from the other's plan.
                results[prefix] = _job(tmp_path, target, prefix, env=env, meet="a,b" if prefix == "a" else "b,a")
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=job, args=("a", {"TORCHELASTIC_RUN_ID": "run-a"})),
                   threading.Thread(target=job, args=("b", {"TORCHELASTIC_RUN_ID": "none"}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        job_a, job_b = results["a"][0]["job_id"], results["b"][0]["job_id"]
        assert job_a == "torchrun-run-a" and job_b.startswith("job-") and job_b != job_a
        with AutotuneClient(target=target) as client:
            models, shared = client.list_jobs()
            assert sorted((m.model_name, m.job_id) for m in models) == sorted(
                [("shared-net", job_a), ("shared-net", job_b)])
            described = {j: client.describe_model("shared-net", j) for j in (job_a, job_b)}
        # Separate histories: each session measured only plans its own job ran, at most once per boundary.
        for prefix, job_id in (("a", job_a), ("b", job_b)):
            samples = described[job_id].samples
            ran = {record[1] for record in results[prefix][0]["records"]}
            assert samples and {s.plan_version for s in samples} <= ran, (samples, ran)
            assert sum(s.reports for s in samples) <= STEPS // INTERVAL
        # Shared: one best plan for the shape, one job's own best (scores of two jobs are never compared).
        (best,) = shared
        assert best.key.endswith("-w2-n2") and best.job_id in (job_a, job_b)
        scores = {j: d.summary.best_score for j, d in described.items()}
        assert best.score == pytest.approx(scores[best.job_id])
        best_plan = described[best.job_id].best
        assert best_plan is not None
        # A third job of the same model starts on that plan, in its own session.
        third = _job(tmp_path, target, "c", steps=6)
        assert third[0]["records"][0][2] == best_plan.fingerprint()
        with AutotuneClient(target=target) as client:
            assert len(client.list_models()) == 3


@pytest.mark.slow
def test_a_job_whose_world_size_changes_re_registers_and_goes_on(tmp_path: Path) -> None:
    env = {"TORCHELASTIC_RUN_ID": "elastic"}
    with autotune_service(*SERVICE_ARGS, log_path=tmp_path / "service.log") as (target, _):
        before = _job(tmp_path, target, "two", steps=12, env=env)
        after = _job(tmp_path, target, "one", world_size=1, steps=6, env=env)
        with AutotuneClient(target=target) as client:
            models, shared = client.list_jobs()
    assert before[0]["job_id"] == after[0]["job_id"] == "torchrun-elastic"
    (session,) = models  # one session per job: the new shape replaced the old one
    assert session.job_id == "torchrun-elastic" and session.world_size == 1
    last_version = max(record[1] for record in before[0]["records"])
    assert after[0]["records"][0][1] > last_version  # versions go on: the ranks re-bucket
    assert any(p.key.endswith("-w2-n2") for p in shared)  # what the 2-rank shape learned stays shared
    assert "job_reregistered" in (tmp_path / "service.log").read_text()
