"""A reboot loses nothing: after kill -9 of every process of a real ``up`` (3 masters, 3 replicas, TLS, read
ports), ``up`` brings back the same deployment: the same secrets and CA, every Redis node from its own
``nodes.conf`` and append-only file with the cached samples, the plans, the autotune service. A job that ran
through it reconnects and hits again; ``up --fresh`` starts over (new secrets, an empty cache).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bagua_lightning.core.pinned_redis import cluster_client
from bagua_lightning.core.services_file import read_services_file
from bagua_lightning.services.health import check_autotune
from tests.procs import free_port, free_port_block
from tests.services.test_cache_key_rotation import Job, _pass
from tests.services.test_deploy_cluster import private_state
from tests.services.test_deploy_recovery import _cli, _kill, _redis_pids, _secrets, _tls

pytestmark = pytest.mark.slow
N = 256
PLAN = "bagua_lightning:autotune:plan:reboot-test"  # where the autotune service keeps a plan


def _reads_back(job: Job, deadline_s: float = 90.0) -> dict[str, int]:
    """Passes over the samples until one is all hits (the job's store backs off a dead node up to 5 s)."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = job.read(0, N)
        if result["hits"] == N or time.monotonic() > deadline:
            return result


def test_kill_9_of_everything_then_up_brings_the_same_deployment_back(tmp_path: Path) -> None:
    with private_state(tmp_path), pytest.MonkeyPatch.context() as mp:
        mp.delenv("BAGUA_LIGHTNING_CACHE_KEY", raising=False)
        mp.delenv("BAGUA_LIGHTNING_REDIS_READ_PORT_OFFSET", raising=False)
        args = ["--autotune-port", str(free_port()), "--lighthouse-port", str(free_port()), "--redis-port", str(free_port_block(6, tls=True)),
                "--maxmemory", "64mb", "--timeout", "120"]
        result = _cli("up", *args)
        assert result.returncode == 0, result.stderr
        before = read_services_file()
        assert before is not None and before.tls is not None
        secrets, ca = _secrets(before), Path(before.tls.ca).read_bytes()
        first = before.redis_hosts[0]
        with cluster_client([(first["host"], first["port"])], password=secrets["redis_password"],
                            socket_timeout=10, **_tls(before)) as rc:
            rc.set(PLAN, b"the tuned plan")
        job = Job()
        try:
            assert job.read(0, N) == _pass(0, N)
            assert job.read(0, N) == _pass(N, 0)

            pids = [before.pids["autotune"], before.pids["lighthouse"], *_redis_pids(before).values()]
            for pid in pids:  # as a reboot does: every process at once, none told
                _kill(pid)
            down = job.read(0, N)  # the job goes on from the source
            assert down["hits"] == 0 and down["misses"] == N

            result = _cli("up", *args)
            assert result.returncode == 0, result.stdout + result.stderr
            assert result.stdout.count(": restarted (pid") == 8, result.stdout  # 6 nodes, autotune, lighthouse
            after = read_services_file()
            assert after is not None and after.tls is not None
            assert after.deployment == before.deployment and after.redis_node_ids == before.redis_node_ids
            assert _secrets(after) == secrets and Path(after.tls.ca).read_bytes() == ca
            assert set(_redis_pids(after).values()).isdisjoint(pids)
            assert check_autotune(str(after.autotune), token=secrets["autotune_token"],
                                  tls_ca=Path(after.tls.ca)).healthy
            with cluster_client([(first["host"], first["port"])], password=secrets["redis_password"],
                                socket_timeout=10, **_tls(after)) as rc:
                assert rc.get(PLAN) == b"the tuned plan"
            assert _reads_back(job) == _pass(N, 0)  # the running job hits again: same key, same entries
            fresh_job = Job()
            try:
                assert fresh_job.read(0, N) == _pass(N, 0)  # the samples came back from the nodes' own files
            finally:
                fresh_job.close()

            result = _cli("up", *args, "--fresh")  # the explicit way to start over
            assert result.returncode == 0, result.stderr
            again = read_services_file()
            assert again is not None and again.deployment != before.deployment
            assert _secrets(again)["cache_key"] != secrets["cache_key"]
            new_job = Job()
            try:
                assert new_job.read(0, N) == _pass(0, N)  # an empty cache
            finally:
                new_job.close()
        finally:
            job.close()
