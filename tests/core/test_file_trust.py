"""Files another user could forge are refused: the state folder, the services file, the secret files and the
CA they name (:mod:`bagua_lightning.core.file_trust`).

The hostile user is real: ``nobody`` (uid 65534) creates the folder and the files, through a shell run under
its own uid, in a shared sticky folder as ``/tmp`` is. The clients (``RedisStore``, ``AutotuneClient``) and the
CLI (``status``, ``up``, ``down``) refuse in one line naming the path, its owner, its mode and the fix, and the
listeners the forged file names are never contacted.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.core import procs
from bagua_lightning.core.file_trust import UntrustedFileError, check_trusted
from bagua_lightning.core.services_file import (
    ENV_FILE,
    ServicesInfo,
    read_services_file,
    resolve_redis_password,
    write_services_file,
)
from bagua_lightning.core.tls_trust import ClientTLS
from tests.core.test_services_file_secrets import GrpcRecorder, RespRecorder
from tests.services.conftest import cli, one_line_error

try:
    NOBODY = pwd.getpwnam("nobody")
except KeyError:  # pragma: no cover - every Debian/Ubuntu image has it
    NOBODY = None

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or NOBODY is None,
                                reason="needs root, to act as the real second user `nobody`")


def as_nobody(script: str) -> None:
    """Run ``script`` with ``sh`` as the user ``nobody`` (its own uid and gid, umask 022)."""
    assert NOBODY is not None
    subprocess.run(["sh", "-c", f"umask 022; {script}"], user=NOBODY.pw_uid, group=NOBODY.pw_gid, check=True,
                   timeout=30, cwd="/")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user may add to, sticky like ``/tmp`` (root's, mode 1777); removed after."""
    folder = Path(tempfile.mkdtemp(prefix="bagua-shared-", dir="/tmp"))
    os.chmod(folder, 0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def forged_services(redis_port: int, autotune: str, state: Path) -> str:
    """A services file naming the hostile user's listeners (and secret files it made readable)."""
    return json.dumps({"version": 2, "deployment": "f" * 32, "autotune": autotune,
                       "redis": {"hosts": [{"host": "127.0.0.1", "port": redis_port}], "cluster": False},
                       "state_dir": str(state), "secrets": {}, "processes": {}})


def test_a_state_folder_made_by_another_user_is_refused_by_every_client_and_command(
        shared_tmp: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    resp, rpc = RespRecorder(), GrpcRecorder()
    try:
        state = shared_tmp / "bagua-lightning"
        text = forged_services(resp.port, rpc.address, state).replace("'", "")
        as_nobody(f"mkdir -p {state} && printf '%s' '{text}' > {state}/services.json")
        path = state / "services.json"
        assert path.stat().st_uid == NOBODY.pw_uid  # type: ignore[union-attr]
        monkeypatch.setenv("XDG_STATE_HOME", str(shared_tmp))
        monkeypatch.delenv(ENV_FILE, raising=False)
        for name in ("BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_AUTOTUNE_SERVICE",
                     "BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN"):
            monkeypatch.delenv(name, raising=False)

        from bagua_lightning.client.autotune import AutotuneClient
        from bagua_lightning.client.cache.store import RedisStore
        for make in (RedisStore, AutotuneClient):
            with pytest.raises(UntrustedFileError) as excinfo:
                make()
            message = str(excinfo.value)
            # the folder above it is the first thing it could have forged
            assert f"lies in {state}" in message and "nobody (uid 65534)" in message and "0755" in message, message
            assert "\n" not in message

        hostile = {**env, "XDG_STATE_HOME": str(shared_tmp)}
        hostile.pop(ENV_FILE)
        one_line_error(cli(hostile, "status"), 2, str(path), "nobody (uid 65534)", "0755", "XDG_STATE_HOME")
        one_line_error(cli(hostile, "down"), 2, str(state), "nobody (uid 65534)")
        one_line_error(cli(hostile, "up", "--timeout", "20"), 2, f"state folder {state}", "nobody (uid 65534)",
                       "0755", "does not adopt")
        # `up` changed nothing there: still nobody's, still 0755, no secrets written into it
        st = state.stat()
        assert st.st_uid == NOBODY.pw_uid and stat.S_IMODE(st.st_mode) == 0o755  # type: ignore[union-attr]
        assert sorted(p.name for p in state.iterdir()) == ["services.json"]
        # and the listeners the forged file names never heard from anyone
        assert resp.received == b"" and rpc.metadata == []
    finally:
        resp.close()
        rpc.close()


def test_up_does_not_adopt_an_empty_folder_of_another_user(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from bagua_lightning.services import deploy

    state = shared_tmp / "bagua-lightning"
    as_nobody(f"mkdir -m 0700 {state}")
    monkeypatch.setenv("XDG_STATE_HOME", str(shared_tmp))
    monkeypatch.setenv(ENV_FILE, str(shared_tmp / "mine.json"))
    with pytest.raises(UntrustedFileError, match="does not adopt"):
        deploy.up(deploy.UpConfig(timeout_s=20))
    assert stat.S_IMODE(state.stat().st_mode) == 0o700 and state.stat().st_uid == NOBODY.pw_uid  # type: ignore[union-attr]
    assert not (shared_tmp / "mine.json").exists()


def test_a_services_file_of_another_user_named_by_the_variable_is_refused(
        shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = shared_tmp / "services.json"
    text = forged_services(7000, "127.0.0.1:29600", shared_tmp).replace("'", "")
    as_nobody(f"printf '%s' '{text}' > {path} && chmod 0600 {path} && chmod o+r {path}")
    monkeypatch.setenv(ENV_FILE, str(path))
    with pytest.raises(UntrustedFileError, match="nobody"):
        read_services_file()


def _own_services_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **fields: object) -> Path:
    path = tmp_path / "services.json"
    monkeypatch.setenv(ENV_FILE, str(path))
    write_services_file(ServicesInfo(deployment="d" * 32, state_dir=str(tmp_path), **fields))  # type: ignore[arg-type]
    return path


def test_a_services_file_others_can_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _own_services_file(tmp_path, monkeypatch, autotune="127.0.0.1:29600")
    assert read_services_file() is not None  # 0600, ours: trusted
    os.chmod(path, 0o620)
    with pytest.raises(UntrustedFileError) as excinfo:
        read_services_file()
    assert "0620" in str(excinfo.value) and f"chmod go-w {path}" in str(excinfo.value)
    os.chmod(path, 0o644)  # readable by others is fine: it holds no secret
    assert read_services_file() is not None


def test_a_folder_others_can_write_is_refused_unless_sticky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    _own_services_file(folder, monkeypatch)
    os.chmod(folder, 0o777)
    with pytest.raises(UntrustedFileError) as excinfo:
        read_services_file()
    assert f"lies in {folder}" in str(excinfo.value) and "0777" in str(excinfo.value)
    os.chmod(folder, 0o1777)  # sticky: others may add files, not replace ours
    assert read_services_file() is not None


def test_secret_files_others_can_read_or_that_are_not_ours_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = procs.write_private(tmp_path / "secrets" / "redis-password", "pw")
    _own_services_file(tmp_path, monkeypatch, redis_hosts=[{"host": "127.0.0.1", "port": 7000}],
                       secrets={"redis_password": str(secret)})
    monkeypatch.delenv("BAGUA_LIGHTNING_REDIS_PASSWORD", raising=False)
    assert resolve_redis_password(["127.0.0.1:7000"]) == "pw"
    os.chmod(secret, 0o640)
    with pytest.raises(UntrustedFileError) as excinfo:
        resolve_redis_password(["127.0.0.1:7000"])
    assert "0640" in str(excinfo.value) and f"chmod go-rwx {secret}" in str(excinfo.value)
    os.chmod(secret, 0o600)
    os.chown(secret, NOBODY.pw_uid, NOBODY.pw_gid)  # type: ignore[union-attr]
    with pytest.raises(UntrustedFileError, match="nobody"):
        procs.read_secret(secret)


def test_a_recorded_ca_others_can_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    os.chmod(ca, 0o666)
    _own_services_file(tmp_path, monkeypatch, tls=ClientTLS(ca=str(ca)))
    with pytest.raises(UntrustedFileError, match=f"CA certificate {ca}"):
        read_services_file()
    os.chmod(ca, 0o644)
    assert read_services_file() is not None
    check_trusted(tmp_path / "absent", "file")  # a missing file is whoever opens it's to report


def test_secrets_given_as_files_are_read_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # $NAME_FILE: the convention of Docker and Kubernetes secrets, so no value sits in /proc/PID/environ.
    from bagua_lightning.core.services_file import resolve_autotune_token, resolve_cache_key

    for name in ("BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "BAGUA_LIGHTNING_CACHE_KEY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(name + "_FILE", str(procs.write_private(tmp_path / name, f"{name}-value\n")))
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "none.json"))
    assert resolve_redis_password(["10.0.0.1:7000"]) == "BAGUA_LIGHTNING_REDIS_PASSWORD-value"
    assert resolve_autotune_token("10.0.0.1:29600") == "BAGUA_LIGHTNING_AUTOTUNE_TOKEN-value"
    assert resolve_cache_key() == b"BAGUA_LIGHTNING_CACHE_KEY-value"
    os.chmod(tmp_path / "BAGUA_LIGHTNING_REDIS_PASSWORD", 0o644)
    with pytest.raises(UntrustedFileError, match="0644"):
        resolve_redis_password(["10.0.0.1:7000"])
