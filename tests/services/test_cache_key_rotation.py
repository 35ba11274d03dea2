"""A cache key rotation keeps hitting: two real jobs (processes) read through ``rotate-secrets --cache-key``
and its ``--finish`` on a real ``up`` (standalone TLS server with its read port), each reading the cache as a
job does, with the deployment's key files (:mod:`bagua_lightning.client.cache.keyring`)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.client.cache.catalog import entry_prefix
from bagua_lightning.client.cache.keyring import key_id, named_key_id
from bagua_lightning.client.cache.store import RedisStore
from bagua_lightning.core import procs
from bagua_lightning.core.read_plane import SEALED_KEY_PREFIX
from bagua_lightning.core.services_file import ServicesInfo, resolve_cache_keys
from bagua_lightning.services import deploy
from tests.procs import free_port, free_port_block, stop_process
from tests.services.test_deploy_cluster import private_state
from tests.services.test_deploy_recovery import _cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
N = 128  # samples per range
NAME = "rotation"


class Job:
    """A job reading the cache (tests/services/cache_job.py) in its own process; stopped by :meth:`close`."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "BAGUA_LIGHTNING_CACHE_KEY"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.services.cache_job", NAME], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self, lo: int, hi: int) -> dict[str, int]:
        """Samples ``lo..hi-1`` once: this pass's hits, misses, corrupt entries and wrong samples."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{lo} {hi}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        assert ready, "the job did not answer within 120 s"
        line = self.proc.stdout.readline()
        assert line, f"the job ended (code {self.proc.poll()})"
        out: dict[str, int] = json.loads(line)
        assert out["wrong"] == 0, out
        return out

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        stop_process(self.proc)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[ServicesInfo]:
    with private_state(tmp_path), pytest.MonkeyPatch.context() as mp:
        mp.delenv("BAGUA_LIGHTNING_CACHE_KEY", raising=False)
        mp.delenv("BAGUA_LIGHTNING_REDIS_READ_PORT_OFFSET", raising=False)
        yield deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port_block(1, tls=True),
                                        single=True, maxmemory=64 * 1024**2, timeout_s=120))


def _named_key(sample: int) -> str | None:
    """The id of the key that sealed ``sample``'s entry, as stored."""
    store = RedisStore()
    try:
        value = store.get(f"{SEALED_KEY_PREFIX}{entry_prefix(NAME, '0')}{sample}")
    finally:
        store.shutdown()
    return named_key_id(value) if value is not None else None


def _pass(hits: int, misses: int, corrupt: int = 0) -> dict[str, Any]:
    return {"hits": hits, "misses": misses, "corrupt": corrupt, "wrong": 0}


def test_two_jobs_keep_hitting_through_a_cache_key_rotation(deployment: ServicesInfo) -> None:
    key_file = Path(deployment.secrets["cache_key"])
    old = procs.read_secret(key_file).encode()
    jobs: list[Job] = []
    try:
        jobs.append(before := Job())
        assert before.read(0, N) == _pass(0, N)
        assert before.read(0, N) == _pass(N, 0)

        result = _cli("rotate-secrets", "--cache-key")
        assert result.returncode == 0, result.stderr
        new = procs.read_secret(key_file).encode()
        assert new != old and resolve_cache_keys() == [new, old]  # the grace period: both keys

        jobs.append(after := Job())  # started with both keys: the old entries are hits, its own are new-key
        assert after.read(0, 2 * N) == _pass(N, N)
        assert _named_key(0) == key_id(old) and _named_key(N) == key_id(new)
        # the job started before meets the new key's entries, learns the key from the files, and hits them
        assert before.read(0, 2 * N) == _pass(2 * N, 0)
        assert after.read(0, 2 * N) == _pass(2 * N, 0)
        # and seals what it writes from now on with the new key: new writes use the new key
        assert before.read(2 * N, 3 * N) == _pass(0, N)
        assert _named_key(2 * N) == key_id(new)
        assert after.read(0, 3 * N) == _pass(3 * N, 0)
        assert before.read(0, 3 * N) == _pass(3 * N, 0)

        result = _cli("rotate-secrets", "--cache-key", "--finish")
        assert result.returncode == 0, result.stderr
        assert resolve_cache_keys() == [new] and not Path(f"{key_file}.previous").exists()
        again = _cli("rotate-secrets", "--cache-key", "--finish")
        assert again.returncode == 2 and "no cache key rotation is open" in again.stderr

        jobs.append(later := Job())  # the old key is retired: its entries are misses, written again
        assert later.read(0, 3 * N) == _pass(2 * N, N, corrupt=N)
        assert _named_key(0) == key_id(new)
        for job in jobs:
            assert job.read(0, 3 * N) == _pass(3 * N, 0)
    finally:
        for job in jobs:
            job.close()
