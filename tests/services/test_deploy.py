"""``bagua-lightning up | down | status`` (services/deploy.py) on real processes in a temporary state folder.

The shared end-to-end bodies live in tests/integration/test_services.py; here: settings validation, the
standalone (``--single``) path, recovery from dead recorded services, and the error paths.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagua_lightning.core import procs as processes
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.pinned_redis import pinned_kwargs, redis_client
from bagua_lightning.core.services_file import ENV_FILE, read_services_file
from bagua_lightning.services import deploy
from tests.integration.conftest import _recorded_pids, free_port_block
from tests.procs import free_port, running, wait_until


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private state folder; whatever `up` recorded there is stopped after the test."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv(ENV_FILE, str(tmp_path / "services.json"))
    for name in ("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", "BAGUA_LIGHTNING_REDIS_HOSTS", "BAGUA_LIGHTNING_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield tmp_path
    finally:
        info = read_services_file()
        deploy.down(timeout_s=5)
        for pid in _recorded_pids(info) if info is not None else []:
            assert not processes.pid_alive(pid), f"pid {pid} outlived down()"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "bagua_lightning.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


# ----------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("1073741824", 1024**3), ("1gb", 1024**3),
                                                ("512MB", 512 * 1024**2), ("64k", 64 * 1024), (7, 7)])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert deploy.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "1 tb b", "-5", "1.5gb", "lots"])
def test_parse_bytes_rejects_with_the_value(text: str) -> None:
    with pytest.raises(ConfigurationError, match=repr(text).replace("[", r"\[")):
        deploy.parse_bytes(text)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"autotune_port": 0}, "autotune_port 0"),
    ({"redis_port": 70000}, "redis_port 70000"),
    ({"nodes": 0}, "nodes=0"),
    ({"replicas": -1}, "replicas=-1"),
    ({"single": True, "nodes": 5}, "--nodes 5"),
    ({"autotune_port": 7001, "redis_port": 7000}, "collides with the Redis ports 7000..7005"),
    ({"maxmemory": -1}, "maxmemory -1"),
    ({"timeout_s": 0}, "timeout_s 0"),
])
def test_up_config_errors_name_the_value(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment.replace(".", r"\.")):
        deploy.UpConfig(**kwargs)  # type: ignore[arg-type]


def test_autotune_args_are_the_cli_the_service_parses() -> None:
    from bagua_lightning.cli import build_parser

    argv = deploy.autotune_service_args(host="127.0.0.1", port=29601, state=deploy.redis_state_url("::1", 7000),
                                        log_dir="/tmp/samples", mirror="/tmp/plans")
    args = build_parser().parse_args(argv)
    assert (args.host, args.port, args.state, args.log_dir) == ("127.0.0.1", 29601, ["redis://[::1]:7000", "/tmp/plans"],
                                                                 "/tmp/samples")


# --------------------------------------------------------------------------------------------- processes


def test_single_redis_up_status_down(state: Path) -> None:
    autotune_port, redis_port = free_port(), free_port()
    cfg = deploy.UpConfig(autotune_port=autotune_port, redis_port=redis_port, single=True, maxmemory=32 * 1024**2)
    info = deploy.up(cfg)
    assert info.autotune == f"127.0.0.1:{autotune_port}"
    assert info.redis_hosts == [{"host": "127.0.0.1", "port": redis_port}] and info.redis_cluster is False
    assert read_services_file() == info
    assert (state / "bagua-lightning" / deploy.AUTOTUNE_LOG).is_file()
    report = deploy.running_services(info)
    assert report["autotune"].healthy and report["redis"].healthy, report

    status = _cli("status", "--json")
    assert status.returncode == 0, status.stderr
    assert {k: v["healthy"] for k, v in json.loads(status.stdout).items()} == {"autotune": True, "lighthouse": True,
                                                                                "redis": True}

    pids = _recorded_pids(info)
    assert deploy.down() == sorted(pids)
    assert not [p for p in pids if processes.pid_alive(p)]
    assert read_services_file() is None


def test_dead_service_is_reported_and_up_restarts_it(state: Path) -> None:
    cfg = deploy.UpConfig(autotune_port=free_port(), redis_port=free_port(), single=True, maxmemory=32 * 1024**2)
    first = deploy.up(cfg)
    old_pid = first.pids["autotune"]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: not processes.pid_alive(old_pid) or _reap(old_pid), 10, "the killed autotune service")

    status = _cli("status")
    assert status.returncode == 1
    assert "autotune: UNHEALTHY" in status.stdout and "redis: healthy" in status.stdout

    second = deploy.up(cfg)  # not all healthy: the dead service is restarted, the live Redis kept
    assert second.pids["autotune"] != old_pid and second.pids["redis"] == first.pids["redis"]
    assert all(h.healthy for h in deploy.running_services(second).values())


def _reap(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return not processes.pid_alive(pid)


def test_taken_port_fails_before_starting_anything(state: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=rf"port {port} on 127\.0\.0\.1 is not free.*--autotune-port"):
            deploy.up(deploy.UpConfig(autotune_port=port, redis_port=free_port_block(6)))
    assert read_services_file() is None
    assert not (state / "bagua-lightning" / "redis").exists() or not any((state / "bagua-lightning" / "redis").iterdir())


def test_down_and_status_without_services(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _cli("down")
    assert result.returncode == 0 and "nothing to stop" in result.stdout
    # Without a services file, `status` checks where trainers would look: here, addresses nobody serves.
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_HOSTS", f"127.0.0.1:{free_port()}")
    result = _cli("status", "--json")
    assert result.returncode == 1 and "bagua-lightning up" in result.stderr
    assert {k: v["healthy"] for k, v in json.loads(result.stdout).items()} == {"autotune": False, "redis": False}


def test_status_without_services_file_finds_running_services(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # E.g. after `docker compose up`: no file, but the services answer where the environment says.
    info = deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port(), single=True,
                                     maxmemory=32 * 1024**2))
    services_file = Path(os.environ[ENV_FILE])
    monkeypatch.setenv(ENV_FILE, str(state / "elsewhere.json"))
    monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_SERVICE", str(info.autotune))
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_HOSTS", f"127.0.0.1:{info.redis_hosts[0]['port']}")
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", Path(info.secrets["redis_password"]).read_text())
    assert info.tls is not None and info.tls.cert and info.tls.key  # as a trainer elsewhere: the TLS files too
    monkeypatch.setenv("BAGUA_LIGHTNING_TLS_CA", info.tls.ca)
    monkeypatch.setenv("BAGUA_LIGHTNING_TLS_CERT", info.tls.cert)
    monkeypatch.setenv("BAGUA_LIGHTNING_TLS_KEY", info.tls.key)
    try:
        result = _cli("status")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "autotune: healthy" in result.stdout and "redis: healthy" in result.stdout
    finally:
        monkeypatch.setenv(ENV_FILE, str(services_file))


def test_up_with_other_settings_while_running_is_refused(state: Path) -> None:
    cfg = deploy.UpConfig(autotune_port=free_port(), redis_port=free_port(), single=True, maxmemory=32 * 1024**2)
    info = deploy.up(cfg)
    assert deploy.up(cfg) == info  # same settings: nothing to do
    other = deploy.UpConfig(autotune_port=free_port(), redis_port=cfg.redis_port, single=True)
    with pytest.raises(ConfigurationError, match=r"already running with other settings \(autotune on .*down"):
        deploy.up(other)
    assert deploy.ensure_up(other) == info  # the demo's way: any healthy services will do
    assert read_services_file() == info


def test_concurrent_ups_start_one_set_of_services(state: Path) -> None:
    autotune_port, redis_port = free_port(), free_port()
    args = ["up", "--single", "--autotune-port", str(autotune_port), "--redis-port", str(redis_port),
            "--maxmemory", "32mb"]
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-m", "bagua_lightning.cli", *args], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    info = read_services_file()
    assert info is not None and all(processes.pid_alive(p) for p in _recorded_pids(info))
    serving = [pid for pid in _pids_with(f"--port\0{autotune_port}\0".encode()) if processes.pid_alive(pid)]
    assert serving == [info.pids["autotune"]], "a second autotune service was started"


def _pids_with(fragment: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if fragment in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


# ----------------------------------------------------------------------------------------------- secrets


def test_up_makes_secrets_hands_them_over_by_file_only(state: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil
    import redis

    from bagua_lightning.core import services_file

    info = deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port(), single=True,
                                     maxmemory=32 * 1024**2))
    assert set(info.secrets) == {"redis_password", "autotune_token", "cache_key"}
    secrets = {name: Path(path).read_text() for name, path in info.secrets.items()}
    assert len(set(secrets.values())) == 3 and all(len(v) >= 32 for v in secrets.values())
    for path in info.secrets.values():
        assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
        assert oct(Path(path).parent.stat().st_mode & 0o777) == "0o700"
    assert not any(v in Path(os.environ[ENV_FILE]).read_text() for v in secrets.values())
    # Never on a command line, never in an environment, never in redis.conf: the autotune service gets the
    # paths of its token's and the password's files.
    for records in info.processes.values():
        for rec in records:
            shown = " ".join([*psutil.Process(rec.pid).cmdline(), *psutil.Process(rec.pid).environ().values()])
            assert not any(v in shown for v in secrets.values()), shown
    conf = next((state / "bagua-lightning" / "redis").rglob("redis.conf")).read_text()
    assert secrets["redis_password"] not in conf
    autotune_env = psutil.Process(info.pids["autotune"]).environ()
    assert services_file.ENV_AUTOTUNE_TOKEN not in autotune_env
    assert autotune_env[services_file.ENV_REDIS_PASSWORD + "_FILE"] == info.secrets["redis_password"]
    # Redis requires the password; trainers on this machine resolve every secret through the services file.
    # It speaks TLS only and wants the deployment's client certificate before the password.
    (node,) = info.redis_hosts
    assert info.tls is not None
    with redis.Redis(host=node["host"], port=node["port"]) as plain, pytest.raises(redis.ConnectionError):
        plain.ping()
    with redis.Redis(host=node["host"], port=node["port"], ssl=True, ssl_ca_certs=info.tls.ca) as certless, \
            pytest.raises(redis.ConnectionError):
        certless.ping()
    with redis_client(node["host"], node["port"], **pinned_kwargs(info.tls)) as anonymous, \
            pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    assert services_file.resolve_redis_password(info.redis_hosts) == secrets["redis_password"]
    assert services_file.resolve_autotune_token(str(info.autotune)) == secrets["autotune_token"]
    assert services_file.resolve_cache_key() == secrets["cache_key"].encode()
    # A server the deployment does not record never gets the recorded password; the environment wins.
    assert services_file.resolve_redis_password([f"127.0.0.1:{free_port()}"]) is None
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", "from-env")
    assert services_file.resolve_redis_password([f"127.0.0.1:{free_port()}"]) == "from-env"

    deploy.down()
    assert not any(Path(p).exists() for p in info.secrets.values())


def test_up_takes_secrets_from_the_environment(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", "given-password")
    info = deploy.up(deploy.UpConfig(autotune_port=free_port(), redis_port=free_port(), single=True,
                                     maxmemory=32 * 1024**2))
    assert Path(info.secrets["redis_password"]).read_text() == "given-password"
    assert deploy.running_services(info)["redis"].healthy


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_status_speaks_tls_to_a_tls_autotune_service(state: Path, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    argv = [sys.executable, "-m", "bagua_lightning.cli", "autotune", "serve", "--port", str(port),
            "--tls-cert", str(cert), "--tls-key", str(key)]
    with running(argv, env=dict(os.environ)):
        address = f"127.0.0.1:{port}"
        wait_until(lambda: _cli("status", "--autotune", address, "--tls-ca", str(cert)).returncode == 0, 60,
                   "the TLS autotune service")
        plain = _cli("status", "--autotune", address)
        assert plain.returncode == 1 and "UNHEALTHY" in plain.stdout
