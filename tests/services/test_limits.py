"""Values an attacker (or a bug) can send, state that must stay bounded, stores that fail: the service holds.

In-process service logic where the behaviour is the logic's; the real server over gRPC where it is the
wire's; real Redis processes for the stores.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from bagua_lightning.services.autotune.config import ServiceConfig
from bagua_lightning.services.autotune.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from bagua_lightning.services.autotune.persistence import DirectoryPlanStore, RedisPlanStore, StoredPlan
from bagua_lightning.services.autotune.reports import PlanRef, Spread
from bagua_lightning.services.autotune.samplelog import SampleLog, log_file_name
from bagua_lightning.services.autotune.server import create_server
from bagua_lightning.services.autotune.service import AutotuneService
from bagua_lightning.services.redis_cluster import ClusterSpec, start_cluster, stop_cluster
from tests.client.conftest import free_port_block

FAST = {"warmup_time_s": 0.0, "sampling_confidence_time_s": 0.0}
MB = 1024**2


def _tensors(n: int = 5, prefix: str = "w") -> list[tuple[str, int, str]]:
    return [(f"{prefix}{i}", (i + 1) * MB // 4, "f32") for i in range(n)]


def _ref(plan: BucketPlan, *, issued: bool = True) -> PlanRef:
    return PlanRef(version=plan.version, decode=lambda: plan,
                   matches=lambda other: issued and other.same_layout(plan) and other.bucket_size == plan.bucket_size)


# ------------------------------------------------------------------ numbers that pass a naive check


def test_huge_element_counts_are_refused_and_the_model_keeps_working() -> None:
    service = AutotuneService(ServiceConfig(**FAST))
    with pytest.raises(InvalidArgumentError, match=r"must be > 0 and <= 2\*\*40, got 9223372036854775807"):
        service.register("m", [("w", 2**63 - 1, "f32")], True)
    plan = service.register("m", _tensors(), True)
    assert service.ask("m", 0, 0)[0] == plan


@pytest.mark.parametrize("field", ["speed", "backward_ms", "comm_ms", "ready_ms", "speed_max"])
def test_overflowing_measurements_are_refused_and_tuning_goes_on(field: str) -> None:
    service = AutotuneService(ServiceConfig(max_samples=3, **FAST))
    plan = service.register("m", _tensors(), True)
    speed, backward = (1e308 if field == "speed" else 10.0), (1e308 if field == "backward_ms" else 1.0)
    timings = [dict(bucket_index=0, bytes=MB, ready_ms=1.0, comm_ms=1.0, wait_ms=0.0)]
    if field in ("comm_ms", "ready_ms"):
        timings[0][field] = 1e308
    from bagua_lightning.proto.plan import BucketTimingRecord

    records = [BucketTimingRecord(**t) for t in timings]  # type: ignore[arg-type]
    spread = Spread(ranks=1, speed_max=1e308 if field == "speed_max" else 0.0)
    with pytest.raises(InvalidArgumentError, match=field):
        service.report("m", 0, 0, _ref(plan), speed, records, backward, spread)
    for it in range(1, 8):  # the model still tunes to completion: nothing overflowed into its state
        plan, completed = service.ask("m", 0, it)
        if completed:
            break
        service.report("m", 0, it, _ref(plan), 100.0 + it)
    assert completed


def test_a_huge_train_iter_cannot_freeze_a_model() -> None:
    service = AutotuneService(ServiceConfig(max_samples=50, **FAST))
    first = service.register("m", _tensors(), True)
    with pytest.raises(InvalidArgumentError, match=r"train_iter must be in \[0, 2\*\*62\]"):
        service.ask("m", 0, 2**63 - 1)
    assert service.ask("m", 0, 2**62)[0] == first  # valid, and far ahead of the job
    versions = set()
    for it in range(1, 6):  # later asks of the real job still get new plans
        plan, _ = service.ask("m", 0, it)
        versions.add(plan.version)
        service.report("m", 0, it, _ref(plan), 100.0 + it)
    assert len(versions) > 1, versions


def test_a_stored_plan_out_of_range_is_ignored_after_a_restart(tmp_path: Path) -> None:
    service = AutotuneService(ServiceConfig(**FAST), store=DirectoryPlanStore(tmp_path))
    default = service.register("m", _tensors(), True)
    key = service.session("m").registration.store_key
    stored = json.loads(StoredPlan(plan=default, score=5.0, completed=True, model_name="m").to_json())
    stored["plan"]["bucket_size"] = 2**70
    (tmp_path / f"{key}.json").write_text(json.dumps(stored))
    again = AutotuneService(ServiceConfig(**FAST), store=DirectoryPlanStore(tmp_path))
    assert again.register("m", _tensors(), True) == default  # the default plan, not INTERNAL
    stored["plan"]["bucket_size"] = 1024
    stored["score"] = float("inf")
    (tmp_path / f"{key}.json").write_text(json.dumps(stored).replace("Infinity", "1e999"))
    assert AutotuneService(ServiceConfig(**FAST), store=DirectoryPlanStore(tmp_path)).register(
        "m", _tensors(), True) == default


def test_a_forged_plan_with_other_middle_tensors_is_not_the_issued_one() -> None:
    """Over the wire: same version, same first/last tensor and length of every bucket, other middle tensors."""
    service = AutotuneService(ServiceConfig(max_samples=10, default_bucket_size=4 * MB, world_size=2, **FAST))
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    try:
        with AutotuneClient(port=port) as client:
            issued = client.register_tensors("m", [{"name": n, "num_elements": e, "dtype": d}
                                                   for n, e, d in _tensors(6)])
            assert [len(b) for b in issued.buckets] == [3, 1, 1, 1]  # w0 w1 w2 | w3 | w4 | w5
            (a, b, c), (d,), (e,), (f,) = issued.buckets
            forged = BucketPlan(buckets=((a, d, c), (b,), (e,), (f,)), bucket_size=issued.bucket_size,
                                version=issued.version)
            assert client.report_metrics("m", 0, 0, issued, 10.0)
            assert client.report_metrics("m", 1, 0, forged, 1000.0)  # a real plan, measured as itself
            client.ask_hyperparameters("m", 0, 1)
            first = client.describe_model("m").samples[0]
        assert first.plan_version == 0 and first.speed == 10.0 and first.reports == 1
        assert service.session("m").layouts_tracked == 2
    finally:
        server.stop(grace=None)
        service.close()


# ------------------------------------------------------------------ bounded state


def test_long_names_are_refused_before_they_are_kept() -> None:
    service = AutotuneService(ServiceConfig(max_name_bytes=256, **FAST))
    with pytest.raises(ResourceExhaustedError, match=r"model_name is 8388608 bytes long.*--max-name-bytes"):
        service.register("x" * 8 * MB, _tensors(), True)
    with pytest.raises(ResourceExhaustedError, match=r"tensor_list\[0\].name is 300 bytes"):
        service.register("m", [("é" * 150, 4, "f32")], True)
    assert service.model_names == []


def test_a_flood_of_models_evicts_idle_ones_and_new_models_are_served() -> None:
    service = AutotuneService(ServiceConfig(max_models=8, **FAST))
    for i in range(200):
        service.register(f"junk-{i}", _tensors(2), True)
        service.ask(f"junk-{i}", 0, 0)
    assert len(service.model_names) == 8 and service.evicted == 192
    service.register("real", _tensors(), True)  # never refused
    assert "real" in service.model_names and len(service.model_names) == 8
    with pytest.raises(NotFoundError, match="evicted"):
        service.ask("junk-0", 0, 1)


def test_a_flood_of_distinct_plans_keeps_per_model_state_bounded() -> None:
    config = ServiceConfig(world_size=4, max_layouts=16, max_plans=8, **FAST)
    service = AutotuneService(config)
    tensors = _tensors(40)
    service.register("m", tensors, True)
    session = service.session("m")
    decls = [TensorDeclaration(n, e, d) for n, e, d in tensors]
    for i in range(400):  # 400 distinct valid layouts (a cut after tensor i % 39, rotated), each reported once
        cut = 1 + i % 39
        order = decls[i // 39:] + decls[: i // 39]
        plan = BucketPlan(buckets=(tuple(order[:cut]), tuple(order[cut:])), bucket_size=1 + i)
        service.report("m", i % 4, i, _ref(plan, issued=False), 10.0 + i % 7)
        if i % 3 == 0:
            service.ask("m", 0, i)
    assert session.reports_accepted == 400
    assert session.layouts_tracked <= config.max_layouts
    assert session.plans_remembered <= config.max_plans


# ------------------------------------------------------------------ the sample log


def test_sample_log_names_are_safe_and_distinct(tmp_path: Path) -> None:
    names = ["a/b", "a_b", "../../etc/passwd", "x" * 300, ".hidden", "ünïcode"]
    files = {log_file_name(n) for n in names}
    assert len(files) == len(names)
    assert all("/" not in f and len(f.encode()) < 255 and not f.startswith(".") for f in files)
    log = SampleLog(tmp_path)
    for n in names:
        assert log.write(n, {"model_name": n})
    assert {p.name for p in tmp_path.iterdir()} == files
    assert [r["model_name"] for r in log.read("a/b")] == ["a/b"]


def test_a_failing_sample_log_never_fails_a_request(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    service = AutotuneService(ServiceConfig(max_samples=20, **FAST), sample_log=SampleLog(logs))
    plan = service.register("y" * 600, _tensors(), True)  # a name over the file system's 255 bytes
    shutil.rmtree(logs)
    logs.write_text("not a directory any more")  # every write now fails, as on a full or read-only disk
    for it in range(4):
        plan, _ = service.ask("y" * 600, 0, it)
        service.report("y" * 600, 0, it, _ref(plan), 50.0 + it)
    assert service.io.flush()
    assert service.io.sample_log_errors >= 1 and "sample log" in (service.io.problem() or "")
    service.close()


# ------------------------------------------------------------------ stores: failing, hung, down at start


def test_a_failing_store_is_reported_and_never_fails_a_request(tmp_path: Path) -> None:
    plans = tmp_path / "plans"
    service = AutotuneService(ServiceConfig(max_samples=2, **FAST), store=DirectoryPlanStore(plans))
    shutil.rmtree(plans)
    plans.write_text("")
    plan = service.register("m", _tensors(), True)  # the load fails: the default plan
    for it in range(4):
        plan, _ = service.ask("m", 0, it)
        service.report("m", 0, it, _ref(plan), 50.0 + it)
    service.io.flush()
    service.io.ping()
    assert service.io.store_errors >= 1 and "plan store" in (service.io.problem() or "")
    service.close()


@pytest.fixture
def hung_redis() -> Iterator[str]:
    """A TCP server that accepts connections and never answers (a hung Redis)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join(timeout=5)
        for s in held:
            s.close()
        listener.close()


def test_a_hung_store_costs_registrations_at_most_its_deadline_and_shows_in_health(hung_redis: str) -> None:
    service = AutotuneService(ServiceConfig(store_timeout_s=0.3, **FAST),
                              store=RedisPlanStore(hung_redis, timeout_s=0.3))
    results: list[BucketPlan] = []
    threads = [threading.Thread(target=lambda i=i: results.append(service.register(f"m{i}", _tensors(), True)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 6 and all(p.version == 0 for p in results)  # default plans, no error
    assert service.io.store_errors >= 1 and service.io.problem() is not None
    service.close()


def test_redis_store_down_at_start_connects_as_a_cluster_client_later(tmp_path: Path) -> None:
    port = free_port_block(3)
    store = RedisPlanStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    assert store.cluster is None  # nothing there yet: the mode is not decided
    with pytest.raises(Exception):  # noqa: B017  # down: the call fails (the service counts it)
        store.load("k")
    start_cluster(ClusterSpec(nodes=3, port=port, state_root=tmp_path, password=None))
    try:
        plan = BucketPlan(buckets=((TensorDeclaration("w", 4),),))
        for i in range(20):  # keys on every master: a non-cluster client would get MOVED for most
            store.save(f"k{i}", StoredPlan(plan=plan, score=float(i), completed=False, model_name="m"))
        assert store.cluster is True
        assert [store.load(f"k{i}").score for i in range(20)] == [float(i) for i in range(20)]  # type: ignore[union-attr]
    finally:
        store.close()
        stop_cluster(port, tmp_path)


def test_proposals_in_a_worker_process_never_hold_a_request_and_tuning_completes() -> None:
    service = AutotuneService(ServiceConfig(max_samples=6, tuning_processes=1, **FAST))
    try:
        plan = service.register("m", _tensors(8), True)
        job_speed = {n: 100.0 + 10 * n for n in range(1, 9)}
        asked: list[int] = []
        completed = False
        for it in range(20_000):
            plan, completed = service.ask("m", 0, it)
            asked.append(plan.version)
            if completed:
                break
            service.report("m", 0, it, _ref(plan), job_speed.get(len(plan.buckets), 50.0))
            time.sleep(0.005)
        assert completed, asked[-5:]
        # While a proposal was computed the asks kept the current plan (no request waited for the tuner).
        assert max(asked.count(v) for v in set(asked)) > 1
        assert len(service.session("m").samples) <= 6
    finally:
        service.close()
