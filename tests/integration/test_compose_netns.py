"""docker-compose.yml's commands, run for real without Docker: each service as a local process inside one
private network namespace, exactly as the shared ``network_mode: service:net`` namespace of the file.

What Docker would add is left out: images (the processes run the same binaries from this machine: Debian's
redis-server, this checkout's ``bagua-lightning``), volumes (``/data`` becomes a temporary folder, the
init script's mount target its source file) and the port publishing on the host. Everything else is the
file's: the interpolated commands and environments, the dependency order, one-shot completion, and every
healthcheck command, which must pass. A trainer-side client then uses the cluster at the announced
addresses and the autotune service from inside the namespace.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.compose import ROOT, load_compose
from tests.integration.netns import netns_usable
from tests.procs import running, wait_until

pytestmark = pytest.mark.netns

CLI = [sys.executable, "-m", "bagua_lightning.cli"]  # the image's entrypoint, `bagua-lightning`


@contextlib.contextmanager
def network_namespace() -> Iterator[str]:
    name = f"blcompose{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _order(services: dict[str, dict[str, Any]], active: set[str]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in services[name].get("depends_on", {}):
            if dep in active:
                visit(dep)
        order.append(name)

    for name in sorted(active):
        visit(name)
    return order


def _mounts(svc: dict[str, Any], data_dir: Path, volumes_dir: Path) -> dict[str, str]:
    # Bind mounts become their source; named volumes folders of volumes_dir (shared by the services that
    # mount them, as Docker's are), the image's /data volume a folder of data_dir.
    mounts = {"/data": str(data_dir)}
    for volume in svc.get("volumes", []):
        if volume["type"] == "bind":
            mounts[volume["target"]] = str(ROOT / volume["source"])
        else:
            mounts[volume["target"]] = str(volumes_dir / volume["source"])
    return mounts


def _mapped(arg: str, mounts: dict[str, str]) -> str:
    for target, source in mounts.items():
        if arg == target or arg.startswith(target + "/"):
            return source + arg[len(target):]
    return arg


def _argv(name: str, svc: dict[str, Any], mounts: dict[str, str]) -> list[str]:
    argv = [_mapped(a, mounts) for a in svc.get("entrypoint", []) + svc["command"]]
    return [*CLI, *argv] if "build" in svc else argv  # built image: entrypoint `bagua-lightning`


def _healthcheck_argv(svc: dict[str, Any], mounts: dict[str, str] | None = None) -> list[str]:
    kind, *rest = svc["healthcheck"]["test"]
    if kind == "CMD-SHELL":
        return ["sh", "-c", rest[0]]
    rest = [_mapped(a, mounts or {}) for a in rest]
    return [*CLI, *rest[1:]] if rest[0] == "bagua-lightning" else rest


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BAGUA_LIGHTNING_")}
    env.update({k: str(v) for k, v in (svc.get("environment") or {}).items()})
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        env.pop(proxy, None)
    return env


def _in(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def _healthy(ns: str, svc: dict[str, Any], mounts: dict[str, str] | None = None) -> bool:
    result = subprocess.run(_in(ns, _healthcheck_argv(svc, mounts)), env=_env(svc), capture_output=True, timeout=30)
    return result.returncode == 0


CLIENT = """
import sys
from bagua_lightning.client import AutotuneClient
from bagua_lightning.client.cache.store import RedisStore
store = RedisStore(hosts=[{"host": "127.0.0.1", "port": p} for p in (7000, 7001, 7002)])
assert store.is_cluster
values = {f"netns:{i}": str(i).encode() for i in range(64)}
store.mset(values)
assert store.mget(list(values)) == list(values.values()), "values read back differ"
store.shutdown()
with AutotuneClient(target=sys.argv[1]) as client:
    plan = client.register_tensors("netns", [{"name": "w", "num_elements": 10, "dtype": "f32"}])
    assert plan.tensor_names == [["w"]]
print("client ok")
"""


@pytest.mark.skipif(not netns_usable(), reason="needs root, `ip netns` and redis-server")
@pytest.mark.parametrize(("env", "profiles"), [({"BAGUA_LIGHTNING_REDIS_PASSWORD": "s3cret",
                                                 "BAGUA_LIGHTNING_AUTOTUNE_TOKEN": "t0ken"}, set())],
                         ids=["defaults"])
def test_compose_services_run_and_pass_their_healthchecks(tmp_path: Path, env: dict[str, str],
                                                           profiles: set[str]) -> None:
    services = load_compose(env)["services"]
    active = {n for n, s in services.items() if not s.get("profiles") or set(s["profiles"]) & profiles}
    one_shot = {dep for s in services.values() for dep, how in s.get("depends_on", {}).items()
                if how["condition"] == "service_completed_successfully"}
    with network_namespace() as ns, contextlib.ExitStack() as stack:
        for name in _order(services, active):
            svc = services[name]
            if name == "net":  # the namespace holder: the namespace itself
                assert _healthy(ns, svc)
                continue
            data_dir = tmp_path / name
            data_dir.mkdir()
            mounts = _mounts(svc, data_dir, tmp_path / "volumes")
            argv = _in(ns, _argv(name, svc, mounts))
            if name in one_shot:
                done = subprocess.run(argv, env=_env(svc), cwd=data_dir, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
                assert _healthy(ns, svc, mounts), f"{name}'s healthcheck fails after it completed"
                continue
            proc = stack.enter_context(running(argv, env=_env(svc), cwd=str(data_dir),
                                               log_path=str(tmp_path / f"{name}.log")))
            def up(svc: dict[str, Any] = svc, proc: subprocess.Popen[bytes] = proc) -> bool:
                return proc.poll() is not None or _healthy(ns, svc)  # an exited service fails at once

            wait_until(up, 90, f"service {name} to pass its healthcheck")
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with code {proc.returncode}:\n"
                            + (tmp_path / f"{name}.log").read_text()[-3000:])
        port = services["autotune"]["command"][services["autotune"]["command"].index("--port") + 1]
        client_env = {**_env(services["autotune"]),
                      "BAGUA_LIGHTNING_REDIS_PASSWORD": env.get("BAGUA_LIGHTNING_REDIS_PASSWORD", "")}
        result = subprocess.run(_in(ns, [sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"]), env=client_env,
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 0 and "client ok" in result.stdout, result.stdout + result.stderr
        # Replicas by default: three masters, three replicas.
        nodes = subprocess.run(_in(ns, ["redis-cli", "-p", "7000", "cluster", "nodes"]), capture_output=True,
                               text=True, env={**os.environ, "REDISCLI_AUTH": env["BAGUA_LIGHTNING_REDIS_PASSWORD"]})
        assert nodes.stdout.count("slave") == 3 and nodes.stdout.count("master") == 3, nodes.stdout
