"""The demo hands its jobs the deployment's secrets as file paths (``$NAME_FILE``), never as values in their
environment; a job, a real child process, reads them back from there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_lightning import demo
from bagua_lightning.core import procs
from bagua_lightning.core.services_file import ENV_FILE, ServicesInfo, write_services_file

HOSTS = [{"host": "127.0.0.1", "port": 7000}]
AUTOTUNE = "127.0.0.1:29600"
VALUES = {"redis_password": "demo-pw-1", "autotune_token": "demo-tok-2", "cache_key": "demo-key-3"}
NAMES = {"redis_password": "BAGUA_LIGHTNING_REDIS_PASSWORD", "autotune_token": "BAGUA_LIGHTNING_AUTOTUNE_TOKEN",
         "cache_key": "BAGUA_LIGHTNING_CACHE_KEY"}
READ = """
import json
from bagua_lightning.core.services_file import resolve_autotune_token, resolve_cache_key, resolve_redis_password
hosts = [{"host": "127.0.0.1", "port": 7000}]
print(json.dumps([resolve_redis_password(hosts), resolve_autotune_token("127.0.0.1:29600"),
                  resolve_cache_key(hosts).decode()]))
"""


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A services file recording the addresses and the 0600 secret files (as `up` writes them)."""
    files = {name: str(procs.write_private(tmp_path / "secrets" / name, value)) for name, value in VALUES.items()}
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "services.json"))
    for name in NAMES.values():
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name + "_FILE", raising=False)
    write_services_file(ServicesInfo(deployment="d" * 32, state_dir=str(tmp_path), autotune=AUTOTUNE,
                                     redis_hosts=HOSTS, secrets=files))
    return files


def _job(env: dict[str, str]) -> list[str]:
    """What a job started with ``env`` (and no services file) resolves."""
    result = subprocess.run([sys.executable, "-c", READ], capture_output=True, text=True, timeout=60,
                            env={"PATH": os.environ["PATH"], "BAGUA_LIGHTNING_SERVICES_FILE": "/nonexistent", **env})
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))


def test_the_jobs_get_the_secret_files_never_the_values(deployment: dict[str, str]) -> None:
    secrets = demo._secrets(AUTOTUNE, HOSTS)
    assert secrets == {NAMES[k]: v for k, v in VALUES.items()}  # this process has them, for its health checks
    endpoints = demo.Endpoints(autotune=AUTOTUNE, redis_hosts=["127.0.0.1:7000"], cluster=False, how="running",
                               secrets=secrets, secret_files=demo._secret_files(secrets))
    env = endpoints.env()
    assert {k: v for k, v in env.items() if k.endswith("_FILE")} == {
        NAMES[k] + "_FILE": path for k, path in deployment.items()}
    assert not [v for v in VALUES.values() if v in json.dumps(env)]
    # A job (no services file of its own) reads them from the files.
    assert _job(env) == list(VALUES.values())


def test_a_secret_the_user_set_is_left_to_the_inherited_environment(
        deployment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "the-users-token")
    secrets = demo._secrets(AUTOTUNE, HOSTS)
    files = demo._secret_files(secrets)
    assert set(files) == {"BAGUA_LIGHTNING_REDIS_PASSWORD_FILE", "BAGUA_LIGHTNING_CACHE_KEY_FILE"}
    env = {**demo.Endpoints(autotune=AUTOTUNE, redis_hosts=["127.0.0.1:7000"], cluster=False, how="running",
                            secrets=secrets, secret_files=files).env(),
           "BAGUA_LIGHTNING_AUTOTUNE_TOKEN": "the-users-token"}  # what the job inherits
    assert _job(env) == [VALUES["redis_password"], "the-users-token", VALUES["cache_key"]]
