"""docker-compose.yml on a real Docker engine, unmodified, under pytest-docker: up (hardened: no capabilities,
read-only roots where Compose allows them, limits), the Lighthouse, two training jobs, a killed master, a
restarted service, the killed node back from its own files, the whole stack down and up with its cached
samples kept, down without the secrets.

The engine is the one that answers, else a private ``dockerd`` started here (root on Linux; see
docker_engine.py), with stand-in base images when the registry's cannot be pulled; without either the
test skips and says why. The stack is published on a loopback address of its own (127.0.0.X, announced by
the nodes too), so that services of other users on 127.0.0.1's ports 7000-7005 and 29600 do not collide.
Trainers are real 2-rank Lightning jobs on the host (tests/integration/compose_job.py) using the
deployment's secrets and TLS client files. Cost on a loaded 2-core machine with images reused: see
docs/deployment.md.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest_docker.plugin import get_docker_services

from tests.integration.compose import COMPOSE_FILE, ROOT
from tests.integration.docker_engine import NoEngine, base_images, docker_engine
from tests.procs import wait_until
from tests.ranks import run_ranks

JOB = str(Path(__file__).with_name("compose_job.py"))
PORTS = [*range(7000, 7006), *range(17000, 17006), *range(8000, 8006), 29600, 29510]  # TLS, bus, read ports
SECRET_NAMES = ("BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN")
PER_RANK = 128  # compose_job.SAMPLES over 2 ranks
TLS_ENV = "BAGUA_LIGHTNING_TLS_CA"


def client_reads_tls_env() -> bool:
    """Whether the trainer-side clients take their TLS files from BAGUA_LIGHTNING_TLS_CA/_CERT/_KEY."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for folder in {Path(p).parts[0] for p in package_dirs}:
        for path in (ROOT / folder).rglob("*.py"):
            if TLS_ENV in path.read_text(errors="replace"):
                return True
    return False


def _free_on(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _loopback_address() -> str:
    start = 2 + os.getpid() % 200
    for last in [*range(start, 255), *range(2, start)]:
        address = f"127.0.0.{last}"
        if all(_free_on(address, port) for port in PORTS):
            return address
    pytest.skip("no 127.0.0.X address has ports 7000-7005, 17000-17005, 8000-8005 and 29600 free")


class Stack:
    def __init__(self, env: dict[str, str], project: str, address: str, tls_dir: Path, work: Path) -> None:
        self.env, self.project, self.address, self.tls_dir, self.work = env, project, address, tls_dir, work

    def compose(self, *args: str, secrets_too: bool = True, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        env = dict(self.env)
        if not secrets_too:
            for name in SECRET_NAMES:
                env.pop(name, None)
        return subprocess.run(["docker", "compose", "-f", str(COMPOSE_FILE), "-p", self.project, *args], env=env,
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def docker(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout_s,
                              check=False)

    def job_env(self) -> dict[str, str]:
        return {name: self.env[name] for name in SECRET_NAMES} | {
            "BAGUA_LIGHTNING_REDIS_HOSTS": ",".join(f"{self.address}:{p}" for p in (7000, 7001, 7002)),
            "BAGUA_LIGHTNING_REDIS_READ_PORT_OFFSET": "1000",  # open reads on 8000-8005 (docker-compose.yml)
            "BAGUA_LIGHTNING_AUTOTUNE_SERVICE": f"{self.address}:29600",
            "BAGUA_LIGHTNING_TLS_CA": str(self.tls_dir / "ca.crt"),
            "BAGUA_LIGHTNING_TLS_CERT": str(self.tls_dir / "client.crt"),
            "BAGUA_LIGHTNING_TLS_KEY": str(self.tls_dir / "client.key"),
            "XDG_STATE_HOME": str(self.work / "state"),
            "BAGUA_LIGHTNING_SERVICES_FILE": str(self.work / "state" / "no-services.json"),
            "NO_PROXY": "127.0.0.1,localhost," + self.address,
        }

    def redis(self, port: int, **kwargs: Any) -> Any:
        import redis

        return redis.Redis(host=self.address, port=port, password=self.env[SECRET_NAMES[0]], ssl=True,
                           ssl_ca_certs=str(self.tls_dir / "ca.crt"), ssl_certfile=str(self.tls_dir / "client.crt"),
                           ssl_keyfile=str(self.tls_dir / "client.key"), socket_timeout=5, socket_connect_timeout=5,
                           **kwargs)


TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    t0 = time.monotonic()
    try:
        engine = docker_engine()
        env = engine.__enter__()
    except NoEngine as exc:
        pytest.skip(f"no Docker engine can run here: {exc}")
    try:
        try:
            images = base_images(env)
        except NoEngine as exc:
            pytest.skip(str(exc))
        TIMINGS["engine and base images"] = time.monotonic() - t0
        address = _loopback_address()
        work = tmp_path_factory.mktemp("compose")
        tls_dir = work / "tls"
        tls_dir.mkdir()  # made by this user: the client files are handed to it
        project = f"bagua-lightning-compose-{os.getpid()}"
        settings = {"BAGUA_LIGHTNING_BIND_IP": address, "BAGUA_LIGHTNING_ANNOUNCE_IP": address,
                    "BAGUA_LIGHTNING_CLIENT_TLS_DIR": str(tls_dir), "BAGUA_LIGHTNING_REDIS_MAXMEMORY": "64mb",
                    "DOCKER_BUILDKIT": "0", **images,
                    **{name: secrets.token_urlsafe(24) for name in SECRET_NAMES}}
        saved = {name: os.environ.get(name) for name in [*settings, "DOCKER_HOST"]}
        os.environ.update({**settings, **({"DOCKER_HOST": env["DOCKER_HOST"]} if "DOCKER_HOST" in env else {})})
        try:
            t1 = time.monotonic()
            with get_docker_services("docker compose", str(COMPOSE_FILE), project, ["up --build -d --wait"],
                                     ["down -v"]):
                TIMINGS["up --build -d --wait"] = time.monotonic() - t1
                yield Stack(dict(os.environ), project, address, tls_dir, work)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    finally:
        engine.__exit__(None, None, None)
        TIMINGS["total"] = time.monotonic() - t0
        print("\ncompose test timings (s):", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def _run_job(stack: Stack, name: str, dataset: str, **kwargs: Any) -> list[dict[str, Any]]:
    out = stack.work / name
    out.mkdir()
    args = ["--out", str(out), "--dataset", dataset]
    if not client_reads_tls_env():
        args.append("--explicit-tls")
    if kwargs.get("pause_after"):
        args += ["--pause-after", str(kwargs["pause_after"])]
    t = time.monotonic()
    run_ranks(JOB, args, world_size=2, log_dir=out, timeout_s=400, env=stack.job_env())
    TIMINGS[name] = time.monotonic() - t
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _cluster_ok(stack: Stack, port: int) -> bool:
    try:
        with stack.redis(port) as client:
            info = client.execute_command("CLUSTER", "INFO")
    except Exception:
        return False
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text and "cluster_slots_ok:16384" in text


def test_the_stack_comes_up_with_tls_only(stack: Stack) -> None:
    import redis

    running = set(stack.compose("ps", "--services", "--status", "running").stdout.split())
    assert running == {"net", "autotune", "lighthouse", *(f"redis-{i}" for i in range(6))}, running
    # Clients on TLS only: the plain protocol gets nothing, TLS without a client certificate is refused.
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host=stack.address, port=7000, socket_timeout=5, password="x").ping()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host=stack.address, port=7000, ssl=True, ssl_ca_certs=str(stack.tls_dir / "ca.crt"),
                    socket_timeout=5, password=stack.env[SECRET_NAMES[0]]).ping()
    assert _cluster_ok(stack, 7000)
    # The client files belong to this user, keys 0600; the CA key is nowhere.
    for name in ("ca.crt", "client.crt", "client.key"):
        st = (stack.tls_dir / name).stat()
        assert (st.st_uid, oct(st.st_mode & 0o777)) == (os.getuid(), "0o600"), name
    listing = stack.compose("exec", "-T", "autotune", "ls", "/var/lib/bagua-lightning/tls").stdout.split()
    assert "service.key" in listing and not [f for f in listing if f.startswith("ca.key")]
    # No secret in any container's configuration.
    inspected = stack.docker("inspect", *stack.compose("ps", "-aq").stdout.split()).stdout
    assert not any(stack.env[name] in inspected for name in SECRET_NAMES)
    # Hardened as the file says, on the engine: no capability (certs: two), no root but certs, read-only roots
    # where no Compose secret is written, memory limits; protected mode on in every node.
    for container in json.loads(inspected):
        service = container["Config"]["Labels"]["com.docker.compose.service"]
        host = container["HostConfig"]
        caps = {kind: sorted(c.removeprefix("CAP_") for c in host[kind] or []) for kind in ("CapDrop", "CapAdd")}
        assert caps == {"CapDrop": ["ALL"], "CapAdd": ["CHOWN", "DAC_OVERRIDE"] if service == "certs" else []}, service
        assert host["ReadonlyRootfs"] is (service in ("net", "certs", "lighthouse")), service
        assert host["Memory"] > 0 and host["PidsLimit"] > 0, service
        assert container["Config"]["User"] == ("0:0" if service == "certs" else "10001:10001"), service
    with stack.redis(7000) as client:
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}


def test_the_lighthouse_serves_quorums_on_its_published_port(stack: Stack) -> None:
    from datetime import timedelta

    from bagua_lightning.lighthouse import torchft_extension
    from bagua_lightning.services.health import check_lighthouse

    address = f"{stack.address}:29510"
    assert check_lighthouse(address, timeout_s=5.0).healthy
    client = torchft_extension().LighthouseClient(f"http://{address}", timedelta(seconds=10))
    quorum = client.quorum(replica_id="probe0", timeout=timedelta(seconds=20), world_size=1)
    assert [member.replica_id for member in quorum.participants] == ["probe0"]
    logs = stack.compose("logs", "--no-color", "lighthouse", secrets_too=False).stdout
    assert "no credentials and no TLS" in logs  # it says what it exposes, in one line


def test_two_jobs_share_the_cache_survive_a_killed_master_and_a_restarted_service(stack: Stack) -> None:
    dataset = f"compose-{secrets.token_hex(4)}"
    first = _run_job(stack, "job1", dataset)
    for rank in first:
        assert rank["wrong"] == 0 and rank["registered"], rank
        assert (rank["misses"], rank["hits"], rank["writes"], rank["write_errors"]) == (PER_RANK, 0, PER_RANK, 0), rank
    second = _run_job(stack, "job2", dataset)
    for rank in second:
        assert rank["wrong"] == 0 and rank["registered"], rank
        assert (rank["hits"], rank["misses"]) == (PER_RANK, 0), rank

    # A master dies: its replica takes over, and the next job reads every sample from the cache again.
    t = time.monotonic()
    killed = stack.docker("kill", f"{stack.project}-redis-0-1")
    assert killed.returncode == 0, killed.stderr

    def replica_promoted() -> bool:
        # The killed node is flagged failed and every slot is served again: its replica took over.
        try:
            with stack.redis(7001) as client:
                nodes = client.execute_command("CLUSTER", "NODES")
        except Exception:
            return False
        text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
        failed = [line for line in text.splitlines() if ":7000@" in line and "fail" in line.split()[2]]
        return bool(failed) and _cluster_ok(stack, 7001)

    wait_until(replica_promoted, 120, "the replica of the killed master to take over", interval_s=0.5)
    TIMINGS["failover"] = time.monotonic() - t

    # The autotune service restarts while the third job trains: the job goes on to its last step.
    result: dict[str, Any] = {}
    out = stack.work / "job3"

    def third() -> None:
        try:
            result["ranks"] = _run_job(stack, "job3", dataset, pause_after=3)
        except BaseException as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=third)
    thread.start()
    try:
        wait_until(lambda: "error" in result or all((out / f"paused-rank{r}").exists() for r in range(2)), 300,
                   "the third job to reach its pause")
        restarted = stack.compose("restart", "autotune")
        assert restarted.returncode == 0, restarted.stderr
    finally:
        out.mkdir(exist_ok=True)
        (out / "resume").write_text("")
        thread.join(timeout=420)
    if "error" in result:
        raise result["error"]
    for rank in result["ranks"]:
        assert rank["wrong"] == 0 and rank["registered"], rank
        assert rank["steps"] == PER_RANK // 16, rank
        assert (rank["hits"], rank["misses"]) == (PER_RANK, 0), rank

    # The killed node's container starts again, from its own nodes.conf and append-only file in redis-data (a
    # crash under `restart: unless-stopped` or a `compose restart` does the same): it rejoins as the replica
    # of the replica that took over. The operator's next `compose up` checks the cluster; nothing is lost.
    t = time.monotonic()
    started = stack.docker("start", f"{stack.project}-redis-0-1")
    assert started.returncode == 0, started.stderr
    up = stack.compose("up", "-d", "--wait")
    assert up.returncode == 0, up.stdout + up.stderr
    TIMINGS["rejoin"] = time.monotonic() - t
    assert all(_cluster_ok(stack, port) for port in range(7000, 7006))
    with stack.redis(7000) as client:
        assert client.info("replication")["role"] == "slave"
        table = client.execute_command("CLUSTER", "NODES")
    table = table.decode() if isinstance(table, bytes) else str(table)
    assert len(table.strip().splitlines()) == 6 and "fail" not in table and "noaddr" not in table, table
    for rank in _run_job(stack, "job4", dataset):
        assert rank["wrong"] == 0 and (rank["hits"], rank["misses"]) == (PER_RANK, 0), rank

    # The whole stack goes (containers removed, volumes kept: as a reboot leaves it) and comes back: every
    # node from its own files, the same CA; the next job reads every sample from the cache.
    t = time.monotonic()
    down = stack.compose("down")
    assert down.returncode == 0, down.stderr
    up = stack.compose("up", "-d", "--wait")
    assert up.returncode == 0, up.stdout + up.stderr
    TIMINGS["down and up, data kept"] = time.monotonic() - t
    assert all(_cluster_ok(stack, port) for port in range(7000, 7006))
    for rank in _run_job(stack, "job5", dataset):
        assert rank["wrong"] == 0 and (rank["hits"], rank["misses"]) == (PER_RANK, 0), rank


@pytest.mark.skipif(not client_reads_tls_env(), reason="the trainer-side clients do not read "
                    "BAGUA_LIGHTNING_TLS_CA/_CERT/_KEY yet (the jobs here pass the TLS files as arguments)")
def test_trainers_need_only_the_tls_environment_variables() -> None:
    # With client support, _run_job runs the jobs without --explicit-tls: the variables alone carry TLS.
    assert client_reads_tls_env()


def test_ps_logs_and_down_work_without_the_secrets(stack: Stack) -> None:
    ps = stack.compose("ps", "-a", secrets_too=False)
    assert ps.returncode == 0 and "redis-init" in ps.stdout, ps.stderr
    logs = stack.compose("logs", "--no-color", "redis-init", "certs", secrets_too=False)
    assert logs.returncode == 0 and "16384 slots" in logs.stdout, logs.stderr
    assert not any(stack.env[name] in logs.stdout + logs.stderr for name in SECRET_NAMES)
    t = time.monotonic()
    down = stack.compose("down", "-v", secrets_too=False)
    TIMINGS["down -v"] = time.monotonic() - t
    assert down.returncode == 0, down.stderr
    label = f"label=com.docker.compose.project={stack.project}"
    for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
        left = stack.docker(*kind, "-q", "--filter", label)
        assert left.returncode == 0 and left.stdout.split() == [], f"docker {' '.join(kind)}: {left.stdout}"
