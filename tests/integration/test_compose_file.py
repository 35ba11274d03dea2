"""docker-compose.yml, services/Dockerfile and .dockerignore, checked without a Docker engine.

What ``docker compose config`` would check (the Compose Specification schema, interpolation, references
between services), plus what this project promises: every service has a real healthcheck, each command is
the one the native launcher (``bagua-lightning up``) runs, the published ports are the ones the trainer's
clients use by default, and compose is as safe as ``up``: a password and a token are required, the password
reaches Redis on stdin, every master has a replica, and the cluster bus runs over mutual TLS.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bagua_lightning.cli import build_parser
from bagua_lightning.core.read_plane import READ_PORT_OFFSET_ENV, READER_USER, reader_acl_rules
from bagua_lightning.core.redis_server import DEFAULT_NODE_TIMEOUT_MS, NodeTLS
from bagua_lightning.core.services_file import DEFAULT_AUTOTUNE_ADDRESS, DEFAULT_LIGHTHOUSE_ADDRESS
from bagua_lightning.services import deploy, deploy_cli
from bagua_lightning.services.deploy_config import lighthouse_args
from bagua_lightning.services.redis_cluster import DEFAULT_EVICTION_POLICY, NodeConfig
from tests.integration.compose import (
    COMPOSE_FILE,
    ROOT,
    InterpolationError,
    config_directives,
    interpolate,
    load_compose,
    parse_port,
    raw_compose,
    redis_directives,
    variables,
)

SCHEMA = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
DOCKERFILE = ROOT / "services" / "Dockerfile"
MASTER_PORTS = [7000, 7001, 7002]
REPLICA_PORTS = [7003, 7004, 7005]
READ_PORT_OFFSET = 1000  # each node's plaintext read port (the reader's, docs/deployment.md "Open reads"): 8000-8005
DEFAULT_AUTOTUNE_PORT = int(DEFAULT_AUTOTUNE_ADDRESS.rpartition(":")[2])
DEFAULT_LIGHTHOUSE_PORT = int(DEFAULT_LIGHTHOUSE_ADDRESS.rpartition(":")[2])
# Variables a user may set, with their defaults; each must be documented in the file and in the docs.
SETTINGS = {
    "BAGUA_LIGHTNING_BIND_IP": "127.0.0.1",
    "BAGUA_LIGHTNING_ANNOUNCE_IP": "127.0.0.1",
    "BAGUA_LIGHTNING_AUTOTUNE_PORT": str(DEFAULT_AUTOTUNE_PORT),
    "BAGUA_LIGHTNING_LIGHTHOUSE_PORT": str(DEFAULT_LIGHTHOUSE_PORT),
    "BAGUA_LIGHTNING_REDIS_MAXMEMORY": "1gb",
    "BAGUA_LIGHTNING_REDIS_MEM_LIMIT": "2g",
    "BAGUA_LIGHTNING_REDIS_IMAGE": "redis:7.2-alpine",
    "BAGUA_LIGHTNING_PYTHON_IMAGE": "python:3.11.14-slim-trixie",
    "BAGUA_LIGHTNING_CLIENT_TLS_DIR": "./compose-tls",
    # Empty: `autotune serve` falls back to its own defaults (60 plans, 30 s warm-up, 5 s per plan).
    "BAGUA_LIGHTNING_AUTOTUNE_MAX_SAMPLES": "",
    "BAGUA_LIGHTNING_AUTOTUNE_WARMUP_TIME_S": "",
    "BAGUA_LIGHTNING_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S": "",
}
# The secrets: Compose secrets made from these variables when a service that uses them starts (`up` refuses
# to start such a service without them); no other command needs them.
REQUIRED = {"BAGUA_LIGHTNING_REDIS_PASSWORD", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN"}
SECRETS_ENV = {"BAGUA_LIGHTNING_REDIS_PASSWORD": "pw-0123", "BAGUA_LIGHTNING_AUTOTUNE_TOKEN": "token-4567"}
TLS_DIR = "/var/lib/bagua-lightning/tls"
CUSTOM_ENV = {
    "BAGUA_LIGHTNING_AUTOTUNE_TOKEN": "t0ken",
    "BAGUA_LIGHTNING_BIND_IP": "0.0.0.0",
    "BAGUA_LIGHTNING_ANNOUNCE_IP": "10.1.2.3",
    "BAGUA_LIGHTNING_AUTOTUNE_PORT": "29777",
    "BAGUA_LIGHTNING_LIGHTHOUSE_PORT": "29515",
    "BAGUA_LIGHTNING_REDIS_MAXMEMORY": "256mb",
    "BAGUA_LIGHTNING_REDIS_MEM_LIMIT": "512m",
    "BAGUA_LIGHTNING_REDIS_PASSWORD": "s3cret",
}
# redis-server settings that differ in a container on purpose (see the comment in docker-compose.yml).
# `set-proc-title no` is the native launcher's: `down` recognises its processes by their environment,
# which a rewritten process title would overwrite; in a container the container is the identity.
CONTAINER_ONLY = {"bind", "protected-mode", "dir", "logfile", "daemonize", "cluster-announce-ip", "set-proc-title"}
_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|ms|s|m|h))+$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(SECRETS_ENV)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The file's services (this shadows conftest's deployment fixture: nothing is started here)."""
    return compose["services"]


def _validator() -> jsonschema.Draft7Validator:
    # The schema names draft-07 by an https URL that jsonschema does not map; say it explicitly.
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    return jsonschema.Draft7Validator(SCHEMA, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)


# ------------------------------------------------------------------------------------------- the schema


@pytest.mark.parametrize("env", [SECRETS_ENV, CUSTOM_ENV], ids=["defaults", "custom-env"])
def test_valid_against_compose_spec_schema(env: dict[str, str]) -> None:
    errors = sorted(_validator().iter_errors(load_compose(env)), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_schema_is_the_vendored_draft07_copy() -> None:
    assert SCHEMA["$schema"].rstrip("#").endswith("draft-07/schema")
    assert "service" in SCHEMA["definitions"] and "healthcheck" in SCHEMA["definitions"]
    assert (ROOT / "tests" / "data" / "README.md").read_text().count("Apache") >= 1


def test_schema_check_catches_mistakes(compose: dict[str, Any]) -> None:
    # The validator is not vacuous: typical mistakes in a compose file are rejected.
    validator = _validator()
    broken = json.loads(json.dumps(compose))
    broken["services"]["autotune"]["healthcheck"]["intervall"] = "5s"
    assert not validator.is_valid(broken)
    broken = json.loads(json.dumps(compose))
    broken["services"]["autotune"]["depends_on"]["redis-init"]["condition"] = "service_done"
    assert not validator.is_valid(broken)
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis-0"]["ports"] = [{"target": "7000", "bogus": 1}]
    assert not validator.is_valid(broken)


# ----------------------------------------------------------------------------------------- interpolation


def test_every_variable_is_a_documented_setting_with_a_default() -> None:
    found = variables()
    assert set(found) == set(SETTINGS), "variables in docker-compose.yml differ from the documented settings"
    secret_sources = {s["environment"] for s in raw_compose()["secrets"].values()}
    assert secret_sources == REQUIRED
    header = COMPOSE_FILE.read_text().split("\nname:", 1)[0]
    docs = (ROOT / "docs" / "deployment.md").read_text()
    for name in REQUIRED:
        assert name in header and name in docs, f"{name} is not described"
    for name, defaults in found.items():
        expected = {SETTINGS[name]}
        assert defaults == expected, f"{name} has defaults {defaults}, expected {expected}"
        assert name in header, f"{name} is not described in the comment at the top of docker-compose.yml"
        assert name in docs, f"{name} is not described in docs/deployment.md"


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $$SET $SET", env) == "x d d  $SET x"
    assert interpolate("${SET:+alt}${UNSET:+alt}", env) == "alt"
    with pytest.raises(InterpolationError):
        interpolate("${UNSET:?needed}", env)
    with pytest.raises(InterpolationError):
        interpolate("cost: 5$", env)


def test_custom_settings_reach_every_use(services: dict[str, dict[str, Any]]) -> None:
    custom = load_compose(CUSTOM_ENV)["services"]
    ports = [p for spec in custom["net"]["ports"] for p in parse_port(spec)]
    assert {ip for ip, _, _ in ports} == {"0.0.0.0"}
    assert (None, 29777, 29777) in [(None, pub, tgt) for _, pub, tgt in ports]
    assert custom["autotune"]["command"][custom["autotune"]["command"].index("--port") + 1] == "29777"
    assert "127.0.0.1:29777" in custom["autotune"]["healthcheck"]["test"][1]
    assert (None, 29515, 29515) in [(None, pub, tgt) for _, pub, tgt in ports]
    assert custom["lighthouse"]["command"] == lighthouse_args(host="0.0.0.0", port=29515)
    assert custom["lighthouse"]["healthcheck"]["test"][-1] == "127.0.0.1:29515"
    for name in _redis_nodes(custom):
        d = redis_directives(custom[name]["command"])
        assert (d["maxmemory"], d["cluster-announce-ip"]) == ("256mb", "10.1.2.3")
        assert custom[name]["mem_limit"] == "512m"
    assert "10.1.2.3" in custom["certs"]["environment"]["BAGUA_LIGHTNING_TLS_HOSTS"].split()


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_a_password_and_a_token_are_required_only_by_the_services_that_use_them(missing: str) -> None:
    # Loading (what down, ps and logs do) needs neither secret.
    load_compose({k: v for k, v in SECRETS_ENV.items() if k != missing})
    compose = raw_compose()
    (secret,) = [name for name, s in compose["secrets"].items() if s["environment"] == missing]
    users = {name for name, svc in compose["services"].items() if secret in (svc.get("secrets") or [])}
    wanted = {"redis_password": {"redis-init", "autotune", *(f"redis-{i}" for i in range(6))},
              "autotune_token": {"autotune"}}
    assert users == wanted[secret]
    # An empty secret is refused by the containers' entrypoints, naming the variable.
    assert missing in json.dumps(compose["services"]["autotune"]["entrypoint"])


def test_the_password_reaches_redis_on_stdin_never_on_a_command_line(services: dict[str, dict[str, Any]],
                                                                    tmp_path: Path) -> None:
    password = SECRETS_ENV["BAGUA_LIGHTNING_REDIS_PASSWORD"]
    for name, svc in services.items():
        for key in ("command", "entrypoint"):
            assert password not in json.dumps(svc.get(key)), f"{name}'s {key} holds the password"
    for name in _redis_nodes(services):
        svc = services[name]
        d = redis_directives(svc["command"])
        assert "requirepass" not in d and "masterauth" not in d
        # The entrypoint hands the password over in a here-document and runs the command with `-`
        # (redis-server then reads the rest of its configuration from stdin). Run it with `cat` instead.
        shell, flag, script, arg0 = svc["entrypoint"]
        assert (shell, flag) == ("sh", "-c")
        secret_file = Path(tmp_path) / "redis_password"
        secret_file.write_text(password)
        fed = subprocess.run([shell, flag, script, arg0, "sh", "-c", 'printf "%s|" "$@"; cat', "-", *svc["command"]],
                             env={"PATH": "/usr/bin:/bin", "BAGUA_LIGHTNING_REDIS_PASSWORD_FILE": str(secret_file)},
                             capture_output=True, text=True, timeout=30)
        assert fed.returncode == 0, fed.stderr
        argv, stdin = fed.stdout.split("\n", 1)[0], fed.stdout.split("|")[-1]
        assert argv.split("|")[:len(svc["command"]) + 1] == [*svc["command"], "-"]
        assert config_directives(stdin) == {"requirepass": password, "masterauth": password}
        secret_file.write_text('a"b')
        refused = subprocess.run([shell, flag, script, arg0, "true"], capture_output=True, text=True, timeout=30,
                                 env={"PATH": "/usr/bin:/bin", "BAGUA_LIGHTNING_REDIS_PASSWORD_FILE": str(secret_file)})
        assert refused.returncode == 2 and "double quotes" in refused.stderr
        secret_file.write_text("")
        empty = subprocess.run([shell, flag, script, arg0, "true"], capture_output=True, text=True, timeout=30,
                               env={"PATH": "/usr/bin:/bin", "BAGUA_LIGHTNING_REDIS_PASSWORD_FILE": str(secret_file)})
        assert empty.returncode == 2 and "BAGUA_LIGHTNING_REDIS_PASSWORD" in empty.stderr


# ---------------------------------------------------------------------------------- services and health


def test_expected_services(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"net", "autotune", "lighthouse", "certs", "redis-init", *(f"redis-{i}" for i in range(6))}
    # Replicas by default, as `bagua-lightning up`: no profile to forget.
    assert not any("profiles" in svc for svc in services.values())


@pytest.mark.parametrize("name", ["net", "autotune", "lighthouse", "certs", "redis-init",
                                  *(f"redis-{i}" for i in range(6))])
def test_every_service_has_a_working_healthcheck(services: dict[str, dict[str, Any]], name: str) -> None:
    check = services[name].get("healthcheck")
    assert check, f"service {name} has no healthcheck"
    assert not check.get("disable"), f"service {name} disables its healthcheck"
    test = check["test"]
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) >= 2, test
    # start_interval needs Engine 25; docker-compose.start-interval.yml adds it for such engines.
    assert "start_interval" not in check, f"{name}: healthcheck.start_interval fails on Engine 20.10-24"
    for key in ("interval", "timeout", "start_period"):
        if key in check:
            assert _DURATION.match(check[key]), f"{name}.healthcheck.{key}={check[key]!r} is not a duration"
    assert int(check.get("retries", 3)) >= 1
    # A secret never enters the probe's environment: redis-cli reads the password on stdin (--askpass).
    command = " ".join(test[1:])
    assert "REDISCLI_AUTH" not in command, f"{name}: the healthcheck puts the password in an environment"
    if "redis-cli" in command and "/run/secrets/redis_password" in command:
        assert "--askpass" in command and "< /run/secrets/redis_password" in command, command


def test_references_between_services_resolve(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for dep, how in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if services[dep].get("profiles") and not set(services[dep]["profiles"]) & set(svc.get("profiles", [])):
                # Compose rejects a required dependency on a service that a profile may disable.
                assert how.get("required") is False, f"{name} -> {dep} must be `required: false`"
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dep]
        mode = svc.get("network_mode", "")
        if mode.startswith("service:"):
            owner = mode.split(":", 1)[1]
            assert owner in services and "profiles" not in services[owner], f"{name}: network_mode {mode}"
            assert "ports" not in svc, f"{name} shares {owner}'s namespace; publish its ports on {owner}"
            assert owner in deps, f"{name} must depend on {owner}, whose namespace it joins"
    _assert_acyclic(services)


def test_one_shot_services_are_awaited_by_a_long_running_one(services: dict[str, dict[str, Any]]) -> None:
    # `docker compose up --wait` counts an exited container as a failure unless a running service waits
    # for it with `service_completed_successfully`; that service must run whatever profiles are active.
    one_shot = sorted(n for n, s in services.items() if s.get("restart") == "no")
    assert one_shot == ["certs", "redis-init"]
    for name in one_shot:
        adopters = [n for n, s in services.items() if not s.get("profiles") and n not in one_shot
                    and s.get("depends_on", {}).get(name, {}).get("condition") == "service_completed_successfully"]
        assert adopters, f"no always-on service waits for the one-shot {name}"


def _assert_acyclic(services: dict[str, dict[str, Any]]) -> None:
    state: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        assert state.get(name) != 1, f"dependency cycle: {' -> '.join((*path, name))}"
        state[name] = 1
        for dep in services[name].get("depends_on", {}):
            visit(dep, (*path, name))
        state[name] = 2

    for name in services:
        visit(name, ())


# ---------------------------------------------------------------------------------------------- ports


def test_published_ports_match_client_defaults(services: dict[str, dict[str, Any]]) -> None:
    published = {pub: (ip, tgt) for spec in services["net"]["ports"] for ip, pub, tgt in parse_port(spec)}
    assert len(published) == sum(len(parse_port(s)) for s in services["net"]["ports"]), "a port is published twice"
    for port in [DEFAULT_AUTOTUNE_PORT, DEFAULT_LIGHTHOUSE_PORT, *MASTER_PORTS, *REPLICA_PORTS]:
        assert port in published, f"port {port} is not published"
        ip, target = published[port]
        assert ip == "127.0.0.1", f"port {port} must be published on loopback by default, not {ip}"
        # The announced address must be valid inside the shared namespace and on the host alike.
        assert target == port, f"port {port} is published to container port {target}"
        if port in MASTER_PORTS + REPLICA_PORTS:
            assert port + 10000 in published, f"cluster bus port {port + 10000} is not published"
            # The read port: published where the TLS port is, to the same container port.
            assert published.get(port + READ_PORT_OFFSET) == (ip, port + READ_PORT_OFFSET), \
                f"read port {port + READ_PORT_OFFSET} is not published beside {port}"
    assert deploy.DEFAULT_AUTOTUNE_PORT == DEFAULT_AUTOTUNE_PORT
    assert MASTER_PORTS[0] == deploy.DEFAULT_REDIS_PORT


def test_redis_nodes_listen_where_published(services: dict[str, dict[str, Any]]) -> None:
    ports = {}
    for name in _redis_nodes(services):
        d = redis_directives(services[name]["command"])
        ports[name] = int(d["tls-port"])
        # Clients on TLS only; the plain port is the read port, for the password-less reader alone.
        assert d["port"] == str(ports[name] + READ_PORT_OFFSET)
        assert d["user"] == " ".join([READER_USER, *reader_acl_rules()])
        assert f"--tls -p {d['tls-port']}" in services[name]["healthcheck"]["test"][1]
    assert [ports[f"redis-{i}"] for i in range(3)] == MASTER_PORTS
    assert [ports[f"redis-{i}"] for i in range(3, 6)] == REPLICA_PORTS
    env = services["redis-init"]["environment"]
    assert [int(p) for p in env["BAGUA_LIGHTNING_REDIS_MASTERS"].split()] == MASTER_PORTS
    assert [int(p) for p in env["BAGUA_LIGHTNING_REDIS_REPLICAS"].split()] == REPLICA_PORTS


def test_trainers_are_told_the_read_port_offset() -> None:
    # The trainers' environment (the file's header, the docs, the compose test's jobs) names the offset of
    # the read ports, which they then use for GET/MGET of sealed entries.
    header = COMPOSE_FILE.read_text().split("\nname:", 1)[0]
    assert f"export {READ_PORT_OFFSET_ENV}={READ_PORT_OFFSET}" in header
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert f"{READ_PORT_OFFSET_ENV}={READ_PORT_OFFSET}" in docs
    compose_up = (ROOT / "tests" / "integration" / "test_compose_up.py").read_text()
    assert f'"{READ_PORT_OFFSET_ENV}": "{READ_PORT_OFFSET}"' in compose_up


def test_a_node_started_with_the_compose_arguments_lets_only_the_reader_in_on_its_read_port(
        services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """redis-server itself (not a container) with the node's --port and --user arguments exactly as the file
    spells them, and the password on stdin as the entrypoint hands it over."""
    import redis

    from tests.procs import free_port, running, wait_until

    argv = services["redis-0"]["command"]
    start = argv.index("--user")
    user_args = argv[start:]
    assert all(not a.startswith("--") for a in user_args[1:])  # one option: its words up to the end
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", "",
           "--appendonly", "no", *user_args, "-"]
    script = 'printf \'requirepass "pw"\\n\' | exec "$@"'
    with running(["sh", "-c", script, "sh", *cmd], log_path=str(tmp_path / "redis.log")):
        def reader(**options: Any) -> redis.Redis:
            return redis.Redis(port=port, socket_timeout=5, **options)
        admin = reader(password="pw")
        wait_until(lambda: bool(admin.ping()), 20, "redis-server with the compose node's arguments")
        admin.set("!sealed:bagua-cache:v1:x", b"sealed")
        admin.set("bagua-cache:v1:x", b"in clear")
        admin.set("bagua_lightning:autotune:plan:x", b"plan")
        r = reader(username=READER_USER, password="")
        assert r.get("!sealed:bagua-cache:v1:x") == b"sealed" and r.ping()
        for command in (("SET", "!sealed:bagua-cache:v1:x", "forged"), ("GET", "bagua-cache:v1:x"),
                        ("GET", "bagua_lightning:autotune:plan:x"),
                        ("KEYS", "*"), ("CONFIG", "GET", "*"), ("FLUSHALL",)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*command)
        with pytest.raises(redis.AuthenticationError):
            reader().get("!sealed:bagua-cache:v1:x")  # the default user: the password is still needed
        assert admin.get("!sealed:bagua-cache:v1:x") == b"sealed"


# ----------------------------------------------------------------------- commands = the native launcher's


def test_autotune_command_is_the_native_launchers(services: dict[str, dict[str, Any]]) -> None:
    svc = services["autotune"]
    samples = "/var/lib/bagua-lightning/autotune-samples"
    # The plan store over TLS with the service's certificate; gRPC over TLS with the same.
    state = (f"rediss://127.0.0.1:{MASTER_PORTS[0]}?ssl_ca_certs={TLS_DIR}/ca.crt&ssl_certfile={TLS_DIR}/service.crt"
             f"&ssl_keyfile={TLS_DIR}/service.key")
    expected = deploy.autotune_service_args(host="0.0.0.0", port=DEFAULT_AUTOTUNE_PORT,
                                            state=deploy.redis_state_url("127.0.0.1", MASTER_PORTS[0]),
                                            log_dir=samples, token_file="/run/bagua-lightning/autotune-token")
    expected[expected.index("--state") + 1] = state
    assert svc["command"] == [*expected, "--tls-cert", f"{TLS_DIR}/service.crt", "--tls-key", f"{TLS_DIR}/service.key"]
    # What `bagua-lightning up` runs differs only in the bind address (loopback) and the log folder.
    native = deploy.autotune_service_args(host="127.0.0.1", port=DEFAULT_AUTOTUNE_PORT,
                                          state=deploy.redis_state_url("127.0.0.1", MASTER_PORTS[0]),
                                          log_dir="/home/me/.local/state/bagua-lightning/autotune-samples",
                                          token_file="/home/me/.local/state/bagua-lightning/secrets/autotune-token")
    assert [a for a in native if not a.startswith(("127.0.0.1", "/home", "redis://"))] == \
        [a for a in expected if a not in ("0.0.0.0", samples, state, "/run/bagua-lightning/autotune-token")]
    # Its secrets as file paths (0600 copies in a private tmpfs), never values in its environment.
    assert svc["environment"]["BAGUA_LIGHTNING_REDIS_PASSWORD_FILE"] == "/run/bagua-lightning/redis-password"
    assert "BAGUA_LIGHTNING_AUTOTUNE_TOKEN" not in svc["environment"]
    assert svc["tmpfs"] == ["/run/bagua-lightning:uid=10001,gid=10001,mode=0700"]
    # The samples folder is a named volume, created in the image for the service's user.
    assert svc["volumes"] == [{"type": "volume", "source": "autotune-samples", "target": samples},
                              {"type": "volume", "source": "tls", "target": TLS_DIR, "read_only": True}]
    assert "autotune-samples" in raw_compose()["volumes"]
    assert f"install -d -o bagua -g bagua {samples}" in DOCKERFILE.read_text()
    # The CLI accepts it, and the service runs without the trainer side (no torch in the image).
    args = build_parser().parse_args(svc["command"])
    assert callable(args.func)
    assert "BAGUA_LIGHTNING_NO_STRATEGY" not in svc["environment"]  # the CLI never imports Lightning
    assert svc["depends_on"]["redis-init"] == {"condition": "service_completed_successfully"}
    assert svc["build"] == {"context": ".", "dockerfile": "services/Dockerfile",
                            "args": {"PYTHON_IMAGE": SETTINGS["BAGUA_LIGHTNING_PYTHON_IMAGE"]}}
    assert f"ARG PYTHON_IMAGE={SETTINGS['BAGUA_LIGHTNING_PYTHON_IMAGE']}" in DOCKERFILE.read_text()


def test_autotune_healthcheck_is_the_status_command(services: dict[str, dict[str, Any]]) -> None:
    kind, shell = services["autotune"]["healthcheck"]["test"]
    token, command = shell.split(" bagua-lightning ", 1)
    assert kind == "CMD-SHELL" and token == "BAGUA_LIGHTNING_AUTOTUNE_TOKEN_FILE=/run/bagua-lightning/autotune-token"
    args = build_parser().parse_args(command.split())
    assert args.func is deploy_cli._cmd_status and args.autotune == f"127.0.0.1:{DEFAULT_AUTOTUNE_PORT}"
    assert str(args.tls_ca) == f"{TLS_DIR}/ca.crt"


@pytest.mark.parametrize("name", [f"redis-{i}" for i in range(6)])
def test_redis_node_settings_are_the_native_launchers(services: dict[str, dict[str, Any]], name: str) -> None:
    compose = redis_directives(services[name]["command"])
    # Clients on TLS only: the node's port is its TLS port, the plain one its read port (port + 1000 here,
    # + 20000 under `up`), where only the reader logs in: the same lines as the native launcher's.
    port = int(compose["tls-port"])
    assert compose["port"] == str(port + READ_PORT_OFFSET)
    tls = NodeTLS(cert_file=Path(f"{TLS_DIR}/node-{port}.crt"), key_file=Path(f"{TLS_DIR}/node-{port}.key"),
                  ca_file=Path(f"{TLS_DIR}/ca.crt"), clients=True)
    node = NodeConfig(port=port, data_dir=Path(f"/data/node-{port}"), cluster=True, deployment="d", tls=tls,
                      maxmemory=deploy.DEFAULT_MAXMEMORY, announce_ip="127.0.0.1", password="pw",
                      read_port=port + READ_PORT_OFFSET, persist=True)
    native = config_directives(node.config_text())
    assert native["user"] == compose["user"] and native["port"] == compose["port"]
    assert node.node_timeout_ms == DEFAULT_NODE_TIMEOUT_MS
    # The password is in neither: both hand it over on stdin.
    assert not {"requirepass", "masterauth"} & (set(compose) | set(native))
    assert (compose["tls-cluster"], compose["tls-replication"], compose["tls-auth-clients"]) == ("yes",) * 3
    compose["maxmemory"] = str(deploy.parse_bytes(compose["maxmemory"]))
    shared = {k: v for k, v in compose.items() if k not in CONTAINER_ONLY}
    assert shared == {k: v for k, v in native.items() if k not in CONTAINER_ONLY}
    assert compose["maxmemory-policy"] == DEFAULT_EVICTION_POLICY
    # Persistence as `up`'s: an append-only file, fsynced every second, in the node's own folder of redis-data.
    assert (compose["appendonly"], compose["appendfsync"], compose["save"]) == ("yes", "everysec", "")
    assert compose["dir"] == f"/data/node-{port}"
    # Every interface of the shared namespace (reached from the host only through the published ports), with
    # protected mode on: were the default user ever without its password, only loopback clients get in.
    assert compose["protected-mode"] == "yes" and compose["bind"] == "0.0.0.0"
    assert compose["cluster-announce-ip"] == "127.0.0.1"


def test_certificates_service_makes_what_the_nodes_use(services: dict[str, dict[str, Any]]) -> None:
    svc = services["certs"]
    assert svc["restart"] == "no" and svc["build"] == services["autotune"]["build"]
    assert svc["image"] == services["autotune"]["image"]
    assert svc["entrypoint"] == ["sh", "/bagua/compose-certs.sh"]
    env = svc["environment"]
    assert env["BAGUA_LIGHTNING_TLS_DIR"] == TLS_DIR
    assert [int(p) for p in env["BAGUA_LIGHTNING_REDIS_PORTS"].split()] == MASTER_PORTS + REPLICA_PORTS
    mounts = {m["target"]: m for m in svc["volumes"]}
    assert mounts[TLS_DIR] == {"type": "volume", "source": "tls", "target": TLS_DIR}
    assert mounts["/bagua/compose-certs.sh"]["source"] == "./services/compose-certs.sh"
    assert mounts[env["BAGUA_LIGHTNING_CLIENT_TLS_DIR"]]["source"] == SETTINGS["BAGUA_LIGHTNING_CLIENT_TLS_DIR"]
    assert "tls" in raw_compose()["volumes"] and "redis-data" in raw_compose()["volumes"]
    # It makes each node's data folder in the shared volume (the nodes run as 10001 and cannot).
    assert mounts[env["BAGUA_LIGHTNING_DATA_DIR"]] == {"type": "volume", "source": "redis-data",
                                                      "target": env["BAGUA_LIGHTNING_DATA_DIR"]}
    for name in _redis_nodes(services):
        node = services[name]
        assert node["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
        assert node["volumes"] == [{"type": "volume", "source": "tls", "target": TLS_DIR, "read_only": True},
                                   {"type": "volume", "source": "redis-data", "target": "/data"}]
        # The nodes run as the image's user, who owns the 0600 keys.
        assert node["user"].split(":")[0] == "10001"
    dockerfile = DOCKERFILE.read_text()
    assert "openssl" in dockerfile and f"install -d -o bagua -g bagua -m 0700 {TLS_DIR}" in dockerfile
    assert "--uid 10001" in dockerfile


def test_certificates_script_makes_what_each_side_needs(tmp_path: Path) -> None:
    server, client, data = tmp_path / "server", tmp_path / "client", tmp_path / "data"
    client.mkdir()
    data.mkdir()
    env = {"PATH": "/usr/bin:/bin", "BAGUA_LIGHTNING_TLS_DIR": str(server), "BAGUA_LIGHTNING_CLIENT_TLS_DIR": str(client),
           "BAGUA_LIGHTNING_REDIS_PORTS": "7000 7001", "BAGUA_LIGHTNING_TLS_HOSTS": "127.0.0.1 10.1.2.3",
           "BAGUA_LIGHTNING_TLS_OWNER": f"{os.getuid()}:{os.getgid()}", "BAGUA_LIGHTNING_DATA_DIR": str(data)}
    script = str(ROOT / "services" / "compose-certs.sh")
    made = subprocess.run(["sh", script], env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in server.iterdir()) == ["ca.crt", "node-7000.crt", "node-7000.key", "node-7001.crt",
                                                       "node-7001.key", "service.crt", "service.key"]  # no CA key
    assert sorted(p.name for p in client.iterdir()) == ["ca.crt", "client.crt", "client.key"]
    assert sorted(p.name for p in data.iterdir()) == ["node-7000", "node-7001"]  # the nodes' data folders
    assert all(oct(d.stat().st_mode & 0o777) == "0o700" and d.stat().st_uid == os.getuid() for d in data.iterdir())
    (data / "node-7000" / "appendonly.aof").write_text("kept")
    for folder in (server, client):
        assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in folder.iterdir())
    for cert in (server / "node-7000.crt", server / "service.crt", client / "client.crt"):
        verified = subprocess.run(["openssl", "verify", "-CAfile", str(client / "ca.crt"), str(cert)],
                                  capture_output=True, text=True, timeout=30)
        assert verified.returncode == 0, verified.stderr
    names = subprocess.run(["openssl", "x509", "-in", str(server / "service.crt"), "-noout", "-ext", "subjectAltName"],
                           capture_output=True, text=True, timeout=30).stdout
    assert "IP Address:127.0.0.1" in names and "IP Address:10.1.2.3" in names
    before = (server / "ca.crt").read_bytes()
    assert subprocess.run(["sh", script], env=env, capture_output=True, timeout=120).returncode == 0
    assert (server / "ca.crt").read_bytes() == before  # complete certificates are kept
    assert (data / "node-7000" / "appendonly.aof").read_text() == "kept"  # and the data folders
    (client / "client.key").unlink()  # incomplete: everything anew, one CA again on both sides
    assert subprocess.run(["sh", script], env=env, capture_output=True, timeout=120).returncode == 0
    assert (server / "ca.crt").read_bytes() == (client / "ca.crt").read_bytes() != before
    lint = subprocess.run(["sh", "-n", script], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stderr


def test_certificates_command_makes_certificates_the_nodes_accept(tmp_path: Path) -> None:
    from bagua_lightning.cli import main

    folder = tmp_path / "tls"
    assert main(["redis", "certs", "--dir", str(folder), "--ports", "7000-7001", "--host", "127.0.0.1"]) == 0
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["ca.crt", "node-7000.crt", "node-7000.key", "node-7001.crt", "node-7001.key"]  # no CA key
    assert all(oct((folder / f).stat().st_mode & 0o777) == "0o600" for f in files)
    for port in (7000, 7001):
        verified = subprocess.run(["openssl", "verify", "-CAfile", str(folder / "ca.crt"), str(folder / f"node-{port}.crt")],
                                  capture_output=True, text=True, timeout=30)
        assert verified.returncode == 0, verified.stderr
    before = (folder / "ca.crt").read_bytes()
    assert main(["redis", "certs", "--dir", str(folder), "--ports", "7000-7001"]) == 0
    assert (folder / "ca.crt").read_bytes() == before  # complete certificates are kept


def test_cluster_init_service(services: dict[str, dict[str, Any]]) -> None:
    svc = services["redis-init"]
    assert svc["command"][0] == "sh" and svc["restart"] == "no"
    mount, tls = svc["volumes"]
    assert tls == {"type": "volume", "source": "tls", "target": TLS_DIR, "read_only": True}
    assert "redis_password" in svc["secrets"]
    assert (ROOT / mount["source"]).is_file() and mount["read_only"] is True
    assert svc["command"][1] == mount["target"]
    assert set(svc["depends_on"]) == {"net", *_redis_nodes(services)}
    script = (ROOT / mount["source"]).read_text()
    assert script.startswith("#!/bin/sh") and "--cluster create" in script and "16384" in script
    result = subprocess.run(["sh", "-n", str(ROOT / mount["source"])], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_lighthouse_is_the_native_launchers_with_no_secret(services: dict[str, dict[str, Any]]) -> None:
    svc = services["lighthouse"]
    # What `bagua-lightning up` runs, bound to the shared namespace instead of loopback.
    assert svc["command"] == lighthouse_args(host="0.0.0.0", port=DEFAULT_LIGHTHOUSE_PORT)
    native = lighthouse_args(host="127.0.0.1", port=DEFAULT_LIGHTHOUSE_PORT)
    assert [a for a in native if a != "127.0.0.1"] == [a for a in svc["command"] if a != "0.0.0.0"]
    args = build_parser().parse_args(svc["command"])
    assert callable(args.func) and args.port == DEFAULT_LIGHTHOUSE_PORT
    assert svc["image"] == services["autotune"]["image"] and svc["build"] == services["autotune"]["build"]
    assert svc["network_mode"] == "service:net" and "secrets" not in svc  # it has none to check (torchft 0.2.0)
    kind, *check = svc["healthcheck"]["test"]
    status = build_parser().parse_args(check[1:])
    assert kind == "CMD" and check[0] == "bagua-lightning" and status.func is deploy_cli._cmd_status
    assert status.lighthouse == f"127.0.0.1:{DEFAULT_LIGHTHOUSE_PORT}"
    # The image holds torchft's wheel (no dependencies, pinned by hash) and loads its extension at build time.
    dockerfile = DOCKERFILE.read_text()
    assert "--no-deps -r /tmp/lighthouse.lock" in dockerfile and "torchft_extension()" in dockerfile
    lock = (ROOT / "services" / "lighthouse.lock").read_text()
    assert re.search(r"^torchft==0\.2\.0 \\\n    --hash=sha256:[0-9a-f]{64}$", lock, re.M), lock
    assert importlib.metadata.version("torchft") == "0.2.0"  # what the lock pins is what the tests ran


# What each service may keep of root's powers: certs hands the trainers' files to the host folder's owner.
CAPABILITIES = {"certs": ["CHOWN", "DAC_OVERRIDE"]}


@pytest.mark.parametrize("name", ["net", "autotune", "lighthouse", "certs", "redis-init",
                                  *(f"redis-{i}" for i in range(6))])
def test_every_service_is_locked_down(services: dict[str, dict[str, Any]], name: str) -> None:
    svc = services[name]
    assert svc["cap_drop"] == ["ALL"] and svc.get("cap_add", []) == CAPABILITIES.get(name, [])
    assert "no-new-privileges:true" in svc["security_opt"]
    assert "privileged" not in svc and svc.get("network_mode") != "host"
    assert svc["mem_limit"] and float(svc["cpus"]) > 0 and 0 < int(svc["pids_limit"]) <= 256
    if name == "certs":
        # Root for a second, without a network: chown to the host folder's owner needs root's CAP_CHOWN.
        assert svc["user"] == "0:0" and svc["network_mode"] == "none"
    else:
        assert svc["user"] == "10001:10001"
    # A read-only root wherever Compose allows one: it writes environment-sourced secrets into the container.
    assert svc.get("read_only", False) is not bool(svc.get("secrets")), name


def test_redis_nodes_memory_limit_is_above_their_maxmemory(services: dict[str, dict[str, Any]]) -> None:
    for name in _redis_nodes(services):
        limit = services[name]["mem_limit"]
        maxmemory = deploy.parse_bytes(redis_directives(services[name]["command"])["maxmemory"])
        assert deploy.parse_bytes(limit + "b") >= 2 * maxmemory  # an AOF rewrite's fork may copy every page


def test_same_redis_image_everywhere(compose: dict[str, Any]) -> None:
    raw = raw_compose()
    images = {s.get("image") for n, s in compose["services"].items() if n not in ("autotune", "certs", "lighthouse")}
    assert images == {SETTINGS["BAGUA_LIGHTNING_REDIS_IMAGE"]}
    assert raw["name"] == "bagua-lightning"


def _redis_nodes(services: dict[str, dict[str, Any]]) -> list[str]:
    return sorted(n for n in services if re.fullmatch(r"redis-\d+", n))


# ------------------------------------------------------------------------------ the image and its context


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_builds_a_small_torch_free_image() -> None:
    steps = _dockerfile_instructions()
    assert steps[0][0] == "ARG" and steps[1] == ("FROM", "${PYTHON_IMAGE}"), steps[:2]
    default = steps[0][1].removeprefix("PYTHON_IMAGE=")
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", default), steps[0]  # pinned
    runs = " ".join(rest for op, rest in steps if op == "RUN")
    assert "pip install --no-deps --no-build-isolation ." in runs
    # dependencies: the [service] extra, locked (tests/test_package.py checks the lock covers it)
    assert "pip install --require-hashes --only-binary=:all: --no-deps -r /tmp/requirements.lock" in runs
    # torch itself never (torchft's wheel comes without its dependencies, for the Lighthouse alone)
    assert not re.search(r"\btorch\b", re.sub(r"'torch must not[^']*'|find_spec\('torch'\)", "", runs))
    assert "--no-deps -r /tmp/lighthouse.lock" in runs
    env = " ".join(rest for op, rest in steps if op == "ENV")
    assert "BAGUA_LIGHTNING_NO_STRATEGY" not in env
    assert ("ENTRYPOINT", '["bagua-lightning"]') in steps
    assert any(op == "USER" and rest != "root" for op, rest in steps), "the service must not run as root"
    assert any(op == "HEALTHCHECK" for op, _ in steps)


def test_dockerfile_copies_every_package_folder_and_dockerignore_keeps_them() -> None:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {Path(p).parts[0] for p in pyproject["tool"]["setuptools"]["package-dir"].values()}
    copied = {src.rstrip("/") for op, rest in _dockerfile_instructions() if op == "COPY" for src in rest.split()[:-1]}
    assert folders <= copied, f"package folders not copied into the image: {folders - copied}"
    assert {"pyproject.toml", "README.md"} <= copied
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", ".dockerignore should be an allow-list"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    kept = {source for source in copied if source in allowed or source.split("/")[0] in allowed}
    assert copied == kept, f"COPY sources excluded by .dockerignore: {copied - kept}"


def test_service_extra_covers_what_the_image_imports() -> None:
    # Every third-party module imported at module level by the code the image runs (the CLI and its
    # commands, services/, proto/) must come from the [service] extra, since the image has nothing else.
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["service"]
    allowed = {re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-") for req in extra}
    dists = importlib.metadata.packages_distributions()
    files = [*sorted((ROOT / "src" / "bagua_lightning").glob("*.py")), *sorted((ROOT / "services").rglob("*.py")),
             *sorted((ROOT / "proto").rglob("*.py"))]
    missing: dict[str, list[str]] = {}
    for file in files:
        for module in _module_level_imports(file):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "bagua_lightning":
                continue
            names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
            if not names & allowed:
                missing.setdefault(f"{top} ({', '.join(sorted(names))})", []).append(str(file.relative_to(ROOT)))
    assert not missing, f"imported by the image but not in the [service] extra: {missing}"


def _module_level_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found: list[str] = []

    def walk(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append(node.module)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    walk(node.body)
                    walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)

    walk(tree.body)
    return found


def test_cli_in_the_image_runs_without_torch(tmp_path: Path) -> None:
    # The image has no torch or lightning: the CLI, `status` (its healthcheck) and `autotune serve --help`
    # must work with both unimportable.
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from bagua_lightning.cli import build_parser, main\n"
        "parser = build_parser()\n"
        "assert {'up', 'down', 'status'} <= set(parser._subparsers._group_actions[0].choices)\n"
        "sys.exit(main(['status', '--autotune', '127.0.0.1:1', '--timeout', '0.2']))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr  # 1: nothing answers on port 1 -- but it ran
    assert "autotune: UNHEALTHY" in result.stdout
