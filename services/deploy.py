"""``bagua-lightning up | down | status``: the autotune service and a Redis deployment as local processes.

The embedded counterpart of ``docker-compose.yml``: the same two services, started natively as detached
background processes (own session, logs under :func:`~bagua_lightning.core.services_file.state_dir`), the
autotune service keeping its persisted plans in the Redis deployment. ``up`` waits until both are healthy
(gRPC health ``SERVING``; every Redis node answering and, for a cluster, all 16384 slots served), then
records their addresses, process records and the paths of their secret files in the services file, where
``BaguaStrategy(autotune=True)`` and ``CachedDataset`` find them. ``up`` on healthy recorded services does
nothing; ``down`` stops what ``up`` started and the node-local cache server, and removes the file.

Authentication is on by default: ``up`` creates a Redis password, an autotune token and a cache key
(``$BAGUA_LIGHTNING_REDIS_PASSWORD`` & co. when set, else random) in ``<state_dir>/secrets/`` (0600 files,
0700 folder). They reach the services through a pipe (Redis) and the environment (autotune), trainers
through the services file's paths; never through a command line. ``--no-auth`` is refused beyond loopback.

High availability: by default 3 masters with one replica each (replicas on the next ports); a killed
master's replica takes over within seconds (failover settings in :mod:`bagua_lightning.core.redis_server`,
measured in docs/deployment.md). ``--replicas 0`` gives up failover: a dead master's keys miss until ``up``
runs again. Only the deployment's nodes join its cluster: the bus and replication run over mutual TLS
with certificates from a CA that ``up`` makes in ``<state_dir>/secrets/redis-tls`` (its key is deleted once
the node certificates are signed), and the node ids are recorded so ``status`` names any foreign node.

Secrets only to proven servers: the same CA signs a client certificate for trainers and the autotune
service's server certificate; Redis serves clients over TLS only and the autotune service listens with TLS
only. The services file pins the CA, so a client sends the password or the token only after the server
proved with the handshake that it is the deployment's (a process on a dead node's port gets nothing).

Identity: every process carries the deployment's id; ``down`` signals a recorded process only when pid,
start time and id match, and only when the state folder's marker names this deployment, this folder and
this services file (a copied state folder or a stale file stops nothing; see :mod:`bagua_lightning.core.procs`).

The argv of the autotune service comes from one function, :func:`autotune_service_args`, which both this
launcher and ``docker-compose.yml`` use (a test compares them). No torch is imported here: the module runs
in the torch-free service image, whose healthcheck is ``bagua-lightning status --autotune HOST:PORT``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core import procs
from ..core.errors import ConfigurationError
from ..core.procs import parse_bytes
from ..core.redis_server import BUS_PORT_OFFSET
from ..core.services_file import (
    DEFAULT_AUTOTUNE_ADDRESS,
    ENV_AUTOTUNE_TOKEN,
    ENV_CACHE_KEY,
    ENV_REDIS_PASSWORD,
    ServicesInfo,
    check_port,
    format_address,
    is_loopback,
    read_services_file,
    remove_services_file,
    services_file_path,
    state_dir,
    write_services_file,
)
from ..core.tls_trust import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, TLS_ENV
from .addresses import WILDCARDS, machine_address, resolve_host
from .health import Health, check_autotune, check_redis, wait_healthy
from .redis_tls import client_tls, remove_tls_dir, service_certificate

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_AUTOTUNE_PORT = int(DEFAULT_AUTOTUNE_ADDRESS.rpartition(":")[2])
DEFAULT_REDIS_PORT = 7000  # first node of the local cluster; the trainer's documented default
DEFAULT_MAXMEMORY = 1024**3  # bytes per Redis node; docker-compose.yml uses the same default ("1gb")
AUTOTUNE_LOG = "autotune.log"
AUTOTUNE_SAMPLES = "autotune-samples"  # folder of the service's per-model sample logs
SECRETS_DIR = "secrets"
REDIS_TLS_DIR = "redis-tls"  # under SECRETS_DIR: the bus CA certificate and the node keys and certificates
# secret name in the services file -> (file name in <state_dir>/secrets, environment variable that overrides it)
SECRETS = {"redis_password": ("redis-password", ENV_REDIS_PASSWORD),
           "autotune_token": ("autotune-token", ENV_AUTOTUNE_TOKEN),
           "cache_key": ("cache-key", ENV_CACHE_KEY)}

__all__ = ["DEFAULT_AUTOTUNE_PORT", "DEFAULT_HOST", "DEFAULT_REDIS_PORT", "UpConfig", "autotune_service_args",
           "down", "ensure_up", "parse_bytes", "redis_state_url", "running_services", "up"]


def autotune_service_args(*, host: str, port: int, state: str, log_dir: str, tls_cert: str | None = None,
                          tls_key: str | None = None) -> list[str]:
    """The autotune service's arguments after the program name (``bagua-lightning``).

    The single source of truth for how the service is run: ``up`` prefixes it with
    ``python -m bagua_lightning.cli``; ``docker-compose.yml`` uses it as the ``command`` of the image
    whose entrypoint is ``bagua-lightning`` (with ``host="0.0.0.0"``, so that published ports reach it).

    Args:
        host: address to bind.
        port: gRPC port.
        state: where persisted plans live: a directory or a ``redis://host:port`` URL.
        log_dir: folder for the per-model JSONL log of every tuning sample.
        tls_cert: PEM certificate of the service (with ``tls_key``): it listens with TLS only; None: plaintext.
        tls_key: PEM private key of ``tls_cert``.
    """
    tls = ["--tls-cert", tls_cert, "--tls-key", tls_key] if tls_cert and tls_key else []
    return ["autotune", "serve", "--host", host, "--port", str(port), "--state", state, "--log-dir", log_dir, *tls]


def redis_state_url(host: str, port: int) -> str:
    """The ``--state`` value that keeps the autotune service's plans in the Redis node ``host:port``.

    The password is never part of the URL (it would show in ``ps``); the service reads it from
    ``BAGUA_LIGHTNING_REDIS_PASSWORD``.
    """
    return f"redis://{format_address(host, port)}"


@dataclass(kw_only=True)
class UpConfig:
    """What ``bagua-lightning up`` starts.

    Attributes:
        host: address both services bind and that clients are given; loopback by default. A host name
            (``localhost``) is resolved to its address. For trainers on other machines give this machine's
            address, or a wildcard (``0.0.0.0``) with ``announce_ip`` (they then need the secrets, see
            docs/deployment.md).
        announce_ip: the address clients and the other nodes are given when ``host`` is a wildcard; None:
            ``host``, or for a wildcard a non-loopback address of this machine (never loopback, which
            other machines cannot reach).
        autotune_port: gRPC port of the autotune service.
        redis_port: first Redis port; cluster node i listens on ``redis_port + i`` (bus: ``+ 10000``,
            with TLS the node's port is its TLS port; without, TLS is off altogether).
        nodes: Redis Cluster masters.
        replicas: replicas per master: 1 fails a dead master over to its replica; 0 means no failover (a
            dead master's keys miss until the next ``up``). None: 1 for a cluster, 0 with ``single``.
        bus_tls: TLS with the deployment's own CA: the cluster bus and replication (mutual TLS: only this
            deployment's nodes can join), Redis' client ports (TLS only, a client certificate required) and
            the autotune service (TLS only); clients pin the CA through the services file. False: all of it
            in plaintext, the bus open to any local process (tests only, no command line flag).
        single: one standalone Redis instead of a cluster (``nodes``/``replicas`` must stay default).
        maxmemory: bytes per Redis node, 0 for no limit.
        timeout_s: deadline for both services to become healthy, in seconds.
        auth: require a Redis password and an autotune token and configure a cache key (created in
            ``<state_dir>/secrets``); False only on loopback.
    """

    host: str = DEFAULT_HOST
    announce_ip: str | None = None
    autotune_port: int = DEFAULT_AUTOTUNE_PORT
    redis_port: int = DEFAULT_REDIS_PORT
    nodes: int = 3
    replicas: int | None = None
    bus_tls: bool = True
    single: bool = False
    maxmemory: int = DEFAULT_MAXMEMORY
    timeout_s: float = 60.0
    auth: bool = True

    def __post_init__(self) -> None:
        if self.single and self.replicas:
            raise ConfigurationError(f"--single starts one standalone Redis; drop --replicas {self.replicas}.")
        if self.replicas is None:
            self.replicas = 0 if self.single else 1
        if self.replicas < 0:
            raise ConfigurationError(f"replicas={self.replicas} is negative; use 1 (failover) or 0 (none).")
        self.host = resolve_host(self.host, "host")
        if self.announce_ip is not None:
            self.announce_ip = resolve_host(self.announce_ip, "announce_ip")
        if self.host in WILDCARDS:
            self.announce_ip = self.announce_ip or machine_address()
            if self.announce_ip in WILDCARDS or is_loopback(self.announce_ip):
                raise ConfigurationError(
                    f"--announce-ip {self.announce_ip} with --host {self.host}: other machines cannot reach a "
                    "loopback or wildcard address; give this machine's address, or bind --host 127.0.0.1.")
        elif self.announce_ip is not None and self.announce_ip != self.host:
            raise ConfigurationError(f"--announce-ip {self.announce_ip} with --host {self.host}: clients are "
                                     "given the bound address; give --announce-ip only with --host 0.0.0.0.")
        check_port(self.autotune_port, "autotune_port")
        check_port(self.redis_port, "redis_port")
        last = self.redis_port + self.redis_node_count - 1 + (0 if self.single else BUS_PORT_OFFSET)
        if last > 65535:
            raise ConfigurationError(f"redis_port {self.redis_port}: the Redis ports (cluster bus: port + "
                                     f"{BUS_PORT_OFFSET}) reach {last} > 65535; pick a lower --redis-port.")
        if not self.auth and not is_loopback(self.host):
            raise ConfigurationError(f"--no-auth with --host {self.host}: anyone on the network could use the "
                                     "services; drop --no-auth or bind 127.0.0.1.")
        if self.nodes < 1:
            raise ConfigurationError(f"nodes={self.nodes}: a cluster needs at least one master.")
        if self.single and self.nodes != 3:
            raise ConfigurationError(f"--single starts one standalone Redis; drop --nodes {self.nodes}.")
        redis_ports = range(self.redis_port, self.redis_port + self.redis_node_count)
        if self.autotune_port in redis_ports:
            raise ConfigurationError(
                f"autotune_port {self.autotune_port} collides with the Redis ports {redis_ports.start}.."
                f"{redis_ports.stop - 1}; pick another --autotune-port or --redis-port."
            )
        if self.maxmemory < 0:
            raise ConfigurationError(f"maxmemory {self.maxmemory} is negative; give bytes, 0 for no limit.")
        if not self.timeout_s > 0:
            raise ConfigurationError(f"timeout_s {self.timeout_s} must be > 0 seconds.")

    @property
    def replicas_per_master(self) -> int:
        return self.replicas or 0  # set in __post_init__

    @property
    def redis_node_count(self) -> int:
        return 1 if self.single else self.nodes * (1 + self.replicas_per_master)

    @property
    def client_host(self) -> str:
        """The address clients are given: ``announce_ip`` for a wildcard bind, else ``host``."""
        return self.announce_ip or self.host

    @property
    def autotune_address(self) -> str:
        return format_address(self.client_host, self.autotune_port)


def start_autotune(cfg: UpConfig, state: str, folder: Path, deployment: str,
                   secrets: dict[str, str], tls_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """Start the autotune service detached (own session, stdin closed), logging to ``folder/autotune.log``.

    Its token and the Redis password reach it through its environment (readable only by the same user).
    With the certificates of ``tls_dir`` it listens with TLS only and reaches Redis over TLS (their paths in
    ``$BAGUA_LIGHTNING_TLS_*``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    served = service_certificate(tls_dir) if tls_dir is not None else None
    argv = [sys.executable, "-m", "bagua_lightning.cli",
            *autotune_service_args(host=cfg.host, port=cfg.autotune_port, state=state,
                                   log_dir=str(folder / AUTOTUNE_SAMPLES),
                                   tls_cert=str(served[0]) if served else None,
                                   tls_key=str(served[1]) if served else None)]
    env = procs.child_env(deployment)
    for name in TLS_ENV:
        env.pop(name, None)
    tls = client_tls(tls_dir) if tls_dir is not None else None
    if tls is not None:
        env.update({ENV_TLS_CA: tls.ca, ENV_TLS_CERT: tls.cert or "", ENV_TLS_KEY: tls.key or ""})
    for name in ("redis_password", "autotune_token"):
        env.pop(SECRETS[name][1], None)
        if name in secrets:
            env[SECRETS[name][1]] = secrets[name]
    with open(folder / AUTOTUNE_LOG, "ab") as log_file:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, cwd=folder, start_new_session=True, close_fds=True)



# ------------------------------------------------------------------------------------------ up / down


def running_services(info: ServicesInfo | None, password: str | None = None,
                     token: str | None = None) -> dict[str, Health]:
    """Health of each service recorded in ``info`` (``autotune``, ``redis``); empty when none.

    A service whose recorded process is no longer ours (gone, or its pid reused) is unhealthy, even when
    something else answers on its port. ``password``/``token``: default the recorded secret files.
    """
    if info is None:
        return {}
    password = password if password is not None else _recorded_secret(info, "redis_password")
    token = token if token is not None else _recorded_secret(info, "autotune_token")
    out: dict[str, Health] = {}
    if info.autotune:
        gone = [r.pid for r in info.processes.get("autotune") or [] if not procs.is_running(r)]
        out["autotune"] = (Health(False, f"process {gone[0]} is gone") if gone
                           else check_autotune(info.autotune, token=token,
                                               tls_ca=Path(info.tls.ca) if info.tls else None))
    if info.redis_hosts:
        gone = [r.pid for r in info.processes.get("redis") or [] if not procs.is_running(r)]
        out["redis"] = (Health(False, f"processes {gone} are gone") if gone
                        else check_redis(info.redis_hosts, info.redis_cluster, password,
                                         node_ids=info.redis_node_ids or None, tls=info.tls))
    return out


def _recorded_secret(info: ServicesInfo, name: str) -> str | None:
    path = info.secrets.get(name)
    if not path:
        return None
    try:
        return procs.read_secret(path)
    except ConfigurationError:
        return None  # reported as unhealthy by the check that needs it


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    # Two `up`s at once (two shells, the ranks of a job) would race for the same ports: one at a time.
    path = services_file_path().with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _claim_ports(ports: list[int]) -> Iterator[None]:
    """Claim ``ports`` machine-wide while services start on them (also across state folders and users).

    The claim is an abstract Unix socket per port: the kernel frees it when this process ends, however it
    ends, and a second ``up`` asking for the same port learns at once that it is taken.
    """
    held: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind(f"\0bagua-lightning-port-{port}")
            except OSError as exc:
                s.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise ConfigurationError(
                    f"port {port} is being claimed by another `bagua-lightning up` right now (another state "
                    "folder or user); wait for it and run `bagua-lightning status`, or pick other ports."
                ) from None
            held.append(s)
        yield
    finally:
        for s in held:
            s.close()


def up(cfg: UpConfig) -> ServicesInfo:
    """Start both services (or find them already running and healthy) and write the services file.

    Calls are serialised through a lock file beside the services file.

    Raises:
        ConfigurationError: bad settings, services running with other settings, or a port is taken.
        ServiceUnavailableError: a service did not become healthy before ``cfg.timeout_s``; everything
            this call started is stopped again.
    """
    with _exclusive():
        return _up(cfg)


def _healthy_existing() -> ServicesInfo | None:
    existing = read_services_file()
    health = running_services(existing)
    if existing is not None and health and all(h.healthy for h in health.values()):
        return existing
    if existing is not None:
        log.info("recorded services are not all healthy (%s); restarting them",
                 ", ".join(f"{k}: {h.detail}" for k, h in health.items()))
        _down()
    return None


def _up(cfg: UpConfig) -> ServicesInfo:
    from . import redis_cluster

    existing = _healthy_existing()
    if existing is not None:
        differences = _differences(existing, cfg)
        if differences:
            raise ConfigurationError(
                f"services are already running with other settings ({'; '.join(differences)}); stop them with "
                "`bagua-lightning down` first, or run `up` with the same options."
            )
        log.info("services already running and healthy (%s)", services_file_path())
        return existing
    ports = _require_free_ports(cfg)
    with _claim_ports(ports):
        _require_free_ports(cfg)  # a concurrent `up` may have finished between the check and the claim
        folder = procs.private_dir(state_dir())
        deployment = procs.new_deployment_id()
        procs.write_marker(folder, deployment, services_file=str(services_file_path().resolve()))
        secret_files = _make_secrets(folder) if cfg.auth else {}
        secrets = {name: procs.read_secret(path) for name, path in secret_files.items()}
        deadline = time.monotonic() + cfg.timeout_s
        tls_dir = folder / SECRETS_DIR / REDIS_TLS_DIR
        spec = redis_cluster.ClusterSpec(
            nodes=1 if cfg.single else cfg.nodes, replicas=cfg.replicas_per_master, port=cfg.redis_port,
            host=cfg.host, announce_ip=cfg.announce_ip, maxmemory=cfg.maxmemory,
            password=secrets.get("redis_password", ""), cluster=not cfg.single, bus_tls=cfg.bus_tls,
            client_tls=cfg.bus_tls, service_hosts=[cfg.client_host] if cfg.bus_tls else None,
            tls_dir=tls_dir, state_root=folder, timeout_s=cfg.timeout_s, deployment=deployment,
        )
        cluster = redis_cluster.start_cluster(spec)
        proc: subprocess.Popen[bytes] | None = None
        try:
            tls = client_tls(tls_dir) if cfg.bus_tls else None
            proc = start_autotune(cfg, redis_state_url(cfg.client_host, cfg.redis_port), folder, deployment, secrets,
                                  tls_dir if tls is not None else None)
            autotune = procs.record(proc.pid, deployment)
            wait_healthy(lambda: check_autotune(cfg.autotune_address, token=secrets.get("autotune_token"),
                                                tls_ca=Path(tls.ca) if tls else None),
                         deadline, f"the autotune service on {cfg.autotune_address}", proc, folder / AUTOTUNE_LOG)
            info = ServicesInfo(
                autotune=cfg.autotune_address, redis_hosts=cluster.hosts, redis_cluster=cluster.cluster,
                redis_node_ids=cluster.node_ids, state_dir=str(folder), deployment=deployment, secrets=secret_files,
                processes={"autotune": [autotune], "redis": cluster.processes}, tls=tls,
            )
            write_services_file(info)
            return info
        except BaseException:
            if proc is not None:
                procs.stop_child(proc)
            redis_cluster.stop_cluster(cfg.redis_port, folder)
            raise


def _make_secrets(folder: Path) -> dict[str, str]:
    """The secret files of a new deployment: the environment's value when set, else a random one."""
    out = {}
    for name, (filename, env) in SECRETS.items():
        path = folder / SECRETS_DIR / filename
        value = os.environ.get(env)
        if value:
            procs.write_private(path, value)
        else:
            procs.new_secret_file(path)
        out[name] = str(path)
    return out


def ensure_up(cfg: UpConfig | None = None) -> ServicesInfo:
    """The recorded services when they are healthy, whatever their settings; else :func:`up` with ``cfg``.

    For callers that only need services to exist (the demo), not particular ports.
    """
    with _exclusive():
        existing = _healthy_existing()
        return existing if existing is not None else _up(cfg or UpConfig())


def _differences(info: ServicesInfo, cfg: UpConfig) -> list[str]:
    found = []
    if info.autotune != cfg.autotune_address:
        found.append(f"autotune on {info.autotune}, asked {cfg.autotune_address}")
    first = info.redis_hosts[0] if info.redis_hosts else {}
    if (first.get("host"), first.get("port")) != (cfg.client_host, cfg.redis_port):
        found.append(f"Redis from {first.get('host')}:{first.get('port')}, asked {cfg.client_host}:{cfg.redis_port}")
    if info.redis_cluster == cfg.single:
        found.append("a cluster, asked --single" if info.redis_cluster else "--single, asked a cluster")
    nodes = len(info.processes.get("redis") or [])
    if nodes and nodes != cfg.redis_node_count:
        found.append(f"{nodes} Redis nodes, asked {cfg.redis_node_count}")
    return found


def down(timeout_s: float = 10.0, local: bool = True) -> list[int]:
    """Stop what the services file records (and, with ``local``, the node-local cache server); remove the
    file; return the pids stopped.

    Raises:
        ServicesFileError: the services file is malformed (nothing is stopped or removed).
        ConfigurationError: the file's state folder is a copy or another deployment's (idem).
    """
    with _exclusive():
        stopped = _down(timeout_s)
    if local:
        from ..core.local_redis import stop_server

        stopped += stop_server(timeout_s=timeout_s)
    return sorted(set(stopped))


def _down(timeout_s: float = 10.0) -> list[int]:
    from . import redis_cluster

    path = services_file_path()
    info = read_services_file()
    if info is None:
        return []
    root = Path(info.state_dir) if info.state_dir else None
    marker = procs.read_marker(root) if root is not None else None
    records = [r for rs in info.processes.values() for r in rs]
    # Only a state folder whose marker names this deployment and this very services file proves that the
    # recorded processes are ours to stop. Without that proof (a copied or edited file, a state_dir that
    # points elsewhere or nowhere), nothing is signalled; a file whose processes are all gone is just removed.
    own = (root is not None and marker is not None and marker.get("deployment") == info.deployment
           and marker.get("services_file") == str(path.resolve())
           and all(r.deployment == info.deployment for r in records))
    if not own or root is None:
        if any(procs.is_running(r) for r in records):
            raise ConfigurationError(
                f"services file {path} records deployment {info.deployment} in {root or 'no state folder'}, "
                "but that folder is not its own (a copy, another deployment's, or missing); nothing was "
                f"stopped. If its services are gone, delete {path}."
            )
        remove_services_file(path)
        return []
    stopped = [r.pid for r in records if procs.stop(r, timeout_s)]
    if info.redis_hosts:
        port = int(info.redis_hosts[0]["port"])
        for cluster in redis_cluster.read_deployments(root, port):
            if cluster.deployment == info.deployment:
                stopped += redis_cluster.stop_deployment(cluster, timeout_s=timeout_s)
    remove_services_file(path)
    for secret in info.secrets.values():
        if Path(secret).parent == root / SECRETS_DIR:
            Path(secret).unlink(missing_ok=True)
    remove_tls_dir(root / SECRETS_DIR / REDIS_TLS_DIR)
    (root / procs.MARKER_FILE).unlink(missing_ok=True)
    return sorted(set(stopped))


def _require_free_ports(cfg: UpConfig) -> list[int]:
    """Fail early, naming the port and the flag, instead of finding a foreign server healthy."""
    wanted = [("--autotune-port", cfg.autotune_port)]
    for i in range(cfg.redis_node_count):
        wanted.append(("--redis-port", cfg.redis_port + i))
        if not cfg.single:
            wanted.append((f"--redis-port (cluster bus, port + {BUS_PORT_OFFSET})",
                           cfg.redis_port + i + BUS_PORT_OFFSET))
    for flag, port in wanted:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # Like the servers themselves: a port in TIME_WAIT is free, a listening one is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((cfg.host, port))
            except OSError as exc:
                raise ConfigurationError(
                    f"port {port} on {cfg.host} is not free ({exc.strerror}); stop what uses it "
                    f"(`bagua-lightning down`, `bagua-lightning redis down`) or pick another {flag}."
                ) from exc
    return [port for _, port in wanted]
