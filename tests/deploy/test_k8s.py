"""deploy/k8s: every manifest against pinned Kubernetes schemas, the references between them, the probes on
the health split, and the Redis scripts run for real (six local nodes formed into a cluster)."""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis
import yaml
from redis.cluster import RedisCluster

import bagua_lightning
from bagua_lightning.cli import build_parser
from bagua_lightning.services.autotune.readiness import SERVICE_NAME
from tests.procs import free_port, running, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
K8S = ROOT / "deploy" / "k8s"
MAKE_SECRET = K8S / "make-secret.sh"
# The oldest Kubernetes with gRPC probes (GA in 1.27) and a recent one; the schemas come with the pinned
# kubernetes-validate of the [dev] extra, so the check is the same on every machine.
KUBERNETES_VERSIONS = ("1.27.0", "1.34.0")
NAMESPACE = "bagua-lightning"
SECRET = "bagua-lightning-secrets"
SECRET_KEYS = {"redis-password", "autotune-token", "cache-key"}


def _secret_manifest(**env: str) -> dict[str, Any]:
    result = subprocess.run([str(MAKE_SECRET), "--print"], capture_output=True, text=True, timeout=30,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
            if doc]
    return [*docs, ("make-secret.sh --print", _secret_manifest())]


DOCS = _documents()


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for _, doc in DOCS:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_pinned_schemas(version: str) -> None:
    kinds = {doc["kind"] for _, doc in DOCS}
    assert {"Namespace", "ConfigMap", "Secret", "Service", "StatefulSet", "Job", "Deployment",
            "PersistentVolumeClaim", "PodDisruptionBudget"} <= kinds
    for source, doc in DOCS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{source}: {doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes "
                        f"{version}: {exc.message} at {'.'.join(map(str, exc.path))}")
        expected = None if doc["kind"] == "Namespace" else NAMESPACE
        assert doc["metadata"].get("namespace") == expected, source


def test_the_validation_catches_a_misspelt_field() -> None:
    broken = copy.deepcopy(_one("Deployment", "bagua-autotune"))
    probe = broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["grpc"]["servce"] = probe["grpc"].pop("service")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_autotune_probes_follow_the_health_split_and_its_command_parses() -> None:
    pod = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser(container["args"]).parse_args(container["args"])
    assert callable(args.func) and args.host == "0.0.0.0"
    assert container["livenessProbe"]["grpc"] == {"port": args.port}  # "": the process serves
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": SERVICE_NAME}
    assert container["startupProbe"]["grpc"] == {"port": args.port}
    assert args.state.startswith("redis://bagua-redis.") and "@" not in args.state  # no password in the URL
    assert _env(container)["BAGUA_LIGHTNING_REDIS_PASSWORD"] == {
        "secretKeyRef": {"name": SECRET, "key": "redis-password"}}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(Path(args.token_file).parent)] == "secrets"  # the token comes from the Secret
    assert mounts[args.log_dir] == "samples"
    assert container["image"].endswith(f":{bagua_lightning.__version__}")
    service = _one("Service", "bagua-autotune")
    assert {p["port"] for p in service["spec"]["ports"]} == {args.port, args.metrics_port}


def test_references_between_the_manifests_resolve() -> None:
    secret_keys = set(_one("Secret", SECRET)["data"])
    assert secret_keys == SECRET_KEYS
    for name, pod in _pod_specs():
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or (name == "bagua-redis" and mount["name"] == "data"), (name, mount)
            for value in _env(container).values():
                if isinstance(value, dict) and "secretKeyRef" in value:
                    assert value["secretKeyRef"]["name"] == SECRET and value["secretKeyRef"]["key"] in secret_keys
        for volume in volumes.values():
            if "secret" in volume:
                assert volume["secret"]["secretName"] == SECRET
                assert {i["key"] for i in volume["secret"]["items"]} <= secret_keys
            if "configMap" in volume:
                config = _one("ConfigMap", volume["configMap"]["name"])
                assert config["data"], name
            if "persistentVolumeClaim" in volume:
                _one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert pod["securityContext"]["runAsNonRoot"] is True
    for _, doc in DOCS:
        if doc["kind"] == "Service":
            pods = [d for _, d in DOCS if d["kind"] in ("Deployment", "StatefulSet")
                    and doc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
            assert len(pods) == 1, doc["metadata"]["name"]
            named = {p["name"] for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
            assert {p["targetPort"] for p in doc["spec"]["ports"]} <= named


def _node_names(count: int) -> list[str]:
    return [f"bagua-redis-{i}.bagua-redis.{NAMESPACE}.svc.cluster.local:6379" for i in range(count)]


def test_redis_cluster_has_a_replica_per_master_and_announces_no_loopback() -> None:
    statefulset = _one("StatefulSet", "bagua-redis")
    replicas = statefulset["spec"]["replicas"]
    (init,) = _one("Job", "bagua-redis-init")["spec"]["template"]["spec"]["containers"]
    env = _env(init)
    masters = int(env["REDIS_MASTERS"])
    assert masters >= 3 and replicas == 2 * masters  # one replica per master
    assert env["REDIS_NODES"].split() == _node_names(replicas)
    clients = _one("ConfigMap", "bagua-lightning-clients")["data"]
    assert clients["BAGUA_LIGHTNING_REDIS_HOSTS"].split(",") == _node_names(replicas)
    assert clients["BAGUA_LIGHTNING_AUTOTUNE_SERVICE"] == f"bagua-autotune.{NAMESPACE}.svc.cluster.local:29600"
    (node,) = statefulset["spec"]["template"]["spec"]["containers"]
    node_env = _env(node)
    assert node_env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert node_env["ANNOUNCE_HOSTNAME"] == "$(POD_NAME).bagua-redis.$(POD_NAMESPACE).svc.cluster.local"
    assert _one("Service", "bagua-redis")["spec"]["clusterIP"] == "None"
    text = "\n".join(path.read_text() for path in K8S.glob("*.yaml"))
    assert not re.search(r"127\.0\.0\.\d|localhost|::1\b", text)
    config = _one("ConfigMap", "bagua-redis")["data"]
    assert "cluster-preferred-endpoint-type hostname" in config["redis.conf"]
    assert "requirepass" not in config["redis.conf"]  # the password only ever comes from the Secret


# -- the scripts, for real -----------------------------------------------------------------------------------

def _script(name: str, folder: Path) -> Path:
    path = folder / name
    path.write_text(_one("ConfigMap", "bagua-redis")["data"][name])
    return path


def _cluster_ports(count: int) -> list[int]:
    """Free ports whose cluster bus port (+10000) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


def _node_env(folder: Path, port: int, password_file: Path) -> dict[str, str]:
    data = folder / str(port)
    data.mkdir()
    return {**os.environ, "POD_IP": "127.0.0.1", "ANNOUNCE_HOSTNAME": "localhost", "REDIS_PORT": str(port),
            "REDIS_BIND": "127.0.0.1", "REDIS_DATA": str(data), "REDIS_PASSWORD_FILE": str(password_file),
            "REDIS_CONFIG": str(folder / "redis.conf")}


def test_start_node_refuses_an_empty_password(tmp_path: Path) -> None:
    (tmp_path / "redis.conf").write_text(_one("ConfigMap", "bagua-redis")["data"]["redis.conf"])
    empty = tmp_path / "password"
    empty.write_text("")
    result = subprocess.run(["sh", str(_script("start-node.sh", tmp_path))], capture_output=True, text=True,
                            timeout=30, env=_node_env(tmp_path, free_port(), empty))
    assert result.returncode == 1
    assert "the Redis password" in result.stderr and "missing or empty" in result.stderr


@pytest.mark.slow
def test_scripts_form_a_cluster_with_replicas_and_a_password(tmp_path: Path) -> None:
    (tmp_path / "redis.conf").write_text(_one("ConfigMap", "bagua-redis")["data"]["redis.conf"])
    start, form = _script("start-node.sh", tmp_path), _script("form-cluster.sh", tmp_path)
    password = _secret_manifest()["data"]["redis-password"]
    password_file = tmp_path / "password"
    password_file.write_text(base64.b64decode(password).decode())
    secret = password_file.read_text()
    for attempt in range(3):
        ports = _cluster_ports(6)
        stack = contextlib.ExitStack()
        procs = [stack.enter_context(running(["sh", str(start)], env=_node_env(tmp_path, port, password_file),
                                             log_path=str(tmp_path / f"{port}.log")))
                 for port in ports]
        try:
            for port in ports:
                wait_until(lambda port=port: redis.Redis(port=port, password=secret, socket_timeout=1).ping(), 30,
                           f"redis node {port}")
            break
        except TimeoutError:
            stack.close()
            # Another process (a parallel test worker's client) may take a port between the check and the start.
            taken = any("Address already in use" in (tmp_path / f"{p}.log").read_text(errors="replace") for p in ports)
            if not taken or attempt == 2:
                raise
    with stack:
        # The password reached each node on stdin: not on its command line, and required.
        for proc in procs:
            assert secret not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=ports[0], socket_timeout=1).ping()
        env = {**os.environ, "REDIS_NODES": " ".join(f"localhost:{p}" for p in ports), "REDIS_MASTERS": "3",
               "REDIS_INIT_TIMEOUT_S": "60", "REDIS_PASSWORD_FILE": str(password_file)}
        first = subprocess.run(["sh", str(form)], capture_output=True, text=True, timeout=120, env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "3 masters, 1 replica(s) each" in first.stdout
        nodes = redis.Redis(port=ports[0], password=secret, decode_responses=True).cluster("nodes")
        roles = sorted("master" if "master" in info["flags"] else "slave" for info in nodes.values())
        assert roles == ["master"] * 3 + ["slave"] * 3
        # Clients are sent to the announced names; a cluster client works through them.
        shards = redis.Redis(port=ports[0], password=secret).execute_command("CLUSTER", "SHARDS")
        assert b"localhost" in repr(shards).encode()
        cluster = RedisCluster(host="localhost", port=ports[1], password=secret, socket_timeout=2)
        try:
            for i in range(20):
                cluster.set(f"k{i}", i)
            assert [int(cluster.get(f"k{i}")) for i in range(20)] == list(range(20))
        finally:
            cluster.close()
        again = subprocess.run(["sh", str(form)], capture_output=True, text=True, timeout=120, env=env)
        assert again.returncode == 0 and "already serves all 16384 slots with 6 nodes" in again.stdout


def test_make_secret_takes_the_variables_or_makes_random_values() -> None:
    made = _secret_manifest()
    assert made["metadata"] == {"name": SECRET, "namespace": NAMESPACE,
                                "labels": {"app.kubernetes.io/part-of": "bagua-lightning"}}
    values = {key: base64.b64decode(value).decode() for key, value in made["data"].items()}
    assert set(values) == SECRET_KEYS and all(re.fullmatch(r"[0-9a-f]{64}", v) for v in values.values())
    assert len(set(values.values())) == 3
    given = _secret_manifest(BAGUA_LIGHTNING_AUTOTUNE_TOKEN="tok-123")["data"]["autotune-token"]
    assert base64.b64decode(given).decode() == "tok-123"
    bad = subprocess.run([str(MAKE_SECRET), "--print"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "BAGUA_LIGHTNING_CACHE_KEY": "has space"})
    assert bad.returncode == 2 and "BAGUA_LIGHTNING_CACHE_KEY holds characters" in bad.stderr
    assert "data:" not in bad.stdout  # nothing half-made reaches kubectl
