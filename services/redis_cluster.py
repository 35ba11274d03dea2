"""Local Redis deployments from real ``redis-server`` processes: a Redis Cluster or standalone servers.

Plain Python, no torch: ``bagua-lightning redis up|down|status`` and ``bagua-lightning up`` drive it. The
processes themselves are :mod:`bagua_lightning.core.redis_server`'s; the records of a deployment (its folder,
``deployment.json``, the marker, status) are :mod:`.redis_records`'. Servers run detached in their own
session, so they outlive the command that started them, and are stopped only when pid, start time and
deployment id all match their record.

For ``up`` and ``redis up`` the cluster bus and replication run over mutual TLS with the deployment's own CA
(:mod:`.redis_tls`), so only the deployment's nodes can join. With ``client_tls`` (``up``'s default) the
client ports speak TLS only (the plain port is closed; ``CLUSTER SLOTS`` and ``MOVED`` give a TLS client the
TLS ports) and clients verify each node against the deployment's CA before sending the password; without
(``redis up``), clients keep the plain, password-protected ports (``CLUSTER SLOTS``/``CLUSTER NODES`` give a
plain-port client the plain ports). With ``read_port_offset`` (``up``'s default) each node's one plaintext
port is its read port, for the password-less reader of :mod:`bagua_lightning.core.read_plane` alone. The
node ids are recorded at creation, so ``status`` can name a node that is not the deployment's.

The cluster is created with the commands ``redis-cli --cluster create`` uses (CLUSTER MEET, ADDSLOTSRANGE,
REPLICATE), issued from Python so one master and uneven counts work too; start-up waits, with a deadline,
until every node reports ``cluster_state:ok`` with all 16384 slots assigned and every replica is linked.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ..core import procs
from ..core.errors import ConfigurationError
from ..core.redis_server import (
    BUS_PORT_OFFSET,
    CLUSTER_SLOTS,
    DEFAULT_EVICTION_POLICY,
    DEFAULT_NODE_TIMEOUT_MS,
    MAX_CLUSTER_PORT,
    NodeConfig,
    check_reader,
    client_for,
    cluster_info,
    is_redis_pid,
    launch_node,
    stop_pid,
    tls_port,
    wait_ready,
)
from ..core.services_file import ENV_REDIS_PASSWORD
from .redis_records import (
    PASSWORD_FILE,
    ClusterInfo,
    NodeInfo,
    cluster_status,
    deployment_dir,
    read_deployments,
    stop_deployment,
    write_deployment,
)
from .redis_tls import client_tls, make_node_certificates, remove_tls_dir

__all__ = ["DEFAULT_EVICTION_POLICY", "DEFAULT_PORT", "ClusterInfo", "ClusterSpec", "NodeConfig", "NodeInfo",
           "cluster_status", "is_redis_pid", "read_deployments", "running_cluster", "start_cluster",
           "stop_cluster", "stop_pid"]

DEFAULT_PORT = 7000
# While a cluster forms, nodes answer with errors (e.g. CLUSTERDOWN) before they agree: keep polling.
_FORMING = (redis.RedisError, OSError)


@dataclass(kw_only=True)
class ClusterSpec:
    """What to start.

    Attributes:
        nodes: number of masters (or of standalone servers with ``cluster=False``).
        replicas: replicas per master (0 or more); needs ``cluster=True``.
        port: first port; node i listens on ``port + i`` (replicas after the masters).
        host: bind address (loopback by default).
        maxmemory: per-node byte limit, 0 for none.
        password: ``requirepass`` for every node; None reads ``BAGUA_LIGHTNING_REDIS_PASSWORD`` (and no
            password when that is unset). It is kept in the deployment's 0600 ``password`` file.
        cluster: a Redis Cluster (True) or independent standalone servers (False).
        node_timeout_ms: failover detection time of the cluster, in milliseconds.
        bus_tls: run the cluster bus and replication over mutual TLS with a fresh CA of this deployment
            (only its nodes can join; the TLS ports, :func:`~bagua_lightning.core.redis_server.tls_port`, must
            be free too). False: a plain bus,
            which any local process can join: the default of this library call for throw-away test
            clusters only; ``bagua-lightning up`` and ``redis up`` always ask for TLS.
        client_tls: the nodes serve clients over TLS only, each node's port being its TLS port (implies
            TLS on the bus and replication); a client certificate is made for trainers.
        read_port_offset: with ``client_tls`` and a password: every node also listens on port + this offset
            in plaintext, for the password-less read-only user (:mod:`bagua_lightning.core.read_plane`;
            :func:`~bagua_lightning.core.redis_server.read_port_offset` picks it); None: no read port.
        service_hosts: also make the autotune service's server certificate for these addresses, with the
            same CA (whose key is deleted after); None: none.
        tls_dir: where the CA certificate and the node keys and certificates go (made 0700); None: the
            deployment folder's ``tls``.
        announce_ip: the address nodes give each other and clients (``cluster-announce-ip``); required
            when ``host`` is a wildcard (0.0.0.0, ::); None: ``host``.
        state_root: the state folder; None: ``bagua_lightning.core.services_file.state_dir()``.
        timeout_s: deadline for the whole start-up.
        deployment: the id the processes carry; None: a fresh one.
        persist: every node keeps its data in an append-only file, so that a node restarted from its folder
            (``up`` after a crash or a reboot) comes back with it (:class:`NodeConfig`'s ``persist``).
    """

    nodes: int = 3
    replicas: int = 0
    port: int = DEFAULT_PORT
    host: str = "127.0.0.1"
    maxmemory: int = 0
    password: str | None = None
    cluster: bool = True
    node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS
    bus_tls: bool = False
    client_tls: bool = False
    read_port_offset: int | None = None
    service_hosts: list[str] | None = None
    tls_dir: Path | None = None
    announce_ip: str | None = None
    state_root: Path | None = None
    timeout_s: float = 60.0
    deployment: str | None = None
    persist: bool = False

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigurationError(f"nodes={self.nodes}: at least one node is needed.")
        if self.replicas < 0:
            raise ConfigurationError(f"replicas={self.replicas} is negative; use 0 or more.")
        if self.replicas and not self.cluster:
            raise ConfigurationError(f"replicas={self.replicas} needs a cluster; drop --single or use --replicas 0.")
        total = self.nodes * (1 + self.replicas)
        limit = MAX_CLUSTER_PORT if self.cluster else 65535
        if isinstance(self.port, bool) or not isinstance(self.port, int) or self.port < 1 \
                or self.port + total - 1 > limit:
            raise ConfigurationError(
                f"ports {self.port}..{self.port + total - 1} are not all in 1..{limit}"
                + (f" (cluster bus = port + {BUS_PORT_OFFSET})" if self.cluster else "") + "; pick another --port."
            )
        if self.announce_ip in ("0.0.0.0", "::") or (self.announce_ip is None and self.host in ("0.0.0.0", "::")):
            raise ConfigurationError(f"host {self.host} binds every interface: give --announce-ip, an address of "
                                     f"this machine that clients and the other nodes can reach.")
        if self.password is None:
            self.password = os.environ.get(ENV_REDIS_PASSWORD) or None
        if self.read_port_offset is not None and not (self.client_tls and self.password):
            raise ConfigurationError(f"read_port_offset={self.read_port_offset} needs client TLS and a password "
                                     "(the read port is the only plaintext port; its reader needs none).")
        if self.deployment is None:
            self.deployment = procs.new_deployment_id()

    @property
    def total_nodes(self) -> int:
        return self.nodes * (1 + self.replicas)

    @property
    def tls(self) -> bool:
        """True when the nodes speak TLS: the cluster bus (a cluster with ``bus_tls``) or the client ports."""
        return (self.cluster and self.bus_tls) or self.client_tls

    @property
    def ports(self) -> list[int]:
        """Every port the deployment listens on: clients', and for a cluster the bus and TLS ports, and the
        read ports."""
        out = []
        for port in range(self.port, self.port + self.total_nodes):
            out += [port, *([port + BUS_PORT_OFFSET] if self.cluster else []),
                    *([tls_port(port)] if self.tls and not self.client_tls else []),
                    *([port + self.read_port_offset] if self.read_port_offset is not None else [])]
        return out

    def read_port(self, port: int) -> int | None:
        """The read port of the node on ``port``; None without read ports."""
        return None if self.read_port_offset is None else port + self.read_port_offset


def start_cluster(spec: ClusterSpec | None = None, **kwargs: Any) -> ClusterInfo:
    """Start a local Redis Cluster (or standalone servers) and wait until it serves every slot.

    Args:
        spec: what to start; or give its fields as keyword arguments.

    Returns:
        The started deployment; it is also recorded in ``<state_dir>/redis/<port>/deployment.json``.

    Raises:
        ConfigurationError: bad spec, or a live deployment already uses that port.
        ServiceUnavailableError: a server did not come up or the cluster did not converge in time;
            everything started is stopped again before raising.
    """
    spec = spec if spec is not None else ClusterSpec(**kwargs)
    deployment = str(spec.deployment)
    folder = deployment_dir(spec.port, spec.state_root)
    for old in read_deployments(spec.state_root, spec.port):
        if any(n.running for n in old.nodes):
            raise ConfigurationError(
                f"a Redis deployment on port {spec.port} is already running (state in {folder}); "
                "stop it with `bagua-lightning redis down` or pick another --port."
            )
        procs.remove_tree(old.state_dir, old.deployment)
    procs.private_dir(folder)
    procs.write_marker(folder, deployment)
    password_file = str(procs.write_private(folder / PASSWORD_FILE, spec.password)) if spec.password else None
    started: list[tuple[subprocess.Popen[bytes], NodeInfo]] = []
    address = spec.announce_ip or spec.host
    ports = list(range(spec.port, spec.port + spec.total_nodes))
    tls_dir = spec.tls_dir or folder / "tls"
    try:
        certificates = make_node_certificates(tls_dir, ports, [address], clients=spec.client_tls,
                                              service_hosts=spec.service_hosts) if spec.tls else {}
        tls = client_tls(tls_dir) if spec.client_tls else None
        for i, port in enumerate(ports):
            cfg = NodeConfig(port=port, host=spec.host, data_dir=folder / f"node-{port}", cluster=spec.cluster,
                             maxmemory=spec.maxmemory, password=spec.password, deployment=deployment,
                             node_timeout_ms=spec.node_timeout_ms, tls=certificates.get(port),
                             announce_ip=spec.announce_ip if spec.cluster else None, read_port=spec.read_port(port),
                             persist=spec.persist)
            proc = launch_node(cfg)
            role = ("master" if i < spec.nodes else "replica") if spec.cluster else "standalone"
            started.append((proc, NodeInfo(host=address, port=port, role=role,
                                           process=procs.record(proc.pid, deployment))))
        deadline = time.monotonic() + spec.timeout_s
        for proc, node in started:
            wait_ready(node.host, node.port, spec.password, proc, timeout_s=max(1.0, deadline - time.monotonic()),
                       tls=tls)
            read_port = spec.read_port(node.port)
            if read_port is not None:
                check_reader(node.host, read_port)
        info = ClusterInfo(nodes=[n for _, n in started], cluster=spec.cluster, replicas=spec.replicas,
                           state_dir=folder, deployment=deployment, maxmemory=spec.maxmemory,
                           password_file=password_file, tls_dir=str(tls_dir) if spec.tls else None,
                           read_port_offset=spec.read_port_offset)
        if spec.cluster:
            _create_cluster(info, spec.password, deadline, tls)
        write_deployment(info)
        return info
    except BaseException:
        for proc, _ in started:
            procs.stop_child(proc)
        procs.remove_tree(folder, deployment)
        if spec.tls and spec.tls_dir is not None:
            remove_tls_dir(spec.tls_dir)
        raise


def _create_cluster(info: ClusterInfo, password: str | None, deadline: float, tls: Any = None) -> None:
    masters = info.masters
    replicas = [n for n in info.nodes if n.role == "replica"]
    clients = {n.port: client_for(n.host, n.port, password, tls=tls) for n in info.nodes}
    try:
        ids = {port: c.execute_command("CLUSTER MYID").decode() for port, c in clients.items()}
        for n in info.nodes:
            n.node_id = ids[n.port]
        first = info.nodes[0]
        for n in info.nodes[1:]:
            clients[n.port].execute_command("CLUSTER MEET", first.host, first.port)
        # Same split as redis-cli --cluster create: contiguous, near-equal ranges.
        per = CLUSTER_SLOTS / len(masters)
        for i, m in enumerate(masters):
            lo, hi = round(i * per), round((i + 1) * per) - 1
            clients[m.port].execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)

        def everyone_knows_everyone() -> bool:
            for c in clients.values():
                known = c.execute_command("CLUSTER NODES")  # parsed: {"host:port": {"flags": ...}}
                if len(known) != len(info.nodes) or any("handshake" in str(v.get("flags")) for v in known.values()):
                    return False
            return True
        procs.poll(everyone_knows_everyone, deadline - time.monotonic(), "cluster nodes to meet", _FORMING)
        for j, r in enumerate(replicas):
            master = masters[j % len(masters)]
            clients[r.port].execute_command("CLUSTER REPLICATE", ids[master.port])

        def converged() -> bool:
            for n in info.nodes:
                fields = cluster_info(clients[n.port])
                if fields.get("cluster_state") != "ok" or fields.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                    return False
            for r in replicas:
                repl = clients[r.port].info("replication")
                if repl.get("role") != "slave" or repl.get("master_link_status") != "up":
                    return False
            return True
        procs.poll(converged, deadline - time.monotonic(), f"all {CLUSTER_SLOTS} slots to be served", _FORMING)
    finally:
        for c in clients.values():
            c.close()


def stop_cluster(port: int | None = None, state_root: Path | None = None, remove_data: bool = True,
                 timeout_s: float = 10.0) -> list[int]:
    """Stop the deployment with base ``port`` (all recorded ones when None); return the stopped pids.

    Only processes whose pid, start time and deployment id match the record are signalled, and only
    folders carrying the deployment's own marker are removed.
    """
    stopped: list[int] = []
    for info in read_deployments(state_root, port):
        stopped += stop_deployment(info, remove_data, timeout_s)
    return stopped


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec | None = None, **kwargs: Any) -> Iterator[ClusterInfo]:
    """:func:`start_cluster` for the duration of a block; always stopped (and its data removed) after."""
    spec = spec if spec is not None else ClusterSpec(**kwargs)
    info = start_cluster(spec)
    try:
        yield info
    finally:
        stop_cluster(spec.port, spec.state_root)
