"""What one job's plans mean for another: a starting point to confirm, never a verdict (in-process service).

The service and its stores are the real ones (directory stores on disk); the gRPC and CLI side of the
same rules is in test_shared_plans_server.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from bagua_lightning.proto.plan import BucketPlan
from bagua_lightning.services.autotune.config import ServiceConfig
from bagua_lightning.services.autotune.costmodel import Sample
from bagua_lightning.services.autotune.errors import InvalidArgumentError, NotFoundError
from bagua_lightning.services.autotune.mirror import MirroredPlanStore, open_store
from bagua_lightning.services.autotune.persistence import DirectoryPlanStore, StoredPlan
from bagua_lightning.services.autotune.reports import PlanRef
from bagua_lightning.services.autotune.service import AutotuneService, Span
from bagua_lightning.services.autotune.sharing import OUTLIER_FACTOR, outlier, replaces
from tests.services.simulated_trainers import abcde

FAST = {"warmup_time_s": 0.0, "sampling_confidence_time_s": 0.0}
ROWS = [(t.name, t.num_elements, t.dtype) for t in abcde()]


def _ref(plan: BucketPlan) -> PlanRef:
    return PlanRef(version=plan.version, decode=lambda: plan,
                   matches=lambda issued: issued.same_layout(plan) and issued.bucket_size == plan.bucket_size)


_SIZES = itertools.count(1 << 20)


def _sample(speed: float, backward_ms: float = 0.0, plan: BucketPlan | None = None) -> Sample:
    """A sample of ``plan``; by default of a plan of its own (a bucket size no other sample has)."""
    plan = plan if plan is not None else BucketPlan(((abcde()[0],),), bucket_size=next(_SIZES))
    return Sample(plan=plan, speed=speed, backward_ms=backward_ms, bucket_timings=(), reports=1, train_iter=0)


def _stored(plan: BucketPlan, *, completed: bool, job_id: str = "a", score: float = 5.0) -> StoredPlan:
    return StoredPlan(plan=plan, score=score, completed=completed, model_name="net", saved_at=1.0e9, job_id=job_id)


class _Job:
    """One job's trainer, in-process: reports ``speed_of(plan)`` for the plan it was handed, then asks."""

    def __init__(self, service: AutotuneService, job_id: str, model: str = "net") -> None:
        self.service, self.job_id, self.model = service, job_id, model
        self.session = service.register_session(model, ROWS, True, world_size=2, job_id=job_id)
        self.it = 0
        self.plan, self.completed = service.ask(model, 0, 0, job_id=job_id)

    def step(self, speed: float) -> tuple[BucketPlan, bool]:
        self.it += 1
        self.service.report(self.model, 0, self.it, _ref(self.plan), speed, job_id=self.job_id)
        self.plan, self.completed = self.service.ask(self.model, 0, self.it, job_id=self.job_id)
        return self.plan, self.completed


def _other_plan(default: BucketPlan) -> BucketPlan:
    """A layout other than the default: every tensor in its own bucket, in reverse."""
    return BucketPlan(buckets=tuple((t,) for b in reversed(default.buckets) for t in reversed(b)),
                      bucket_size=4, version=3)


# --------------------------------------------------------------------------------------------- the rules

def test_outlier_rule_is_a_factor_of_the_median_of_the_jobs_other_plans() -> None:
    history = [_sample(100.0), _sample(120.0), _sample(90.0)]
    assert not outlier(history[0], history[:1])  # a first plan has nothing to compare with
    assert not outlier(history[1], history)
    high = _sample(100.0 * OUTLIER_FACTOR * 1.01)
    low = _sample(90.0 / OUTLIER_FACTOR / 1.01)
    assert outlier(high, [*history, high]) and outlier(low, [*history, low])
    assert not outlier(_sample(100.0 * OUTLIER_FACTOR * 0.99), history)
    # The forged first report is the outlier once honest ones follow: the median is an observed value.
    forged = _sample(1e12)
    assert outlier(forged, [forged, _sample(1.0)]) and outlier(forged, [forged, _sample(1.0), _sample(1.1)])
    assert not outlier(_sample(1.0), [forged, _sample(1.0), _sample(1.1)])
    # Speed-less reports compare step times (1/ms), never with speeds.
    timed = [_sample(0.0, 10.0), _sample(0.0, 12.0)]
    assert outlier(_sample(0.0, 0.5), timed) and not outlier(_sample(0.0, 11.0), timed)
    assert not outlier(_sample(0.0, 0.5), [_sample(100.0)])


def test_a_completed_plan_replaces_the_shared_one_whatever_the_scores() -> None:
    plan = BucketPlan(((abcde()[0],),))
    done_slow = _stored(plan, completed=True, score=1.0)
    done_fast = _stored(plan, completed=True, score=1e9)
    tuning = _stored(plan, completed=False, score=1e12)
    assert replaces(tuning, None) and replaces(done_slow, done_fast) and replaces(done_slow, tuning)
    assert not replaces(tuning, done_slow)  # a job still tuning never displaces a verdict
    assert replaces(tuning, dataclasses.replace(tuning, score=1.0))


# ------------------------------------------------------------------------------- jobs against each other

def test_an_evil_jobs_forged_report_completes_no_other_job(tmp_path: Path) -> None:
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=2, **FAST), store=DirectoryPlanStore(tmp_path))
    evil = _Job(service, "evil", model="evil-net")
    first = evil.plan
    evil.step(1.0)  # 1 sample/s for the default plan
    assert not evil.completed
    evil.step(1e12)  # then 1e12 for the next
    assert evil.completed  # max_samples: its own numbers decide for it
    ((key, shared),) = service.shared_plans()
    assert shared.score == 1.0 and shared.plan.same_layout(first) and not shared.completed  # the 1e12 stayed out
    assert service.io.flush()
    assert json.loads((tmp_path / f"{key}.json").read_text())["score"] == 1.0
    # A later job, another job id and model name, same shape: not completed, and it measures.
    victim = _Job(service, "honest", model="honest-net")
    assert not victim.session.completed and not victim.completed
    plan, completed = victim.step(50.0)
    assert not completed and plan.version == 1 and len(victim.session.samples) == 1


def test_a_completed_jobs_outlier_never_reaches_the_shared_plan(tmp_path: Path) -> None:
    # 1 sample/s for the default, 1e12 for the next plan, then 2 for it when measured again: the plan's mean
    # (5e11) is the job's final verdict, and the job's other samples of that very plan do not vouch for it.
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=3, **FAST), store=DirectoryPlanStore(tmp_path))
    evil = _Job(service, "evil", model="evil-net")
    first = evil.plan
    for speed in (1.0, 1e12, 2.0):
        evil.step(speed)
    assert evil.completed
    ((key, shared),) = service.shared_plans()
    assert shared.score == 1.0 and shared.plan.same_layout(first) and not shared.completed
    assert service.io.flush()
    assert json.loads((tmp_path / f"{key}.json").read_text())["score"] == 1.0
    plan = BucketPlan(((abcde()[0],),), bucket_size=4096)
    verdict = dataclasses.replace(_sample(5e11, plan=plan), reports=2)
    measured = [_sample(1.0), _sample(1e12, plan=plan), _sample(5e11, plan=plan)]
    assert outlier(verdict, measured)  # only the other plan's 1.0 compares
    assert not outlier(verdict, measured[1:])  # a job that measured no other plan: nothing to compare with


def test_a_forged_verdict_is_confirmed_against_the_jobs_default_and_loses(tmp_path: Path) -> None:
    store = DirectoryPlanStore(tmp_path)
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=6, **FAST), store=store)
    default = service.register("probe", ROWS, True, world_size=2, job_id="probe")
    forged = _other_plan(default)
    key = service.session("probe", "probe").registration.store_key
    store.save(key, _stored(forged, completed=True, job_id="evil", score=1e12))
    fresh = AutotuneService(ServiceConfig(world_size=2, max_samples=6, **FAST), store=DirectoryPlanStore(tmp_path))
    job = _Job(fresh, "c")
    assert job.plan.same_layout(forged) and not job.completed
    assert job.session.confirming is not None and job.session.confirming.job_id == "evil"
    plan, completed = job.step(10.0)  # the shared plan, measured by this job
    assert plan.same_layout(default) and not completed  # next: its own default
    plan, completed = job.step(40.0)  # the default is faster here: the shared plan is not confirmed
    assert not completed and job.session.confirming is None
    assert [s.speed for s in job.session.samples] == [10.0, 40.0]
    assert job.session.best is not None and job.session.best.plan.same_layout(default)


def test_a_final_plan_that_the_job_confirms_completes_it(tmp_path: Path) -> None:
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=6, **FAST), store=DirectoryPlanStore(tmp_path))
    a = _Job(service, "a")
    good = _other_plan(a.plan)
    key = a.session.registration.store_key
    service.shared.save(key, dataclasses.replace(_stored(good, completed=True, job_id="a"), saved_at=2.0e9))
    c = _Job(service, "c")
    assert c.plan.same_layout(good) and not c.completed
    assert c.step(30.0)[0].same_layout(a.plan)  # the default next
    plan, completed = c.step(20.0)  # the shared plan wins in this job's own numbers
    assert completed and plan.same_layout(good)
    ((_, shared),) = service.shared_plans()
    assert shared.job_id == "c" and shared.completed and shared.score == 30.0 and shared.samples == 2
    # Had the shared plan not been final, the job would tune on even though it won.
    service.shared.forget(key)
    service.shared.save(key, _stored(good, completed=False, job_id="a"))
    d = _Job(service, "d")
    d.step(30.0)
    plan, completed = d.step(20.0)
    assert not completed and d.session.confirming is None


def test_a_job_keeps_its_own_verdict_and_a_resumed_job_its_checkpoint(tmp_path: Path) -> None:
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=2, **FAST), store=DirectoryPlanStore(tmp_path))
    a = _Job(service, "a")
    a.step(10.0)
    a.step(11.0)
    assert a.completed
    service.close()
    # A restarted service: the same job registering again (a restarted trainer) gets its own verdict back,
    # another job confirms it first.
    again = AutotuneService(ServiceConfig(world_size=2, max_samples=2, **FAST), store=DirectoryPlanStore(tmp_path))
    assert again.register_session("net", ROWS, True, world_size=2, job_id="a").completed
    assert not again.register_session("net", ROWS, True, world_size=2, job_id="b").completed
    # Registrations without a job id are never "the same job": they confirm.
    assert not again.register_session("anon", ROWS, True, world_size=2).completed
    resumed = again.register_session("net", ROWS, True, world_size=2, job_id="r", resume=a.plan,
                                     resume_completed=True)
    assert resumed.completed and resumed.confirming is None
    again.close()


# ---------------------------------------------------------------------------------------------- forget

def test_forget_by_model_shape_or_job_in_memory_and_in_the_store(tmp_path: Path) -> None:
    service = AutotuneService(ServiceConfig(max_samples=6, **FAST), store=DirectoryPlanStore(tmp_path))
    keys = {}
    for world in (1, 2, 4):
        session = service.register_session("net", ROWS, True, world_size=world, job_id=f"job-{world}")
        keys[world] = session.registration.store_key
        service.shared.save(keys[world], _stored(session.current_plan, completed=True, job_id=f"job-{world}"))
    known = service.shared.best(keys[4])
    assert known is not None
    service.shared.save(keys[4], dataclasses.replace(known, model_name="other"))
    assert service.io.flush() and len(list(tmp_path.glob("*.json"))) == 3
    with pytest.raises(NotFoundError, match="'nothing-like-it'"):
        service.forget("nothing-like-it")
    with pytest.raises(InvalidArgumentError, match="empty"):
        service.forget("")
    removed, warning = service.forget("job-2")
    assert [k for k, _ in removed] == [keys[2]] and warning == ""
    assert not (tmp_path / f"{keys[2]}.json").exists()
    removed, _ = service.forget(keys[1])
    assert [k for k, _ in removed] == [keys[1]]
    # A restarted service knows the rest from the store only: forget by model name finds it there.
    fresh = AutotuneService(ServiceConfig(**FAST), store=DirectoryPlanStore(tmp_path))
    assert fresh.shared_plans() == [] and [k for k, _ in fresh.shared_plans(from_store=True)] == [keys[4]]
    removed, _ = fresh.forget("other")
    assert [(k, p.job_id) for k, p in removed] == [(keys[4], "job-4")] and list(tmp_path.glob("*.json")) == []
    # New jobs of those shapes start from the default plan.
    assert fresh.register_session("net", ROWS, True, world_size=4, job_id="new").confirming is None


# ---------------------------------------------------------------------------------------- mirrored store

def test_a_mirrored_store_keeps_plans_through_the_loss_of_either_copy(tmp_path: Path) -> None:
    store = open_store([str(tmp_path / "one"), str(tmp_path / "two")])
    assert isinstance(store, MirroredPlanStore)
    plan = BucketPlan(tuple((t,) for t in abcde()), bucket_size=9, version=2)
    store.save("k", _stored(plan, completed=True))
    one, two = (DirectoryPlanStore(tmp_path / n) for n in ("one", "two"))
    assert one.load("k") == two.load("k") == _stored(plan, completed=True)
    # One copy lost (a store restarted empty): a load finds the other and writes it back.
    assert one.delete("k") and one.load("k") is None
    assert store.load("k") is not None and one.load("k") == two.load("k")
    # A newer save that only one copy took wins, and is copied to the other.
    newer = dataclasses.replace(_stored(plan, completed=False), saved_at=2.0e9)
    two.save("k", newer)
    assert store.load("k") == newer and one.load("k") == newer
    assert sorted(store.keys(10)) == ["k"] and store.delete("k") and store.keys(10) == []
    # A store that cannot be written: saves raise (the service counts it failing) but the other copy is kept.
    (tmp_path / "two").rmdir()
    (tmp_path / "two").write_text("not a folder")
    with pytest.raises(OSError):
        store.save("k2", _stored(plan, completed=True))
    assert one.load("k2") is not None and store.load("k2") is not None
    assert open_store([]) is None and isinstance(open_store([str(tmp_path / "x")]), DirectoryPlanStore)


def test_the_shared_plan_is_measured_as_cut_even_when_the_ready_order_arrives_first(tmp_path: Path) -> None:
    service = AutotuneService(ServiceConfig(world_size=2, max_samples=6, **FAST), store=DirectoryPlanStore(tmp_path))
    a = _Job(service, "a")
    good = _other_plan(a.plan)
    service.shared.save(a.session.registration.store_key, _stored(good, completed=True, job_id="a"))
    c = _Job(service, "c")
    names = [t.name for t in reversed(abcde())]
    service.report_execution_order([Span(1, "tensor_ready", n, i, i) for i, n in enumerate(names)], "net", "c")
    plan, _ = c.step(30.0)
    assert [s.plan.same_layout(good) for s in c.session.samples] == [True]
    assert plan.tensor_names != good.tensor_names and [n for b in plan.tensor_names for n in b] == names
    plan, completed = c.step(20.0)  # the default in this job's ready order loses: confirmed
    assert completed and plan.same_layout(good)
