"""Loggers and checkpoints: a real autotune service, a real Redis, 2-rank Lightning fits on Gloo.

The strategy logs the plan version, the bucket count and the train loader's cache hit rate
through the trainer's ``CSVLogger``; the autotuner's state goes into the checkpoint, and a job
resumed from it (a new process, on a restarted service that remembers nothing) starts on the
saved plan with its version and keeps its job id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.services.redis_cluster import ClusterSpec, running_cluster
from tests.client.conftest import free_port_block
from tests.procs import free_port
from tests.ranks import run_ranks
from tests.services.conftest import FAST, autotune_service

HERE = Path(__file__).parent
WORKER = str(HERE / "autotune_checkpoint_worker.py")
# Many samples: tuning is still going on when the job stops, so the resumed job has a session to go on with.
SERVICE_ARGS = (*FAST, "--max-samples", "50", "--no-early-stop")
ENV = {"TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "0"}  # no launcher id: the checkpoint's job id is kept


def _phase(tmp_path: Path, phase: str, target: str, redis: str, steps: int) -> list[dict[str, Any]]:
    logs = tmp_path / f"logs-{phase}"
    logs.mkdir()
    run_ranks(WORKER, [str(tmp_path), phase, "--address", target, "--redis", redis, "--steps", str(steps)],
              world_size=2, log_dir=logs, timeout_s=420, env=ENV)
    res = [json.loads((tmp_path / f"{phase}_rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert "error" not in r, r["error"]
    return res


@pytest.mark.slow
def test_metrics_reach_the_logger_and_a_resumed_job_starts_on_the_saved_plan(tmp_path: Path) -> None:
    port = free_port()
    spec = ClusterSpec(port=free_port_block(1, with_bus=False), state_root=tmp_path / "redis", nodes=1,
                       cluster=False, timeout_s=60.0)
    with running_cluster(spec) as redis:
        host = redis.hosts_string
        with autotune_service(*SERVICE_ARGS, port=port, log_path=tmp_path / "service1.log") as (target, _):
            fit = _phase(tmp_path, "fit", target, host, steps=24)
        with autotune_service(*SERVICE_ARGS, port=port, log_path=tmp_path / "service2.log") as (target, _):
            resumed = _phase(tmp_path, "resume", target, host, steps=30)
            with AutotuneClient(target=target) as client:
                (session,) = client.list_models()

    # Logged through the trainer's CSVLogger (rank 0): plan version and buckets, the cache hit rate.
    rows = fit[0]["metrics"]
    bagua = [r for r in rows if r.get("bagua/plan_version")]
    assert {int(r["step"]) for r in bagua} >= {2, 4, 6, 8}
    cache = [float(r["cache/hit_rate"]) for r in rows if r.get("cache/hit_rate")]
    assert cache and cache[0] < 1.0 and max(cache) > 0.5  # cold first, then served from Redis
    assert all(float(r["bagua/num_buckets"]) >= 1 for r in bagua)
    assert any(r.get("autotune/plan_version") for r in rows)

    # The checkpoint holds the autotuner's state, the same on every rank, in plain types.
    state = fit[0]["state"]
    assert state == fit[1]["state"] == fit[0]["checkpoint_state"]
    assert state["model_name"] == "checkpointed net" and state["job_id"].startswith("job-")
    assert state["version"] > 0 and state["plans_applied"] >= 2 and not state["completed"]
    last = fit[0]["records"][-1]
    assert [state["version"]] == [last[1]]

    # The resumed job starts on the saved plan (its layout and version), keeps the job id, and the new
    # service's session for it started from that plan.
    for r in resumed:
        first = r["records"][0]
        assert first[0] == 24 and first[1] == state["version"] and first[2] == last[2], (first, last)
        assert r["state"]["job_id"] == state["job_id"]
        assert r["state"]["plans_applied"] >= state["plans_applied"]
    assert session.model_name == "checkpointed net" and session.job_id == state["job_id"]
    assert session.plan_version >= state["version"]
