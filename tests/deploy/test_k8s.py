"""deploy/k8s: every manifest against pinned Kubernetes schemas, the references between them, the probes on
the health split, the NetworkPolicies against every port, TLS everywhere, and the scripts run for real: six
local nodes formed into a mutual-TLS cluster with make-secret.sh's certificates, the autotune probe against
a real TLS service."""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kubernetes_validate
import pytest
import redis
import yaml
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

import bagua_lightning
from bagua_lightning.cli import build_parser
from bagua_lightning.core.read_plane import (
    READ_PORT_OFFSET_ENV,
    READER_USER,
    SEALED_KEY_PREFIX,
    reader_acl_line,
)
from bagua_lightning.services.autotune.persistence import RedisPlanStore
from bagua_lightning.services.autotune.readiness import SERVICE_NAME
from tests.procs import free_port, running, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
K8S = ROOT / "deploy" / "k8s"
MAKE_SECRET = K8S / "make-secret.sh"
TRAINER_EXAMPLE = K8S / "examples" / "trainer-job.yaml"
# The oldest Kubernetes with gRPC probes (GA in 1.27) and a recent one; the schemas come with the pinned
# kubernetes-validate of the [dev] extra, so the check is the same on every machine.
KUBERNETES_VERSIONS = ("1.27.0", "1.34.0")
NAMESPACE = "bagua-lightning"
SECRET = "bagua-lightning-secrets"
SECRET_KEYS = {"redis-password", "autotune-token", "cache-key"}
REDIS_NODES = [f"bagua-redis-{i}" for i in range(6)]
TLS_KEYS = {"ca.crt", "tls.crt", "tls.key"}
# The Secrets make-secret.sh makes, and their keys.
SECRETS = {SECRET: SECRET_KEYS, "bagua-lightning-tls": TLS_KEYS, "bagua-autotune-tls": TLS_KEYS,
           "bagua-redis-tls": {"ca.crt", *(f"{n}.{ext}" for n in REDIS_NODES for ext in ("crt", "key"))}}
TRAINER = {"bagua-lightning/role": "trainer"}


def _secret_manifests(**env: str) -> dict[str, dict[str, Any]]:
    result = subprocess.run([str(MAKE_SECRET), "--print"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(result.stdout) if doc}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
            if doc]
    made = [("make-secret.sh --print", doc) for doc in _secret_manifests().values()]
    example = [(TRAINER_EXAMPLE.name, doc) for doc in yaml.safe_load_all(TRAINER_EXAMPLE.read_text()) if doc]
    return [*docs, *made, *example]


DOCS = _documents()


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for _, doc in DOCS:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def _decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_pinned_schemas(version: str) -> None:
    kinds = {doc["kind"] for _, doc in DOCS}
    assert {"Namespace", "ConfigMap", "Secret", "Service", "StatefulSet", "Job", "Deployment",
            "PersistentVolumeClaim", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
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
    probe["exec"]["comand"] = probe["exec"].pop("command")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def _autotune_args(container: dict[str, Any]) -> Any:
    """The service's command line, parsed by the CLI's own parser (an unknown option fails)."""
    return build_parser(container["args"]).parse_args(container["args"])


def test_autotune_speaks_tls_probes_follow_the_health_split_and_its_command_parses() -> None:
    pod = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _autotune_args(container)
    assert callable(args.func) and args.host == "0.0.0.0"
    # kubelet's gRPC probes speak plaintext only: probe.py asks over TLS, "" for liveness, the name for readiness.
    probe = ["python", "/etc/bagua-autotune/probe/probe.py"]
    assert container["livenessProbe"]["exec"]["command"] == probe
    assert container["startupProbe"]["exec"]["command"] == probe
    assert container["readinessProbe"]["exec"]["command"] == [*probe, SERVICE_NAME]
    env = _env(container)
    assert env["AUTOTUNE_PORT"] == str(args.port) and env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["AUTOTUNE_TLS_NAME"] == f"bagua-autotune.{NAMESPACE}.svc.cluster.local"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/bagua-autotune/probe"]]["configMap"]["name"] == "bagua-autotune"
    # TLS on the gRPC port, with the service certificate; the Redis store over TLS with the client certificate.
    assert volumes[mounts[str(args.tls_cert.parent)]]["secret"]["secretName"] == "bagua-autotune-tls"
    assert (args.tls_cert.name, args.tls_key.name) == ("tls.crt", "tls.key") and args.tls_key.parent == args.tls_cert.parent
    state = urlsplit(args.state[0])
    assert state.scheme == "rediss" and state.hostname == f"bagua-redis.{NAMESPACE}.svc.cluster.local"
    assert "@" not in args.state  # no password in the URL
    tls_query = dict(parse_qsl(state.query))
    client_dir = "/etc/bagua-lightning/tls"
    assert tls_query == {"ssl_ca_certs": f"{client_dir}/ca.crt", "ssl_certfile": f"{client_dir}/tls.crt",
                         "ssl_keyfile": f"{client_dir}/tls.key"}
    assert volumes[mounts[client_dir]]["secret"]["secretName"] == "bagua-lightning-tls"
    assert env["BAGUA_LIGHTNING_TLS_CA"] == f"{client_dir}/ca.crt"
    # The token and the plan store's password are files of the Secret volume, never environment variables.
    password_file = Path(env["BAGUA_LIGHTNING_REDIS_PASSWORD_FILE"])
    assert mounts[str(Path(args.token_file).parent)] == mounts[str(password_file.parent)] == "secrets"
    items = {i["key"]: i["path"] for i in volumes["secrets"]["secret"]["items"]}
    assert items == {"autotune-token": Path(args.token_file).name, "redis-password": password_file.name}
    assert volumes["secrets"]["secret"]["secretName"] == SECRET and "BAGUA_LIGHTNING_REDIS_PASSWORD" not in env
    assert mounts[args.log_dir] == "samples"
    assert container["image"].endswith(f":{bagua_lightning.__version__}")
    # The Service carries gRPC only; the metrics (no authentication) listen on the pod's loopback, unexposed.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port} and args.metrics_host == "127.0.0.1" and args.metrics_port == 9464
    assert [p["port"] for p in _one("Service", "bagua-autotune")["spec"]["ports"]] == [args.port]
    assert not [d for _, d in DOCS if d["kind"] == "Service" and d["metadata"]["name"] == "bagua-autotune-metrics"]


def test_references_between_the_manifests_resolve() -> None:
    made = {name: set(doc["data"]) for name, doc in _secret_manifests().items()}
    assert made == SECRETS
    for name, pod in _pod_specs():
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or (name == "bagua-redis" and mount["name"] == "data"), (name, mount)
            for value in _env(container).values():
                if isinstance(value, dict) and "secretKeyRef" in value:
                    assert value["secretKeyRef"]["name"] == SECRET and value["secretKeyRef"]["key"] in SECRET_KEYS
            for source in container.get("envFrom", []):
                _one("ConfigMap", source["configMapRef"]["name"])
        for volume in volumes.values():
            if "secret" in volume:
                keys = SECRETS[volume["secret"]["secretName"]]
                assert {i["key"] for i in volume["secret"].get("items", [])} <= keys
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


def test_every_pod_runs_without_a_service_account_token_and_with_cpu_and_memory_bounds() -> None:
    pods = list(_pod_specs())
    assert {name for name, _ in pods} >= {"bagua-redis", "bagua-redis-init", "bagua-autotune", "bagua-trainer-example"}
    for name, pod in pods:
        assert pod.get("automountServiceAccountToken") is False, name
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), (name, container["name"], kind)


# -- NetworkPolicy ------------------------------------------------------------------------------------------

def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions would need more than this check
    return selector.get("matchLabels", {}).items() <= labels.items()


def _admitted(labels: dict[str, str], port: int) -> list[dict[str, Any]]:
    """The `from` peers of every NetworkPolicy rule that admits traffic to ``port`` of a pod with ``labels``;
    an entry {} for a rule without `from` (everyone)."""
    peers: list[dict[str, Any]] = []
    for _, doc in DOCS:
        if doc["kind"] != "NetworkPolicy" or not _selects(doc["spec"]["podSelector"], labels):
            continue
        if "Ingress" not in doc["spec"]["policyTypes"]:
            continue  # an egress policy
        for rule in doc["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is None or any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
                peers += rule.get("from", [{}])
    return peers


def _pod_labels(kind: str, name: str) -> dict[str, str]:
    return _one(kind, name)["spec"]["template"]["metadata"]["labels"]


def test_network_policies_deny_by_default_and_admit_only_the_expected_pods_to_every_port() -> None:
    (deny,) = [d for _, d in DOCS if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"] == {}]
    assert deny["spec"]["policyTypes"] == ["Ingress"] and not deny["spec"].get("ingress")
    trainer = {"podSelector": {"matchLabels": TRAINER}}
    autotune, redis_pods, init = ({"podSelector": {"matchLabels": _pod_labels(kind, name) | {}}} for kind, name in (
        ("Deployment", "bagua-autotune"), ("StatefulSet", "bagua-redis"), ("Job", "bagua-redis-init")))
    for peer in (autotune, redis_pods, init):  # the policies select by name only
        peer["podSelector"]["matchLabels"].pop("app.kubernetes.io/part-of")
    expected = {
        ("StatefulSet", "bagua-redis", 6379): [trainer, autotune, init, redis_pods],  # clients and replication
        ("StatefulSet", "bagua-redis", 16379): [redis_pods],  # the cluster bus
        ("StatefulSet", "bagua-redis", 7379): [trainer],  # the read port: open reads by trainers alone
        ("Deployment", "bagua-autotune", 29600): [trainer],
    }
    workloads = [(d["kind"], d["metadata"]["name"]) for _, d in DOCS if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    seen = set()
    for kind, name in workloads:
        labels = _pod_labels(kind, name)
        if labels.get("bagua-lightning/role") == "trainer":
            # The ranks of a job talk to each other (torch.distributed) on ports of their choosing.
            assert _admitted(labels, 29500) == [trainer] and _admitted(labels, 12345) == [trainer]
            continue
        for container in _one(kind, name)["spec"]["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                seen.add((kind, name, port["containerPort"]))
                assert _admitted(labels, port["containerPort"]) == expected[(kind, name, port["containerPort"])]
        assert _admitted(labels, 1) == [], (kind, name)  # any other port: nobody
        assert _admitted(labels, 9464) == [], (kind, name)  # the autotune metrics: the pod's loopback only
    assert seen == set(expected)
    # A trainer reaches the services; the example trainer carries the label the policies name.
    assert TRAINER.items() <= yaml.safe_load(TRAINER_EXAMPLE.read_text())["spec"]["template"]["metadata"]["labels"].items()


def _reached(labels: dict[str, str], port: int, protocol: str = "TCP") -> list[dict[str, Any]] | None:
    """The `to` peers a pod with ``labels`` may reach on ``port``; None when no egress policy selects it
    (then its egress is not restricted)."""
    peers: list[dict[str, Any]] = []
    selected = False
    for _, doc in DOCS:
        if doc["kind"] != "NetworkPolicy" or not _selects(doc["spec"]["podSelector"], labels) \
                or "Egress" not in doc["spec"]["policyTypes"]:
            continue
        selected = True
        for rule in doc["spec"].get("egress", []):
            ports = rule.get("ports")
            if ports is None or any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports):
                peers += rule.get("to", [{}])
    return peers if selected else None


def test_egress_policies_let_each_service_reach_only_what_it_uses() -> None:
    redis_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "bagua-redis"}}}
    dns = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    expected = {("StatefulSet", "bagua-redis"): {6379: [redis_pods], 16379: [redis_pods]},
                ("Deployment", "bagua-autotune"): {6379: [redis_pods]},
                ("Job", "bagua-redis-init"): {6379: [redis_pods]}}
    for (kind, name), ports in expected.items():
        labels = _pod_labels(kind, name)
        for port, peers in ports.items():
            assert _reached(labels, port) == peers, (kind, name, port)
        assert _reached(labels, 53, "UDP") == [dns] and _reached(labels, 53, "TCP") == [dns], (kind, name)
        for other in (443, 7379, 29600, 80):  # the internet, the read port, anything else: nothing
            if other not in ports:
                assert _reached(labels, other) == [], (kind, name, other)
    # Trainers' egress is the operator's (their data may be anywhere): no policy restricts it.
    assert _reached(TRAINER, 443) is None


def test_tls_is_on_for_redis_clients_replication_bus_and_the_trainers() -> None:
    config = _one("ConfigMap", "bagua-redis")["data"]
    conf = config["redis.conf"].splitlines()
    for line in ("port 0", "tls-cluster yes", "tls-replication yes", "tls-auth-clients yes"):
        assert line in conf
    assert "tls-port $port" in config["start-node.sh"] and 'tls-cert-file "$REDIS_TLS_CERT"' in config["start-node.sh"]
    for script in ("start-node.sh", "ping-node.sh", "form-cluster.sh"):
        assert '. "$(dirname "$0")/tls.sh"' in config[script], script
    assert "redis-cli --askpass $TLS_ARGS --cluster create" in config["form-cluster.sh"]
    (node,) = _one("StatefulSet", "bagua-redis")["spec"]["template"]["spec"]["containers"]
    assert _env(node)["REDIS_TLS_CERT"] == "/etc/bagua-redis/tls/$(POD_NAME).crt"
    for probe in ("readinessProbe", "livenessProbe"):
        assert node[probe]["exec"]["command"] == ["sh", "/etc/bagua-redis/ping-node.sh"]
    (init,) = _one("Job", "bagua-redis-init")["spec"]["template"]["spec"]["containers"]
    assert _env(init)["REDIS_TLS_CERT"] == "/etc/bagua-lightning/tls/tls.crt"  # the client certificate
    clients = _one("ConfigMap", "bagua-lightning-clients")["data"]
    assert {k: v for k, v in clients.items() if k.startswith("BAGUA_LIGHTNING_TLS_")} == {
        "BAGUA_LIGHTNING_TLS_CA": "/etc/bagua-lightning/tls/ca.crt",
        "BAGUA_LIGHTNING_TLS_CERT": "/etc/bagua-lightning/tls/tls.crt",
        "BAGUA_LIGHTNING_TLS_KEY": "/etc/bagua-lightning/tls/tls.key"}
    volumes = {v["name"]: v for v in _one("Job", "bagua-trainer-example")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "bagua-lightning-tls"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt install shellcheck)")
def test_configmap_scripts_are_shellcheck_clean(tmp_path: Path) -> None:
    scripts = {n: text for n, text in _one("ConfigMap", "bagua-redis")["data"].items() if n.endswith(".sh")}
    assert set(scripts) == {"tls.sh", "start-node.sh", "ping-node.sh", "form-cluster.sh"}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
    for name in scripts:  # -x: follow the sourced tls.sh, as the scripts run it
        result = subprocess.run(["shellcheck", "--shell=sh", "-x", name], capture_output=True, text=True,
                                timeout=60, cwd=tmp_path)
        assert result.returncode == 0, result.stdout


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
    # The one loopback address: where the autotune metrics (no authentication) listen, inside the pod.
    metrics_host = "- --metrics-host  # the pod's loopback only: the endpoint has no authentication\n            - 127.0.0.1\n"
    assert text.count(metrics_host) == 1
    text = text.replace(metrics_host, "")
    assert not re.search(r"127\.0\.0\.\d|localhost|::1\b", text)
    config = _one("ConfigMap", "bagua-redis")["data"]
    assert "cluster-preferred-endpoint-type hostname" in config["redis.conf"]
    assert "requirepass" not in config["redis.conf"]  # the password only ever comes from the Secret


# -- the scripts, for real -----------------------------------------------------------------------------------

def _scripts(folder: Path) -> dict[str, Path]:
    """The ConfigMap's redis.conf and scripts, written side by side to ``folder`` (as the pods mount them)."""
    out = {}
    for name, text in _one("ConfigMap", "bagua-redis")["data"].items():
        out[name] = folder / name
        out[name].write_text(text)
    return out


def _secret_files(folder: Path, **env: str) -> dict[str, dict[str, Path]]:
    """make-secret.sh --print's Secrets as 0600 files, ``folder/<secret>/<key>``, as the pods mount them."""
    files: dict[str, dict[str, Path]] = {}
    for name, doc in _secret_manifests(**env).items():
        (folder / name).mkdir(mode=0o700, parents=True)
        files[name] = {}
        for key, value in _decoded(doc).items():
            path = folder / name / key
            path.touch(mode=0o600)
            path.write_bytes(value)
            files[name][key] = path
    return files


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


def _node_env(folder: Path, port: int, password_file: Path, tls: dict[str, Path], node: str,
              read_port: int | None = None) -> dict[str, str]:
    data = folder / str(port)
    data.mkdir(exist_ok=True)
    return {**os.environ, "POD_IP": "127.0.0.1", "ANNOUNCE_HOSTNAME": "localhost", "REDIS_PORT": str(port),
            "REDIS_READ_PORT": str(read_port or ""),
            "REDIS_BIND": "127.0.0.1", "REDIS_DATA": str(data), "REDIS_PASSWORD_FILE": str(password_file),
            "REDIS_CONFIG": str(folder / "redis.conf"), "REDIS_TLS_CA": str(tls["ca.crt"]),
            "REDIS_TLS_CERT": str(tls[f"{node}.crt"]), "REDIS_TLS_KEY": str(tls[f"{node}.key"])}


def _tls_options(files: dict[str, Path]) -> dict[str, Any]:
    """redis-py's options for a client with the CA and the certificate of ``files`` (a mounted TLS Secret)."""
    return {"ssl": True, "ssl_ca_certs": str(files["ca.crt"]), "ssl_certfile": str(files["tls.crt"]),
            "ssl_keyfile": str(files["tls.key"])}


def test_start_node_refuses_a_missing_certificate_and_an_empty_password(tmp_path: Path) -> None:
    start = _scripts(tmp_path)["start-node.sh"]
    files = _secret_files(tmp_path / "secrets")
    empty = tmp_path / "password"
    empty.write_text("")
    env = _node_env(tmp_path, free_port(), empty, files["bagua-redis-tls"], "bagua-redis-0")
    result = subprocess.run(["sh", str(start)], capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 1
    assert "the Redis password" in result.stderr and "missing or empty" in result.stderr
    env["REDIS_TLS_KEY"] = str(tmp_path / "absent.key")
    result = subprocess.run(["sh", str(start)], capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 1
    assert "REDIS_TLS_KEY" in result.stderr and "absent.key" in result.stderr and "make-secret.sh" in result.stderr


@pytest.mark.slow
def test_scripts_form_a_mutual_tls_cluster_that_refuses_clients_without_the_client_certificate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scripts = _scripts(tmp_path)
    # The nodes run here under the name localhost: put it in their certificates (as for outside trainers).
    files = _secret_files(tmp_path / "secrets", BAGUA_LIGHTNING_TLS_EXTRA_NAMES="localhost,127.0.0.1")
    nodes_tls, client_tls = files["bagua-redis-tls"], _tls_options(files["bagua-lightning-tls"])
    password_file = files[SECRET]["redis-password"]
    secret = password_file.read_text()

    def node_client(port: int, **options: Any) -> redis.Redis:
        return redis.Redis(host="localhost", port=port, socket_timeout=2, socket_connect_timeout=2, **options)

    def answers(port: int) -> bool:
        return bool(node_client(port, password=secret, **client_tls).ping())

    for attempt in range(3):
        ports = _cluster_ports(6)
        read_ports = [free_port() for _ in ports]
        envs = [_node_env(tmp_path, port, password_file, nodes_tls, f"bagua-redis-{i}", read)
                for i, (port, read) in enumerate(zip(ports, read_ports, strict=True))]
        stack = contextlib.ExitStack()
        procs = [stack.enter_context(running(["sh", str(scripts["start-node.sh"])], env=env,
                                             log_path=str(tmp_path / f"{port}.log")))
                 for port, env in zip(ports, envs, strict=True)]
        try:
            for port in ports:
                wait_until(functools.partial(answers, port), 30, f"redis node {port}")
            break
        except TimeoutError:
            stack.close()
            # Another process (a parallel test worker's client) may take a port between the check and the start.
            taken = any("Address already in use" in (tmp_path / f"{p}.log").read_text(errors="replace") for p in ports)
            taken = taken or len(set(ports + read_ports)) < 2 * len(ports)
            if not taken or attempt == 2:
                raise
    with stack:
        # The password reached each node on stdin: not on its command line, and required.
        for proc in procs:
            assert secret not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        with pytest.raises(redis.AuthenticationError):
            node_client(ports[0], **client_tls).ping()
        # No plaintext port, and no TLS session without a client certificate of the deployment: refused
        # before any AUTH (the service's certificate, serverAuth only, does not pass for a client's).
        with pytest.raises(redis.ConnectionError):
            node_client(ports[0], password=secret).ping()
        with pytest.raises(redis.ConnectionError):
            node_client(ports[0], password=secret, ssl=True, ssl_ca_certs=client_tls["ssl_ca_certs"]).ping()
        with pytest.raises(redis.ConnectionError):
            node_client(ports[0], password=secret, **_tls_options(files["bagua-autotune-tls"])).ping()
        # The probe: a node answers its own certificate (and its read port the reader).
        probe = subprocess.run(["sh", str(scripts["ping-node.sh"])], capture_output=True, text=True, timeout=30,
                               env=envs[0])
        assert probe.returncode == 0, probe.stderr
        wrong_read = subprocess.run(["sh", str(scripts["ping-node.sh"])], capture_output=True, text=True, timeout=30,
                                    env={**envs[0], "REDIS_READ_PORT": str(ports[1])})  # a TLS port: no reader
        assert wrong_read.returncode != 0
        env = {**os.environ, "REDIS_NODES": " ".join(f"localhost:{p}" for p in ports), "REDIS_MASTERS": "3",
               "REDIS_INIT_TIMEOUT_S": "60", "REDIS_PASSWORD_FILE": str(password_file),
               "REDIS_TLS_CA": client_tls["ssl_ca_certs"], "REDIS_TLS_CERT": client_tls["ssl_certfile"],
               "REDIS_TLS_KEY": client_tls["ssl_keyfile"]}
        first = subprocess.run(["sh", str(scripts["form-cluster.sh"])], capture_output=True, text=True, timeout=120,
                               env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "3 masters, 1 replica(s) each" in first.stdout
        nodes = node_client(ports[0], password=secret, decode_responses=True, **client_tls).cluster("nodes")
        roles = sorted("master" if "master" in info["flags"] else "slave" for info in nodes.values())
        assert roles == ["master"] * 3 + ["slave"] * 3  # replication runs over TLS, with node certificates
        # Clients are sent to the announced names (and the TLS ports); a cluster client with the client
        # certificate works through them, checking each node's certificate against its name.
        shards = node_client(ports[0], password=secret, **client_tls).execute_command("CLUSTER", "SHARDS")
        assert b"localhost" in repr(shards).encode() and f"{ports[3]}".encode() in repr(shards).encode()
        cluster = RedisCluster(host="localhost", port=ports[1], password=secret, socket_timeout=2, **client_tls)
        try:
            for i in range(20):
                cluster.set(f"k{i}", i)
            assert [cluster.get(f"k{i}") for i in range(20)] == [str(i).encode() for i in range(20)]
            known = cluster.get_nodes()  # the masters at least (replicas once CLUSTER SLOTS lists them)
            assert len(known) >= 3 and {node.port for node in known} <= set(ports)
        finally:
            cluster.close()
        with pytest.raises((redis.ConnectionError, RedisClusterException)):
            RedisCluster(host="localhost", port=ports[1], password=secret, socket_timeout=2, ssl=True,
                         ssl_ca_certs=client_tls["ssl_ca_certs"]).get("k0")
        # The autotune service's plan store, with the manifest's --state URL (mounted paths mapped to here).
        (container,) = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]["containers"]
        url = _autotune_args(container).state[0].replace(
            f"bagua-redis.{NAMESPACE}.svc.cluster.local:6379", f"localhost:{ports[2]}").replace(
            "/etc/bagua-lightning/tls/", f"{files['bagua-lightning-tls']['ca.crt'].parent}/")
        monkeypatch.setenv("BAGUA_LIGHTNING_REDIS_PASSWORD", secret)
        store = RedisPlanStore(url, timeout_s=5.0)
        try:
            store.ping()
            assert store.cluster is True and store.load("no-such-plan") is None
        finally:
            store.close()
        again = subprocess.run(["sh", str(scripts["form-cluster.sh"])], capture_output=True, text=True, timeout=120,
                               env=env)
        assert again.returncode == 0 and "already serves all 16384 slots with 6 nodes" in again.stdout
        _check_read_ports(ports, read_ports, secret, client_tls)


def _check_read_ports(ports: list[int], read_ports: list[int], secret: str, client_tls: dict[str, Any]) -> None:
    """Every node's read port: the reader GETs what its master serves (a replica sends it on with MOVED, to the
    master's read port), nothing else; the default user needs the password there."""
    for port, read_port in zip(ports, read_ports, strict=True):
        admin = redis.Redis(host="localhost", port=port, password=secret, socket_timeout=5, **client_tls)
        reader = redis.Redis(host="localhost", port=read_port, username=READER_USER, password="", socket_timeout=5)
        try:
            assert reader.ping()
            if admin.info("replication")["role"] == "master":
                key = next(f"{SEALED_KEY_PREFIX}bagua-cache:{i}" for i in range(10000)
                           if admin.execute_command("CLUSTER", "KEYSLOT", f"{SEALED_KEY_PREFIX}bagua-cache:{i}")
                           in _served_slots(admin, port))
                admin.set(key, b"sealed")
                assert reader.get(key) == b"sealed"
                admin.set(key[len(SEALED_KEY_PREFIX):], b"clear")  # a value in clear: not the reader's
            else:
                with pytest.raises(redis.exceptions.MovedError) as moved:
                    reader.get(f"{SEALED_KEY_PREFIX}bagua-cache:0")
                assert moved.value.port in read_ports
            for command in (("SET", f"{SEALED_KEY_PREFIX}bagua-cache:0", "x"), ("GET", "bagua-cache:0"),
                            ("GET", "bagua_lightning:autotune:plan:x"), ("KEYS", "*"), ("CONFIG", "GET", "*"),
                            ("FLUSHALL",)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    reader.execute_command(*command)
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(host="localhost", port=read_port, password="not-it", socket_timeout=5).ping()
        finally:
            admin.close()
            reader.close()


def _served_slots(client: redis.Redis, port: int) -> set[int]:
    return {slot for lo, hi, owner, *_ in client.execute_command("CLUSTER", "SLOTS") if int(owner[1]) == port
            for slot in range(int(lo), int(hi) + 1)}


def test_the_read_port_is_the_same_everywhere_and_the_reader_is_read_plane_s() -> None:
    config = _one("ConfigMap", "bagua-redis")["data"]
    assert reader_acl_line() in config["reader.conf"].splitlines()
    assert 'include $(dirname "$0")/reader.conf' in config["start-node.sh"]
    (node,) = _one("StatefulSet", "bagua-redis")["spec"]["template"]["spec"]["containers"]
    env = _env(node)
    read_port = int(env["REDIS_READ_PORT"])
    assert {p["name"]: p["containerPort"] for p in node["ports"]}["read"] == read_port
    service = {p["name"]: p for p in _one("Service", "bagua-redis")["spec"]["ports"]}
    assert service["read"]["port"] == read_port and service["read"]["targetPort"] == "read"
    clients = _one("ConfigMap", "bagua-lightning-clients")["data"]
    assert int(env["REDIS_PORT"]) + int(clients[READ_PORT_OFFSET_ENV]) == read_port
    # The trainers take it through the clients' ConfigMap.
    (trainer,) = _one("Job", "bagua-trainer-example")["spec"]["template"]["spec"]["containers"]
    assert {"configMapRef": {"name": "bagua-lightning-clients"}} in trainer["envFrom"]


def test_start_node_refuses_a_bad_read_port(tmp_path: Path) -> None:
    start = _scripts(tmp_path)["start-node.sh"]
    files = _secret_files(tmp_path / "secrets")
    port = free_port()
    for bad in ("abc", "0", "70000", str(port), str(port + 10000)):
        env = _node_env(tmp_path, port, files[SECRET]["redis-password"], files["bagua-redis-tls"], "bagua-redis-0",
                        None) | {"REDIS_READ_PORT": bad}
        result = subprocess.run(["sh", str(start)], capture_output=True, text=True, timeout=30, env=env)
        assert result.returncode == 1 and f"REDIS_READ_PORT ('{bad}')" in result.stderr, result.stderr


@pytest.mark.slow
def test_autotune_probe_checks_health_over_tls_against_the_deployment_ca(tmp_path: Path) -> None:
    files = _secret_files(tmp_path / "secrets")
    server = files["bagua-autotune-tls"]
    probe = tmp_path / "probe.py"
    probe.write_text(_one("ConfigMap", "bagua-autotune")["data"]["probe.py"])
    (container,) = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]["containers"]
    port = free_port()
    env = {**os.environ, "POD_IP": "127.0.0.1", "AUTOTUNE_PORT": str(port),
           "AUTOTUNE_TLS_NAME": _env(container)["AUTOTUNE_TLS_NAME"], "BAGUA_LIGHTNING_TLS_CA": str(server["ca.crt"])}

    def run_probe(*args: str, **changes: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(probe), *args], capture_output=True, text=True, timeout=60,
                              env={**env, **changes})

    serve = [sys.executable, "-m", "bagua_lightning.cli", "autotune", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--tls-cert", str(server["tls.crt"]), "--tls-key", str(server["tls.key"]),
             "--tuning-processes", "0"]
    with running(serve, env=dict(os.environ), log_path=str(tmp_path / "service.log")) as proc:
        wait_until(lambda: proc.poll() is None and run_probe().returncode == 0, 60, "the autotune service's probe",
                   interval_s=0.5)
        ready = run_probe(SERVICE_NAME)
        assert ready.returncode == 0, ready.stderr
        unknown = run_probe("no.such.Service")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
        # Another deployment's CA, or a name the certificate does not carry: no session.
        other = _secret_files(tmp_path / "other")["bagua-lightning-tls"]["ca.crt"]
        for changes in ({"BAGUA_LIGHTNING_TLS_CA": str(other)},
                        {"AUTOTUNE_TLS_NAME": f"bagua-redis.{NAMESPACE}.svc.cluster.local"}):
            refused = run_probe(**changes)
            assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, changes


# -- make-secret.sh ---------------------------------------------------------------------------------------------

def test_make_secret_takes_the_variables_or_makes_random_values() -> None:
    made = _secret_manifests()[SECRET]
    assert made["metadata"] == {"name": SECRET, "namespace": NAMESPACE,
                                "labels": {"app.kubernetes.io/part-of": "bagua-lightning"}}
    values = {key: value.decode() for key, value in _decoded(made).items()}
    assert set(values) == SECRET_KEYS and all(re.fullmatch(r"[0-9a-f]{64}", v) for v in values.values())
    assert len(set(values.values())) == 3
    given = _secret_manifests(BAGUA_LIGHTNING_AUTOTUNE_TOKEN="tok-123")[SECRET]["data"]["autotune-token"]
    assert base64.b64decode(given).decode() == "tok-123"
    for variable, value in (("BAGUA_LIGHTNING_CACHE_KEY", "has space"), ("BAGUA_LIGHTNING_REDIS_NODES", "six"),
                            ("BAGUA_LIGHTNING_NAMESPACE", "Not_A_Name"), ("BAGUA_LIGHTNING_TLS_DAYS", "99999999999")):
        bad = subprocess.run([str(MAKE_SECRET), "--print"], capture_output=True, text=True, timeout=30,
                             env={**os.environ, variable: value})
        assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
        assert variable in bad.stderr or "openssl req failed" in bad.stderr
        assert "data:" not in bad.stdout  # nothing half-made reaches kubectl


def _openssl(*args: str) -> str:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_secret_certificates_chain_to_one_ca_whose_key_is_gone(tmp_path: Path) -> None:
    files = _secret_files(tmp_path)
    ca = files["bagua-redis-tls"]["ca.crt"]
    assert files["bagua-autotune-tls"]["ca.crt"].read_bytes() == files["bagua-lightning-tls"]["ca.crt"].read_bytes() \
        == ca.read_bytes()
    assert "CA:TRUE" in _openssl("x509", "-in", str(ca), "-noout", "-ext", "basicConstraints")
    ca_public = _openssl("x509", "-in", str(ca), "-noout", "-pubkey")
    (container,) = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]["containers"]
    service_name = _env(container)["AUTOTUNE_TLS_NAME"]
    pairs = {f"bagua-redis-{i}": (files["bagua-redis-tls"][f"bagua-redis-{i}.crt"],
                                  files["bagua-redis-tls"][f"bagua-redis-{i}.key"]) for i in range(6)}
    pairs["service"] = (files["bagua-autotune-tls"]["tls.crt"], files["bagua-autotune-tls"]["tls.key"])
    pairs["client"] = (files["bagua-lightning-tls"]["tls.crt"], files["bagua-lightning-tls"]["tls.key"])
    for name, (cert, key) in pairs.items():
        assert _openssl("verify", "-CAfile", str(ca), str(cert)).strip().endswith("OK")
        public = _openssl("pkey", "-in", str(key), "-pubout")
        assert public == _openssl("x509", "-in", str(cert), "-noout", "-pubkey") != ca_public  # no CA key anywhere
        extensions = _openssl("x509", "-in", str(cert), "-noout", "-ext", "subjectAltName,extendedKeyUsage")
        if name.startswith("bagua-redis-"):
            assert "TLS Web Server Authentication, TLS Web Client Authentication" in extensions
            assert f"DNS:{name}.bagua-redis.{NAMESPACE}.svc.cluster.local" in extensions  # what it announces
            assert f"DNS:bagua-redis.{NAMESPACE}.svc.cluster.local" in extensions  # the --state URL's host
        elif name == "service":
            assert "TLS Web Server Authentication" in extensions and "Client" not in extensions
            assert f"DNS:{service_name}" in extensions
        else:
            assert "TLS Web Client Authentication" in extensions and "Server" not in extensions
            assert "Alternative Name" not in extensions
    # Every run makes a new CA.
    assert _secret_manifests()["bagua-redis-tls"]["data"]["ca.crt"] != base64.b64encode(ca.read_bytes()).decode()


_KUBECTL = """#!/bin/sh
# kubectl --namespace NS get secret NAME: exists when $CLUSTER/NAME does; kubectl apply -f -: record stdin.
if [ "$3 $4" = "get secret" ]; then [ -e "$CLUSTER/$5" ]; exit; fi
if [ "$1 $2 $3" = "apply -f -" ]; then cat >> "$CLUSTER/applied.yaml"; exit 0; fi
echo "unexpected kubectl $*" >&2; exit 3
"""


def test_make_secret_creates_what_is_missing_and_replaces_tls_only_when_asked(tmp_path: Path) -> None:
    """Run with a stand-in for kubectl (no Kubernetes here) that knows which Secrets exist."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "kubectl").write_text(_KUBECTL)
    (tmp_path / "bin" / "kubectl").chmod(0o755)
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "CLUSTER": str(cluster)}

    def make(*args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        applied = cluster / "applied.yaml"
        applied.unlink(missing_ok=True)
        result = subprocess.run([str(MAKE_SECRET), *args], capture_output=True, text=True, timeout=60, env=env)
        docs = yaml.safe_load_all(applied.read_text()) if applied.exists() else []
        return result, [doc["metadata"]["name"] for doc in docs if doc]

    result, applied = make()
    assert result.returncode == 0, result.stderr
    assert sorted(applied) == sorted(SECRETS)
    for name in SECRETS:
        (cluster / name).touch()
    result, applied = make()
    assert result.returncode == 0 and applied == [] and "left as they are" in result.stdout
    result, applied = make("--rotate-tls")
    assert result.returncode == 0 and sorted(applied) == sorted(set(SECRETS) - {SECRET})
    (cluster / "bagua-autotune-tls").unlink()  # a partial set: certificates of two CAs would not trust each other
    result, applied = make()
    assert result.returncode == 2 and applied == [] and "--rotate-tls" in result.stderr
