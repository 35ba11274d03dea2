"""deploy/k8s: secrets reach the pods as files, never as environment variables, and the metrics listen on the
pod's loopback only.

Static checks of the manifests (no ``secretKeyRef`` in any ``env``, no ``secretRef`` in ``envFrom``, every
``*_FILE`` inside a mount of the Secret that holds its key, Secret volumes read by the pod's group alone),
then what runs here: the files laid out as the kubelet mounts a Secret volume for a pod with ``fsGroup``
(``root:<fsGroup>``, mode 0440, behind ``..data`` links) and read by real processes of a real non-root user
(``nobody``) in that group: the clients' ``$NAME_FILE`` and the autotune service started from its manifest's
own arguments, whose metrics answer on loopback and whose environment holds no secret.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from bagua_lightning.cli import build_parser
from tests.deploy.test_k8s import DOCS, SECRET, _decoded, _one, _pod_specs, _secret_manifests
from tests.procs import free_port, stop_process, wait_until

# The secrets' variables of the clients and services, and the key of bagua-lightning-secrets each names.
FILE_VARIABLES = {"BAGUA_LIGHTNING_REDIS_PASSWORD_FILE": "redis-password",
                  "BAGUA_LIGHTNING_AUTOTUNE_TOKEN_FILE": "autotune-token",
                  "BAGUA_LIGHTNING_CACHE_KEY_FILE": "cache-key",
                  "REDIS_PASSWORD_FILE": "redis-password"}  # the Redis pods' scripts
SECRET_VALUES = ("BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "BAGUA_LIGHTNING_CACHE_KEY",
                 "REDISCLI_AUTH")
SECRET_DIR = "/etc/bagua-lightning/secrets"  # where the pods mount bagua-lightning-secrets

try:
    NOBODY = pwd.getpwnam("nobody")
except KeyError:  # pragma: no cover - every Debian/Ubuntu image has it
    NOBODY = None
as_root = pytest.mark.skipif(os.geteuid() != 0 or NOBODY is None or shutil.which("setpriv") is None,
                             reason="needs root, to lay files out as the kubelet does and run as `nobody`")


@functools.cache
def _made() -> dict[str, dict[str, Any]]:
    """make-secret.sh --print's Secrets, made once for this module."""
    return _secret_manifests()


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _environment(container: dict[str, Any]) -> dict[str, Any]:
    """The container's variables: its ConfigMaps' (envFrom) and its own ``env`` (values or ``valueFrom``)."""
    out: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        out.update(_one("ConfigMap", source["configMapRef"]["name"])["data"])
    out.update({e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])})
    return out


def _secret_mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, set[str]]]:
    """mountPath -> (Secret name, the file names it projects) of the container's Secret volumes."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")
        if secret is None:
            continue
        items = secret.get("items")
        keys = ({i["path"] for i in items} if items else
                set(_decoded(_made()[secret["secretName"]])))
        out[mount["mountPath"]] = (secret["secretName"], keys)
    return out


def test_no_pod_takes_a_secret_through_its_environment() -> None:
    pods = dict(_pod_specs())
    assert {"bagua-autotune", "bagua-trainer-example", "bagua-redis", "bagua-redis-init"} <= set(pods)
    for name, pod in pods.items():
        for container in _containers(pod):
            assert not [s for s in container.get("envFrom", []) if "secretRef" in s], (name, container["name"])
            for variable, value in _environment(container).items():
                assert not (isinstance(value, dict) and "secretKeyRef" in value), (name, variable)
                assert variable not in SECRET_VALUES, (name, variable)  # a secret's value, by name
    # The scripts the Redis pods run hand the password to redis-cli on stdin (--askpass), not in REDISCLI_AUTH.
    scripts = _one("ConfigMap", "bagua-redis")["data"]
    for script in ("ping-node.sh", "form-cluster.sh"):
        assert "export REDISCLI_AUTH" not in scripts[script] and "--askpass" in scripts[script], script
        commands = [line.split(" #")[0] for line in scripts[script].splitlines() if not line.lstrip().startswith("#")]
        bare = [line for line in commands if re.search(r"redis-cli (?!--askpass)(?!--user bagua-reader)", line)]
        assert not bare, (script, bare)  # every redis-cli with the password takes it on stdin


def test_every_secret_file_variable_points_into_a_mount_of_its_secret() -> None:
    wanted = {"bagua-trainer-example": {"BAGUA_LIGHTNING_REDIS_PASSWORD_FILE", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN_FILE",
                                        "BAGUA_LIGHTNING_CACHE_KEY_FILE"},
              "bagua-autotune": {"BAGUA_LIGHTNING_REDIS_PASSWORD_FILE"}}
    for name, pod in _pod_specs():
        for container in _containers(pod):
            mounts = _secret_mounts(pod, container)
            found = set()
            for variable, path in _environment(container).items():
                if variable not in FILE_VARIABLES:
                    continue
                found.add(variable)
                folder, file = str(Path(path).parent), Path(path).name
                assert mounts.get(folder) is not None, (name, variable, path)
                secret, keys = mounts[folder]
                assert secret == SECRET and file == FILE_VARIABLES[variable] and file in keys, (name, variable)
            assert wanted.get(name, set()) <= found, (name, found)
    # The Redis pods' scripts default to the file their Secret volume holds (REDIS_PASSWORD_FILE unset).
    scripts = _one("ConfigMap", "bagua-redis")["data"]
    for name in ("bagua-redis", "bagua-redis-init"):
        (pod,) = [p for n, p in _pod_specs() if n == name]
        (container,) = pod["containers"]
        assert _secret_mounts(pod, container)[SECRET_DIR] == (SECRET, {"redis-password"}), name
    assert all(f"{SECRET_DIR}/redis-password" in scripts[s] for s in ("start-node.sh", "ping-node.sh",
                                                                      "form-cluster.sh"))
    # The autotune service's token: its --token-file, in the same mount.
    (container,) = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]["containers"]
    args = build_parser(container["args"]).parse_args(container["args"])
    assert str(args.token_file) == f"{SECRET_DIR}/autotune-token"


def test_secret_volumes_are_read_by_the_pod_group_alone() -> None:
    for name, pod in _pod_specs():
        secrets = [v["secret"] for v in pod["volumes"] if "secret" in v]
        if not secrets:
            continue
        context = pod["securityContext"]
        # A non-root user reads a Secret volume's root-owned files through fsGroup: mode 0440, nobody else.
        assert context["runAsNonRoot"] is True and isinstance(context.get("fsGroup"), int), name
        for secret in secrets:
            assert secret.get("defaultMode") in (0o400, 0o440), (name, secret["secretName"])
            assert all(item.get("mode", 0o400) in (0o400, 0o440) for item in secret.get("items", [])), name


def test_only_the_tls_and_token_port_listens_on_every_interface() -> None:
    (container,) = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]["containers"]
    args = build_parser(container["args"]).parse_args(container["args"])
    assert args.metrics_host == "127.0.0.1" and args.metrics_port is not None  # no authentication: loopback
    assert args.host == "0.0.0.0" and args.tls_cert and args.token_file  # gRPC: TLS, and the token on every call
    exposed = {p["containerPort"] for p in container["ports"]}
    assert exposed == {args.port}
    for _, doc in DOCS:  # no Service and no NetworkPolicy names the metrics port
        if doc["kind"] == "Service":
            assert args.metrics_port not in {p["port"] for p in doc["spec"]["ports"]}, doc["metadata"]["name"]
        if doc["kind"] == "NetworkPolicy":
            for rule in doc["spec"].get("ingress", []):
                assert args.metrics_port not in {p["port"] for p in rule.get("ports", [])}, doc["metadata"]["name"]


# -- as the kubelet mounts them, read by a real non-root user ----------------------------------------------

def _fs_group() -> int:
    return int(_one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]["securityContext"]["fsGroup"])


@pytest.fixture
def volumes_root() -> Iterator[Path]:
    """A root-owned 0755 folder in /tmp that ``nobody`` may traverse (a pod's filesystem); removed after."""
    folder = Path(tempfile.mkdtemp(prefix="bagua-k8s-", dir="/tmp"))
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def kubelet_volume(mount: Path, files: dict[str, bytes], gid: int, mode: int = 0o440) -> Path:
    """``files`` laid out as the kubelet writes a Secret volume: a sticky (1777) root folder, the files in a
    timestamped folder (root:``gid``, ``mode``), ``..data`` linking to it and one link per file."""
    mount.mkdir()
    os.chmod(mount, 0o1777)
    stamp = mount / "..2026_12_02_00_00_00.000000001"
    stamp.mkdir(mode=0o755)
    for name, value in files.items():
        path = stamp / name
        path.write_bytes(value)
        os.chown(path, 0, gid)
        os.chmod(path, mode)
    (mount / "..data").symlink_to(stamp.name)
    for name in files:
        (mount / name).symlink_to(f"..data/{name}")
    return mount


def _nobody(groups: list[int]) -> list[str]:
    """The command prefix that runs a program as ``nobody`` with only ``groups`` beside its own (setpriv: no
    capabilities are kept)."""
    assert NOBODY is not None
    extra = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", extra]


def _as_nobody(argv: list[str], env: dict[str, str], groups: list[int]) -> Any:
    return subprocess.run([*_nobody(groups), *argv], env=env, capture_output=True, text=True, timeout=60, cwd="/")


READ_SECRETS = """
import json, sys
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.core.services_file import env_secret
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = env_secret(name)
    except ConfigurationError as exc:
        out[name] = "refused: " + str(exc)
print(json.dumps(out))
"""


def _client_env(mount: Path) -> dict[str, str]:
    """The trainer's variables from the clients' ConfigMap, the secrets' paths moved under ``mount``."""
    clients = _one("ConfigMap", "bagua-lightning-clients")["data"]
    env = {k: v.replace(SECRET_DIR, str(mount)) for k, v in clients.items() if k in FILE_VARIABLES}
    assert set(env) == set(FILE_VARIABLES) - {"REDIS_PASSWORD_FILE"}
    return {"PATH": os.environ["PATH"], "HOME": "/nonexistent", **env}


@as_root
def test_the_clients_read_their_secrets_from_a_kubernetes_secret_volume(volumes_root: Path) -> None:
    values = _decoded(_made()[SECRET])
    gid = _fs_group()
    names = ["BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "BAGUA_LIGHTNING_CACHE_KEY"]
    read = [sys.executable, "-c", READ_SECRETS, *names]
    mount = kubelet_volume(volumes_root / "secrets", values, gid)
    env = _client_env(mount)
    result = _as_nobody(read, env, [gid])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "BAGUA_LIGHTNING_REDIS_PASSWORD": values["redis-password"].decode(),
        "BAGUA_LIGHTNING_AUTOTUNE_TOKEN": values["autotune-token"].decode(),
        "BAGUA_LIGHTNING_CACHE_KEY": values["cache-key"].decode()}
    # Outside the pod's group the files cannot be read at all; readable by others, or the user's own file
    # readable by its group, they are refused, naming the file and the fix.
    outside = json.loads(_as_nobody(read, env, []).stdout)
    assert all(v.startswith("refused: ") and "cannot be read" in v for v in outside.values()), outside
    loose = kubelet_volume(volumes_root / "loose", values, gid, mode=0o444)
    refused = json.loads(_as_nobody(read, _client_env(loose), [gid]).stdout)
    assert all("can be read or written by other users" in v and "chmod go-rwx" in v for v in refused.values())
    own = kubelet_volume(volumes_root / "own", values, gid)
    for path in (own / "..data").resolve().iterdir():
        os.chown(path, NOBODY.pw_uid, gid)  # type: ignore[union-attr]
    refused = json.loads(_as_nobody(read, _client_env(own), [gid]).stdout)
    assert all("can be read or written by other users" in v for v in refused.values()), refused


@as_root
def test_the_autotune_service_runs_from_its_manifest_with_secret_files_and_loopback_metrics(
        volumes_root: Path) -> None:
    gid = _fs_group()
    made = _made()
    values = _decoded(made[SECRET])
    pod = _one("Deployment", "bagua-autotune")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # Every Secret volume of the pod, where the kubelet would put it (under volumes_root).
    where: dict[str, str] = {}
    for mount_path, (secret, keys) in _secret_mounts(pod, container).items():
        files = {k: v for k, v in _decoded(made[secret]).items() if k in keys}
        mount = kubelet_volume(volumes_root / secret, files, gid)
        where[mount_path] = str(mount)
    samples = volumes_root / "samples"
    samples.mkdir()
    os.chown(samples, NOBODY.pw_uid, gid)  # type: ignore[union-attr]

    def moved(text: str) -> str:
        for mount_path, local in where.items():
            text = text.replace(mount_path, local)
        return text.replace("/var/lib/bagua-lightning/autotune-samples", str(samples))

    args = [moved(a) for a in container["args"]]
    port, metrics_port = free_port(), free_port()
    options = {"--host": "127.0.0.1", "--port": str(port), "--metrics-port": str(metrics_port)}
    for flag, value in options.items():
        args[args.index(flag) + 1] = value
    # No plan store: `nobody` runs the system's Python beside the venv's packages here, on which redis-py does
    # not import. The store reads its password through env_secret, which the test above runs as `nobody`.
    at = args.index("--state")
    del args[at:at + 2]
    assert args[args.index("--metrics-host") + 1] == "127.0.0.1"  # the manifest's own
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent",
           **{e["name"]: moved(e["value"]) for e in container["env"] if "value" in e}}
    assert set(env) >= {"BAGUA_LIGHTNING_REDIS_PASSWORD_FILE"}
    assert NOBODY is not None
    log = volumes_root / "service.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*_nobody([gid]), sys.executable, "-m", "bagua_lightning.cli", *args,
                                 "--tuning-processes", "0"], env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        try:
            # The metrics endpoint comes up before the gRPC port: wait for the line that follows the bind.
            wait_until(lambda: proc.poll() is not None or (f"127.0.0.1:{metrics_port}/metrics" in log.read_text()
                                                           and f"listening on 127.0.0.1:{port}" in log.read_text()),
                       60, "the autotune service's metrics and listening lines")
            assert proc.poll() is None
        except (TimeoutError, AssertionError):
            pytest.fail(f"the service did not serve its metrics (exit {proc.poll()}): {log.read_text()}")
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"bagua_autotune_models" in reply.read()
        listening = {c.laddr.port: c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {port: "127.0.0.1", metrics_port: "127.0.0.1"}, listening  # the metrics: loopback
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert not [k for k, v in values.items() if v in environ], "a secret is in the service's environment"
        assert b"_FILE=" in environ
        # The token came from its file: a call without it is refused, a call with it is answered.
        tls = where["/etc/bagua-autotune/tls"]
        ca = (Path(tls) / "ca.crt").read_bytes()
        name = next(e["value"] for e in container["env"] if e["name"] == "AUTOTUNE_TLS_NAME")
        channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root_certificates=ca),
                                      options=[("grpc.ssl_target_name_override", name)])
        try:
            call = channel.unary_unary("/bagua_lightning.autotune.v1.AutotuneService/ListModels")
            wait_until(lambda: _code(call, None) == grpc.StatusCode.UNAUTHENTICATED, 30, "the gRPC port")
            token = values["autotune-token"].decode()
            assert _code(call, token) == grpc.StatusCode.OK
        finally:
            channel.close()
    finally:
        stop_process(proc)
    assert proc.returncode is not None
    assert "refused" not in log.read_text() and "not trusted" not in log.read_text(), log.read_text()


def _code(call: Any, token: str | None) -> grpc.StatusCode:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        call(b"", timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK
