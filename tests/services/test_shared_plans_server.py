"""Shared plans through real processes: the service on a free port, its CLI, redis-server, kill -9."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from bagua_lightning.services.autotune.mirror import open_store
from bagua_lightning.services.autotune.persistence import REDIS_PREFIX, RedisPlanStore, StoredPlan
from bagua_lightning.services.redis_cluster import ClusterSpec, start_cluster, stop_cluster
from tests.client.conftest import free_port_block
from tests.procs import free_port, running, wait_until
from tests.services import simulated_trainers
from tests.services.conftest import FAST, cli, one_line_error


def test_an_evil_jobs_report_completes_no_other_job_and_ls_forget_show_it(start_service, tmp_path: Path,
                                                                          env: dict[str, str]) -> None:
    plans = tmp_path / "plans"
    tensors = [t.to_dict() for t in simulated_trainers.abcde()]
    with (start_service(*FAST, "--max-samples", "2", "--state", str(plans)) as (target, _),
          AutotuneClient(target=target) as client):
        # The evil job: 1 sample/s for its first plan, 1e12 for the next; its own numbers complete it.
        answer = client.register_job("evil-net", tensors, job_id="evil", world_size=2)
        for it, speed in ((1, 1.0), (2, 1e12)):
            client.report_metrics("evil-net", 0, it, answer.plan, speed, job_id="evil")
            answer = client.ask_hyperparameters("evil-net", 0, it, job_id="evil")
        assert answer.completed
        # The shared plan holds neither its verdict nor its 1e12: `autotune ls` says where it came from.
        ls = cli(env, "autotune", "ls", "--target", target)
        assert ls.returncode == 0, ls.stderr
        (row,) = [line for line in ls.stdout.splitlines() if line.endswith(("tuning", "completed"))
                  and " evil-net " in line and "-w2-n2" in line]
        key, model, job_id, _, _, score, reports, measured, _, state = row.split()
        assert (model, job_id, score, reports, measured, state) == ("evil-net", "evil", "1", "1", "1", "tuning")
        stored = StoredPlan.from_json((plans / f"{key}.json").read_text())
        assert (stored.score, stored.completed, stored.job_id, stored.reports) == (1.0, False, "evil", 1)
        # A second job, another job id and model name, same shape: not completed, it starts measuring.
        second = client.register_job("honest-net", tensors, job_id="honest", world_size=2)
        assert not second.completed
        first = client.ask_hyperparameters("honest-net", 0, 0, job_id="honest")
        assert not first.completed
        # forget JOB removes the evil job's plan, in the service and in the store, and says what it removed.
        forget = cli(env, "autotune", "forget", "evil", "--target", target)
        assert forget.returncode == 0, forget.stderr
        assert forget.stdout.startswith(f"forgot {key} (model evil-net, job evil,") and "1 reports" in forget.stdout
        assert not (plans / f"{key}.json").exists()
        one_line_error(cli(env, "autotune", "forget", "evil", "--target", target), 1, "autotune forget",
                       "'evil'", "autotune ls")
        assert "best plan per model shape" not in cli(env, "autotune", "ls", "--target", target).stdout
        client.report_metrics("honest-net", 0, 1, first.plan, 50.0, job_id="honest")
        after = client.ask_hyperparameters("honest-net", 0, 1, job_id="honest")
        assert not after.completed and after.plan.version > first.plan.version
        # forget MODEL and forget SHAPE: the honest job's first measured plan is shared now.
        shared = client.list_jobs()[1]
        assert [(p.key, p.model_name, p.job_id, p.reports, p.samples) for p in shared] == [
            (key, "honest-net", "honest", 1, 1)]
        assert shared[0].saved_at > 0
        assert cli(env, "autotune", "forget", "honest-net", "--target", target).stdout.startswith(f"forgot {key}")
        client.report_metrics("honest-net", 0, 2, after.plan, 55.0, job_id="honest")
        client.ask_hyperparameters("honest-net", 0, 2, job_id="honest")
        wait_until(lambda: (plans / f"{key}.json").exists(), 20, "the honest job's next best in the store")
        assert cli(env, "autotune", "forget", key, "--target", target).stdout.startswith(f"forgot {key}")
        assert client.list_jobs()[1] == []


def _redis_up(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def test_best_plans_survive_kill_9_of_the_service_and_a_redis_node_restarted_empty(start_service,
                                                                                    tmp_path: Path) -> None:
    redis_port = free_port()
    # As `bagua-lightning up` runs Redis: no snapshots, no append-only file (a restarted node comes back empty).
    redis_cmd = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                 "no", "--dir", str(tmp_path)]
    plans = tmp_path / "plans"
    args = (*FAST, "--max-samples", "3", "--store-timeout-s", "5", "--state", f"redis://127.0.0.1:{redis_port}/0", "--state", str(plans))
    job = simulated_trainers.sim_job(0)
    tensors = [t.to_dict() for t in job.tensors]
    with running(redis_cmd) as redis_proc:
        wait_until(lambda: _redis_up(redis_port), 20, "redis-server")
        with start_service(*args) as (target, service), AutotuneClient(target=target) as client:
            reply = client.register_job("net", tensors, job_id="run-1", world_size=4, nproc_per_node=2)
            reply = simulated_trainers.tune_to_completion(client, job, "net", reply, job_id="run-1")
            assert reply.completed
            (key,) = [p.key for p in client.list_jobs()[1]]
            node = redis.Redis(port=redis_port, socket_timeout=5)

            def both_hold_the_verdict() -> bool:
                raw = node.get(REDIS_PREFIX + key)
                file = plans / f"{key}.json"
                return (raw is not None and json.loads(raw)["completed"] and file.exists()
                        and json.loads(file.read_text())["completed"])

            wait_until(both_hold_the_verdict, 20, "the final plan in Redis and in the directory")
            service.kill()  # kill -9: nothing is flushed on the way out
            assert service.wait(timeout=20) == -9
        redis_proc.kill()
        redis_proc.wait(timeout=20)
    with running(redis_cmd):
        wait_until(lambda: _redis_up(redis_port), 20, "redis-server, restarted")
        node = redis.Redis(port=redis_port, socket_timeout=5)
        assert node.get(REDIS_PREFIX + key) is None  # the node lost everything
        with start_service(*args) as (target, _), AutotuneClient(target=target) as client:
            # The restarted service lists the plan (from the directory) and writes it back to Redis.
            (shared,) = client.list_jobs()[1]
            assert (shared.key, shared.job_id, shared.completed) == (key, "run-1", True)
            assert node.get(REDIS_PREFIX + key) is not None
            # A new job starts from it (and confirms it); the first job registering again keeps its verdict.
            second = client.register_job("net", tensors, job_id="run-2", world_size=4, nproc_per_node=2)
            assert second.plan.same_layout(reply.plan) and not second.completed
            again = client.register_job("net", tensors, job_id="run-1", world_size=4, nproc_per_node=2)
            assert again.plan.same_layout(reply.plan) and again.completed


def test_a_cluster_store_lists_and_forgets_plans_on_every_master(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ClusterSpec(nodes=1, port=free_port_block(1), state_root=tmp_path, password="pw")
    start_cluster(spec)
    try:
        monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", "pw")
        store = open_store(f"redis://127.0.0.1:{spec.port}")
        assert isinstance(store, RedisPlanStore)
        plan = BucketPlan(((TensorDeclaration(name="w", num_elements=4, dtype="f32"),),), bucket_size=16)
        keys = {f"k{i}-w1-n1" for i in range(20)}  # many slots
        for key in keys:
            store.save(key, StoredPlan(plan=plan, score=1.0, completed=True, model_name="m"))
        assert store.cluster and set(store.keys(100)) == keys and len(store.keys(5)) == 5
        assert store.delete("k3-w1-n1") and not store.delete("k3-w1-n1")
        assert set(store.keys(100)) == keys - {"k3-w1-n1"}
        store.close()
    finally:
        stop_cluster(spec.port, tmp_path)
