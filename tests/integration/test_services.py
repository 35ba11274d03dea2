"""The deployed services, end to end: the same test bodies against docker compose or ``bagua-lightning up``.

The ``services`` fixture (conftest.py) picks the deployment. Tests run in file order and share it; the
last one takes it down and checks that nothing is left running.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.client import AutotuneClient
from bagua_lightning.client.cache.store import RedisStore
from bagua_lightning.core import procs as processes
from bagua_lightning.core.services_file import ENV_REDIS_PASSWORD
from bagua_lightning.core.tls_trust import resolve_client_tls
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from bagua_lightning.services import deploy, health
from bagua_lightning.services.autotune.mirror import open_store
from bagua_lightning.services.autotune.persistence import StoredPlan
from tests.integration.conftest import Deployment
from tests.procs import bindable


@pytest.fixture(autouse=True)
def secrets_in_env(services: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients in this process get the deployment's secrets the way a trainer elsewhere would: the environment."""
    for name, value in services.secret_env().items():
        monkeypatch.setenv(name, value)


def _ca() -> Path | None:
    """The CA the deployment's clients pin (the environment, as for a trainer elsewhere), or None: plaintext."""
    found = resolve_client_tls(None)
    return Path(found.ca) if found is not None else None


TENSORS: list[dict[str, Any]] = [{"name": f"layer{i}.weight", "num_elements": 1000 * (i + 1), "dtype": "f32"} for i in range(5)]


def test_both_services_are_healthy(services: Deployment) -> None:
    autotune = health.check_autotune(services.autotune, timeout_s=5.0, tls_ca=_ca())
    assert autotune.healthy, autotune.detail
    redis_health = health.check_redis(services.redis_hosts, cluster=True, timeout_s=5.0, tls=resolve_client_tls(None),
                                      password=services.secret_env().get(ENV_REDIS_PASSWORD))
    assert redis_health.healthy, redis_health.detail
    assert "16384/16384 slots" in redis_health.detail


def test_status_command_reports_both_healthy(services: Deployment) -> None:
    hosts = ",".join(f"{h['host']}:{h['port']}" for h in services.redis_hosts)
    args = ["status", "--json", "--autotune", services.autotune, "--redis", hosts]
    if services.kind == "native":
        args = ["status", "--json"]  # from the services file this deployment wrote
    result = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", *args], env=services.env or None,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"autotune": {"healthy": true' in result.stdout and '"redis": {"healthy": true' in result.stdout


def test_register_tensors_round_trip(services: Deployment) -> None:
    model = f"integration-{uuid.uuid4().hex[:8]}"
    with AutotuneClient(target=services.autotune) as client:
        assert client.health_check(timeout_s=5.0)
        plan = client.register_tensors(model, TENSORS)
        names = [t.name for bucket in plan.buckets for t in bucket]
        assert sorted(names) == sorted(t["name"] for t in TENSORS)
        assert plan.bucket_size > 0
        # Every rank asking for the same iteration gets the same plan back.
        asked = client.ask_hyperparameters(model, rank=0, train_iter=0)
        assert asked.plan.tensor_names == plan.tensor_names


def test_redis_store_set_get_through_the_cluster(services: Deployment) -> None:
    store = RedisStore(hosts=services.redis_hosts)
    try:
        assert store.is_cluster
        prefix = f"integration:{uuid.uuid4().hex[:8]}"
        values = {f"{prefix}:{i}": f"value-{i}".encode() for i in range(64)}  # spread over all masters
        store.set(f"{prefix}:one", b"first")
        assert store.get(f"{prefix}:one") == b"first"
        store.mset(values)
        keys = [*values, f"{prefix}:missing"]
        assert store.mget(keys) == [*values.values(), None]
        slots_used = {deploy_slot(k) for k in values}
        assert len(slots_used) > 3
    finally:
        store.shutdown()


def deploy_slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def test_autotune_plan_store_on_the_deployed_redis(services: Deployment) -> None:
    # The autotune service keeps its best plans where the deployment's --state points: the cluster.
    store = open_store(deploy.redis_state_url(services.redis_hosts[0]["host"], services.redis_hosts[0]["port"]))
    assert store is not None
    plan = BucketPlan(buckets=((TensorDeclaration(name="w", num_elements=4, dtype="f32"),),), bucket_size=16)
    for i in range(8):  # keys in different slots, on different masters
        key = f"integration-{uuid.uuid4().hex[:8]}-{i}"
        store.save(key, StoredPlan(plan=plan, score=float(i), completed=True, model_name="m"))
        loaded = store.load(key)
        assert loaded is not None and loaded.score == float(i)


def test_up_twice_is_harmless(services: Deployment) -> None:
    before = sorted(services.processes())
    assert before, "the deployment runs no process"
    services.up()
    assert sorted(services.processes()) == before  # nothing restarted, nothing added
    autotune = health.check_autotune(services.autotune, timeout_s=5.0, tls_ca=_ca())
    assert autotune.healthy, autotune.detail
    assert health.check_redis(services.redis_hosts, cluster=True, timeout_s=5.0, tls=resolve_client_tls(None),
                              password=services.secret_env().get(ENV_REDIS_PASSWORD)).healthy


def test_down_leaves_no_process(services: Deployment) -> None:
    # Last test of the module: takes the deployment down.
    running = services.processes()
    assert running
    recorded = services.recorded()
    services.down()
    assert services.processes(exited_too=True) == []
    if services.kind == "native":
        assert recorded is not None
        pids = [recorded.pids["autotune"], recorded.pids["lighthouse"], *recorded.pids["redis"]]
        assert not [p for p in pids if processes.pid_alive(int(p))], "a process outlived `down`"
        assert services.recorded() is None, "`down` must remove the services file"
        assert all(bindable(p) for p in services.ports()), "a port is still taken after `down`"
    assert not health.check_autotune(services.autotune, timeout_s=1.0).healthy
