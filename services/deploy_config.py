"""What ``bagua-lightning up`` starts: its settings (:class:`UpConfig`), the ports a deployment listens on, the
files it keeps in its state folder, and the autotune service's command line.

No processes, no network here: :mod:`.deploy` starts and stops, :mod:`.deploy_ports` claims the ports,
:mod:`.deploy_recovery` restarts what died.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.addresses import check_host, check_port, format_address, is_loopback, parse_address
from ..core.errors import ConfigurationError
from ..core.redis_server import BUS_PORT_OFFSET, read_port_offset
from ..core.services_file import (
    DEFAULT_AUTOTUNE_ADDRESS,
    DEFAULT_LIGHTHOUSE_ADDRESS,
    ENV_AUTOTUNE_TOKEN,
    ENV_CACHE_KEY,
    ENV_REDIS_PASSWORD,
)
from .addresses import WILDCARDS, machine_address, resolve_host

DEFAULT_HOST = "127.0.0.1"
DEFAULT_AUTOTUNE_PORT = parse_address(DEFAULT_AUTOTUNE_ADDRESS)[1]
DEFAULT_LIGHTHOUSE_PORT = parse_address(DEFAULT_LIGHTHOUSE_ADDRESS)[1]
DEFAULT_REDIS_PORT = 7000  # first node of the local cluster, when it is free; the trainer's documented default
DEFAULT_MAXMEMORY = 1024**3  # bytes per Redis node; docker-compose.yml uses the same default ("1gb")
AUTOTUNE_LOG = "autotune.log"
LIGHTHOUSE_LOG = "lighthouse.log"
AUTOTUNE_SAMPLES = "autotune-samples"  # folder of the service's per-model sample logs
AUTOTUNE_PLANS = "autotune-plans"  # folder mirroring the plans kept in Redis (survives a node restarted empty)
SECRETS_DIR = "secrets"
REDIS_TLS_DIR = "redis-tls"  # under SECRETS_DIR: the bus CA certificate and the node keys and certificates
# secret name in the services file -> (file name in <state_dir>/secrets, environment variable that overrides it)
SECRETS = {"redis_password": ("redis-password", ENV_REDIS_PASSWORD),
           "autotune_token": ("autotune-token", ENV_AUTOTUNE_TOKEN),
           "cache_key": ("cache-key", ENV_CACHE_KEY)}


def autotune_service_args(*, host: str, port: int, state: str, log_dir: str, mirror: str | None = None,
                          tls_cert: str | None = None, tls_key: str | None = None,
                          token_file: str | None = None) -> list[str]:
    """The autotune service's arguments after the program name (``bagua-lightning``).

    The single source of truth for how the service is run: ``up`` prefixes it with
    ``python -m bagua_lightning.cli``; ``docker-compose.yml`` uses it as the ``command`` of the image
    whose entrypoint is ``bagua-lightning`` (with ``host="0.0.0.0"``, so that published ports reach it).

    Args:
        host: address to bind (an IPv6 address bare or in brackets; the service writes ``host:port`` itself).
        port: gRPC port.
        state: where persisted plans live: a directory or a ``redis://host:port`` URL.
        log_dir: folder for the per-model JSONL log of every tuning sample.
        mirror: a second ``--state`` (a directory) that every plan is also written to; None: ``state`` only.
        tls_cert: PEM certificate of the service (with ``tls_key``): it listens with TLS only; None: plaintext.
        tls_key: PEM private key of ``tls_cert``.
        token_file: the file holding the bearer token every call must carry (a path: the token itself is
            never on a command line or in an environment); None: none (or ``$BAGUA_LIGHTNING_AUTOTUNE_TOKEN``).
    """
    host = check_host(host)
    tls = ["--tls-cert", tls_cert, "--tls-key", tls_key] if tls_cert and tls_key else []
    states = ["--state", state, *(["--state", mirror] if mirror else [])]
    token = ["--token-file", token_file] if token_file else []
    return ["autotune", "serve", "--host", host, "--port", str(port), *states, "--log-dir", log_dir, *token, *tls]


def lighthouse_args(*, host: str, port: int) -> list[str]:
    """The fault-tolerance coordinator's arguments after the program name (``bagua-lightning``): what ``up``
    runs (prefixed with ``python -m bagua_lightning.cli``) and ``docker-compose.yml``'s ``lighthouse`` command
    (with ``host="0.0.0.0"``; a test compares them)."""
    return ["lighthouse", "--host", check_host(host), "--port", str(port)]


def lighthouse_warning(host: str, port: int) -> str | None:
    """One line saying what the Lighthouse exposes when it listens beyond loopback; None on loopback."""
    if is_loopback(host):
        return None
    return (f"--host {host}: the fault-tolerance coordinator (torchft's Lighthouse, port {port}) has no credentials "
            "and no TLS in torchft 0.2.0: whoever reaches it can join, stall or end a job's quorum, and its "
            "dashboard's kill button ends a node's trainer; keep it on loopback or a private network.")


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
        autotune_port: gRPC port of the autotune service; None: the recorded one, else 29600 when free, else
            a free one (:mod:`.deploy_ports`).
        lighthouse_port: port of the fault-tolerance coordinator (``bagua-lightning lighthouse``, torchft's
            Lighthouse); None: the recorded one, else 29510 when free, else a free one below 29600.
        lighthouse: start the Lighthouse (on ``host``; it has no credentials or TLS, so ``up`` warns beyond
            loopback); False: none (``up --no-lighthouse``).
        redis_port: first Redis port; cluster node i listens on ``redis_port + i`` (bus: ``+ 10000``; with
            TLS the node's port is its TLS port; without, TLS is off altogether). None: the recorded one,
            else 7000 when all of its ports are free, else the first free block.
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
        read_ports: with client TLS and ``auth``, give every Redis node its plaintext read port for sealed
            entries (:mod:`bagua_lightning.core.read_plane`); False: none (``up --no-read-ports``).
    """

    host: str = DEFAULT_HOST
    announce_ip: str | None = None
    autotune_port: int | None = None
    redis_port: int | None = None
    lighthouse_port: int | None = None
    lighthouse: bool = True
    nodes: int = 3
    replicas: int | None = None
    bus_tls: bool = True
    single: bool = False
    maxmemory: int = DEFAULT_MAXMEMORY
    timeout_s: float = 60.0
    auth: bool = True
    read_ports: bool = True

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
        if self.autotune_port is not None:
            check_port(self.autotune_port, "autotune_port")
        if self.lighthouse_port is not None:
            check_port(self.lighthouse_port, "lighthouse_port")
        if self.redis_port is not None:
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
        if self.autotune_port is not None and self.redis_port is not None:
            redis_ports = range(self.redis_port, self.redis_port + self.redis_node_count)
            if self.autotune_port in redis_ports:
                raise ConfigurationError(
                    f"autotune_port {self.autotune_port} collides with the Redis ports {redis_ports.start}.."
                    f"{redis_ports.stop - 1}; pick another --autotune-port or --redis-port."
                )
        if self.lighthouse_port is not None:
            taken = {self.autotune_port: "--autotune-port"} if self.autotune_port is not None else {}
            if self.redis_port is not None:
                taken.update((p, flag) for flag, p in _redis_ports(self, self.redis_port))
            if self.lighthouse_port in taken:
                raise ConfigurationError(f"lighthouse_port {self.lighthouse_port} collides with a port of "
                                         f"{taken[self.lighthouse_port]}; pick another --lighthouse-port.")
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
    def ports_chosen(self) -> bool:
        """True once every port is set (named, recorded or picked)."""
        return (self.autotune_port is not None and self.redis_port is not None
                and (self.lighthouse_port is not None or not self.lighthouse))

    @property
    def autotune_address(self) -> str:
        """``host:port`` clients are given; before a port is chosen, the default port's."""
        return format_address(self.client_host, self.autotune_port or DEFAULT_AUTOTUNE_PORT)

    @property
    def lighthouse_address(self) -> str:
        """``host:port`` trainers are given for the Lighthouse (``http://`` + this in ``TORCHFT_LIGHTHOUSE``)."""
        return format_address(self.client_host, self.lighthouse_port or DEFAULT_LIGHTHOUSE_PORT)

    @property
    def read_port_offset(self) -> int | None:
        """Offset of the Redis nodes' plaintext read ports (:mod:`bagua_lightning.core.read_plane`): with client
        TLS (``bus_tls``), a password (``auth``) and ``read_ports``, +20000 (-20000 where that passes 65535);
        else None."""
        return self.read_port_offset_from(self.first_redis_port)

    def read_port_offset_from(self, redis_port: int) -> int | None:
        """:attr:`read_port_offset` of the deployment whose first Redis port is ``redis_port``."""
        return (read_port_offset(redis_port, self.redis_node_count) if self.bus_tls and self.auth and self.read_ports
                else None)

    @property
    def first_redis_port(self) -> int:
        """The first Redis port; before one is chosen, the default."""
        return self.redis_port or DEFAULT_REDIS_PORT

    def with_ports(self, autotune_port: int, redis_port: int, lighthouse_port: int | None = None) -> UpConfig:
        """A copy with these ports set (validated again); ``lighthouse_port`` None keeps this one's."""
        return dataclasses.replace(self, autotune_port=autotune_port, redis_port=redis_port,
                                   lighthouse_port=self.lighthouse_port if lighthouse_port is None else lighthouse_port)


def deployment_ports(cfg: UpConfig, autotune_port: int, redis_port: int) -> list[tuple[str, int]]:
    """Every port a deployment with these first ports listens on, each with the flag that moves it:
    the autotune port, the Lighthouse's (``cfg``'s, else its default), the Redis client ports (TLS ports too
    when TLS is on), for a cluster their bus ports (+10000) and, with client TLS and a password, their
    plaintext read ports (+/-20000)."""
    wanted = [("--autotune-port", autotune_port)]
    if cfg.lighthouse:
        wanted.append(("--lighthouse-port", cfg.lighthouse_port or DEFAULT_LIGHTHOUSE_PORT))
    return wanted + _redis_ports(cfg, redis_port)


def _redis_ports(cfg: UpConfig, redis_port: int) -> list[tuple[str, int]]:
    wanted: list[tuple[str, int]] = []
    offset = cfg.read_port_offset_from(redis_port)
    for i in range(cfg.redis_node_count):
        wanted.append(("--redis-port", redis_port + i))
        if not cfg.single:
            wanted.append((f"--redis-port (cluster bus, port + {BUS_PORT_OFFSET})", redis_port + i + BUS_PORT_OFFSET))
        if offset is not None:
            wanted.append((f"--redis-port (read port, port {offset:+d})", redis_port + i + offset))
    return wanted
