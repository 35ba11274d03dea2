"""A model's session without a server: plans per train_iter, duplicates, completion, persistence."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from bagua_lightning.services.autotune.config import ServiceConfig
from bagua_lightning.services.autotune.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from bagua_lightning.services.autotune.mirror import open_store
from bagua_lightning.services.autotune.persistence import DirectoryPlanStore, RedisPlanStore, StoredPlan
from bagua_lightning.services.autotune.reports import PlanRef
from bagua_lightning.services.autotune.service import AutotuneService, Span
from tests.procs import free_port, running, wait_until
from tests.services.simulated_trainers import abcde, sim_job

FAST = {"warmup_time_s": 0.0, "sampling_confidence_time_s": 0.0}


def _rows(tensors: list[TensorDeclaration]) -> list[tuple[str, int, str]]:
    return [(t.name, t.num_elements, t.dtype) for t in tensors]


def _ref(plan: BucketPlan) -> PlanRef:
    return PlanRef(version=plan.version, decode=lambda: plan,
                   matches=lambda issued: issued.same_layout(plan) and issued.bucket_size == plan.bucket_size)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_duplicates_identical_plans_and_completion() -> None:
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=3, **FAST))
    job = sim_job(0)
    plan = service.register("m", _rows(list(job.tensors)), True)
    assert plan.version == 0
    versions = []
    for it in range(10):
        plan, completed = service.ask("m", 0, it)
        assert service.ask("m", 1, it) == (plan, completed)  # identical for every rank
        versions.append(plan.version)
        if completed:
            break
        speed, timings, backward = job.measure(plan)
        assert service.report("m", 0, it, _ref(plan), speed, timings, backward) is True
        assert service.report("m", 0, it, _ref(plan), speed, timings, backward) is False  # duplicate
    assert completed and versions == sorted(versions)
    assert service.ask("m", 0, 3) == service.ask("m", 1, 3)  # an older iteration keeps its decision
    assert service.ask("m", 0, 100)[1] is True


def test_warmup_and_confidence_hold_the_plan() -> None:
    clock = _Clock()
    config = ServiceConfig(warmup_time_s=30.0, sampling_confidence_time_s=5.0, max_samples=10)
    service = AutotuneService(config, clock=clock)
    service.register("m", _rows(abcde()), True)
    session = service.session("m")
    plan = session.current_plan
    assert session.report(0, 0, None, 100.0)  # during warm-up: accepted, not used
    clock.now = 31.0
    assert session.ask(0, 1)[0] == plan  # no report after warm-up yet
    session.report(0, 2, None, 100.0)
    assert session.ask(0, 3)[0] == plan  # held for 31 s, but measured only since the warm-up ended
    clock.now = 32.0
    assert session.ask(0, 4)[0] == plan
    clock.now = 40.0
    assert session.ask(0, 5)[0] != plan  # now a new plan
    assert len(session.samples) == 1


def test_autotune_level_0_hands_back_the_default() -> None:
    service = AutotuneService(ServiceConfig(autotune_level=0, **FAST))
    plan = service.register("m", _rows(abcde()), True)
    service.report("m", 0, 0, None, 1.0)
    assert service.ask("m", 0, 1) == (plan, True)


def test_registration_errors() -> None:
    service = AutotuneService(ServiceConfig(max_models=1, max_tensors=5, **FAST))
    service.register("m", _rows(abcde()), True)
    with pytest.raises(FailedPreconditionError, match="different tensor_list"):
        service.register("m", _rows(abcde()[:2]), True)
    with pytest.raises(FailedPreconditionError, match="world_size"):
        service.register("m", _rows(abcde()), True, world_size=2)
    with pytest.raises(ResourceExhaustedError, match="--max-tensors"):
        service.register("big", _rows([*abcde(), TensorDeclaration("F", 1)]), True)
    with pytest.raises(InvalidArgumentError, match="model_name is empty"):
        service.register("", _rows(abcde()), True)
    with pytest.raises(InvalidArgumentError, match="spans is empty"):
        service.report_execution_order([], "m")
    with pytest.raises(InvalidArgumentError, match="'Q'"):
        service.report_execution_order([Span(0, "tensor_ready", "Q", 0, 0)], "m")
    service.register("other", _rows(abcde()), True)  # one model more than --max-models: the idle one goes
    assert service.model_names == ["other"] and service.evicted == 1
    with pytest.raises(NotFoundError, match="evicted"):
        service.ask("m", 0, 0)


def test_whether_to_bucket_false_is_one_bucket_per_dtype() -> None:
    service = AutotuneService(ServiceConfig(**FAST))
    tensors = [TensorDeclaration("a", 10, "f32"), TensorDeclaration("b", 10, "f16"), TensorDeclaration("c", 10)]
    assert service.register("m", _rows(tensors), False).tensor_names == [["a", "c"], ["b"]]


def test_directory_store_round_trip_and_restart(tmp_path: Path) -> None:
    store = DirectoryPlanStore(tmp_path)
    service = AutotuneService(ServiceConfig(max_samples=2, **FAST), store=store)
    job = sim_job(1)
    service.register("m", _rows(list(job.tensors)), True, world_size=1)
    for it in range(6):
        plan, completed = service.ask("m", 0, it)
        if completed:
            break
        speed, timings, backward = job.measure(plan)
        service.report("m", 0, it, _ref(plan), speed, timings, backward)
    assert completed
    assert service.io.flush()  # saves are written by the service's writer thread
    again = AutotuneService(ServiceConfig(**FAST), store=DirectoryPlanStore(tmp_path))
    restored = again.register("m2", _rows(list(job.tensors)), True, world_size=1)
    # Another job's plan is where the new one starts, not a verdict: it measures before it counts as tuned.
    assert restored.same_layout(plan) and again.ask("m2", 0, 0)[1] is False


def test_store_ignores_a_plan_for_other_tensors(tmp_path: Path) -> None:
    store = DirectoryPlanStore(tmp_path)
    service = AutotuneService(ServiceConfig(**FAST), store=store)
    key = dataclasses.replace(service.register("m", _rows(abcde()), True)).version  # register once for the key
    assert key == 0
    registration = service.session("m").registration
    wrong = BucketPlan(((TensorDeclaration("Z", 4),),))
    store.save(registration.store_key, StoredPlan(plan=wrong, score=1.0, completed=True, model_name="m"))
    fresh = AutotuneService(ServiceConfig(**FAST), store=store)
    assert fresh.register("m", _rows(abcde()), True).tensor_names != [["Z"]]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    with running(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]):
        wait_until(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                                          timeout=5).stdout.strip() == b"PONG", 20, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"


def test_redis_store_round_trip(redis_url: str) -> None:
    store = open_store(redis_url)
    assert isinstance(store, RedisPlanStore)
    plan = BucketPlan(tuple((t,) for t in abcde()), bucket_size=123, is_hierarchical_reduce=True, version=4)
    assert store.load("k") is None
    store.save("k", StoredPlan(plan=plan, score=9.5, completed=True, model_name="m"))
    loaded = store.load("k")
    assert loaded is not None and loaded.plan == plan and loaded.score == 9.5 and loaded.completed
    store.close()


# ------------------------------------------------------------------ jobs: own sessions, shared best plans


def _tune(service: AutotuneService, job_id: str, job_seed: int, *, first_iter: int = 0,
          speed_scale: float = 1.0) -> tuple[BucketPlan, bool]:
    """Report and ask until the session of (job_id, "m") completes; returns its final answer."""
    job = sim_job(job_seed)
    plan, completed = service.ask("m", 0, first_iter, job_id=job_id)
    for it in range(first_iter + 1, first_iter + 20):
        if completed:
            break
        speed, timings, backward = job.measure(plan)
        service.report("m", 0, it, _ref(plan), speed * speed_scale, timings, backward, job_id=job_id)
        plan, completed = service.ask("m", 0, it, job_id=job_id)
    return plan, completed


def test_jobs_of_one_model_tune_apart_and_share_their_best_plan(tmp_path: Path) -> None:
    store = DirectoryPlanStore(tmp_path)
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=3, **FAST), store=store)
    rows = _rows(list(sim_job(0).tensors))
    for job_id in ("job-a", "job-b"):
        assert service.register("m", rows, True, job_id=job_id).version == 0
    # Job a measures plans; job b's history stays empty, and its plan for an iteration is its own.
    _, completed_a = _tune(service, "job-a", 0)
    assert completed_a
    a, b = service.session("m", "job-a"), service.session("m", "job-b")
    assert len(a.samples) == 3 and b.samples == [] and not b.completed
    # Job b measures the same plans but reports them twice as slow. Scores of two jobs are not compared
    # (other batch sizes, other GPUs): the latest completed job's plan is the shared one.
    final_b, completed_b = _tune(service, "job-b", 0, first_iter=1000, speed_scale=0.5)
    assert completed_b and len(b.samples) == 3 and len(a.samples) == 3
    assert b.best is not None and a.best is not None and b.best.score < a.best.score
    ((key, shared),) = service.shared_plans()
    assert shared.job_id == "job-b" and shared.completed and shared.plan.same_layout(final_b)
    assert shared.reports == b.best.reports and shared.samples == 3 and shared.saved_at > 0
    service.close()
    assert StoredPlan.from_json((tmp_path / f"{key}.json").read_text()).job_id == "job-b"
    # A third job, on a new service that reads the store, starts from b's final plan, but not as final.
    third = AutotuneService(ServiceConfig(world_size=2, max_samples=3, **FAST), store=DirectoryPlanStore(tmp_path))
    session = third.register_session("m", rows, True, job_id="job-c")
    assert session.current_plan.same_layout(final_b) and not session.completed
    assert session.confirming is not None and session.confirming.job_id == "job-b"
    assert {(i.registration.job_id, i.sample_count) for i in third.list_models()} == {("job-c", 0)}
    # Job b registering again (a restarted trainer) gets its own verdict back.
    assert third.register_session("m", rows, True, job_id="job-b").completed
    third.close()


def test_a_job_that_changes_world_size_re_registers_and_continues() -> None:
    service = AutotuneService(ServiceConfig(max_samples=20, **FAST))
    rows = _rows(list(sim_job(0).tensors))
    service.register("m", rows, True, world_size=2, job_id="elastic")
    _tune(service, "elastic", 0)  # a few plans
    before = service.session("m", "elastic")
    assert before.next_version > 1
    plan = service.register("m", rows, True, world_size=3, job_id="elastic")
    after = service.session("m", "elastic")
    assert after is not before and after.registration.world_size == 3
    assert plan.version == before.next_version  # versions keep increasing: trainers re-bucket
    assert after.samples == [] and len(service.model_names) == 1
    # The new shape has its own best plans; the old shape's best stays for jobs of that shape.
    assert {k.split("-w")[1] for k, _ in service.shared_plans()} == {"2-n2"}
    with pytest.raises(FailedPreconditionError, match="different tensor_list"):
        service.register("m", rows[:2], True, world_size=3, job_id="elastic")
    # Without a job id the name is one session: another world size is refused, as before.
    service.register("m", rows, True, world_size=2)
    with pytest.raises(FailedPreconditionError, match="world_size"):
        service.register("m", rows, True, world_size=3)


def test_a_resumed_job_starts_from_its_plan_or_continues_its_session() -> None:
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=20, **FAST))
    rows = _rows(abcde())
    default = service.register("m", rows, True, job_id="first")
    saved = BucketPlan(buckets=tuple((t,) for b in reversed(default.buckets) for t in reversed(b)), bucket_size=4,
                       version=7)
    resumed = service.register_session("m", rows, True, job_id="second", resume=saved, resume_completed=True)
    assert resumed.current_plan.same_layout(saved) and resumed.current_plan.version == 7 and resumed.completed
    # The session exists: the registration continues it and the resume plan is ignored.
    again = service.register_session("m", rows, True, job_id="first", resume=saved)
    assert again.current_plan == default
    with pytest.raises(InvalidArgumentError, match="resume_hyperparameters does not cover"):
        service.register_session("m", rows, True, job_id="third",
                                 resume=BucketPlan(buckets=(default.buckets[0][:2],), version=1))
    with pytest.raises(InvalidArgumentError, match="control character"):
        service.register("m", rows, True, job_id="bad\nid")
    with pytest.raises(NotFoundError, match="under job_id 'nobody'"):
        service.ask("m", 0, 0, job_id="nobody")
    with pytest.raises(FailedPreconditionError, match="held by 2 jobs"):
        service.describe("m")
    assert service.describe("m", "second").registration.job_id == "second"
