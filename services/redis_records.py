"""The records of local Redis deployments: where they live, who their processes are, how they are doing.

A deployment with base port P lives in ``<state_dir>/redis/P/``: one folder per node (``redis.conf``,
``nodes.conf``, ``redis.log``), ``deployment.json`` (ports, process records, roles, the path of the
password file; never the password) and the deployment's marker (:mod:`bagua_lightning.core.procs`). A record is
trusted only when its folder's marker names it and this very folder, so a copied state folder is inert.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ..core import procs
from ..core.addresses import format_address
from ..core.procs import ProcessRecord
from ..core.redis_server import client_for, cluster_info
from ..core.services_file import state_dir
from ..core.tls_trust import ClientTLS
from .redis_tls import client_tls, remove_tls_dir

DEPLOYMENT_FILE = "deployment.json"
PASSWORD_FILE = "password"


@dataclass(kw_only=True)
class NodeInfo:
    """One started node: where clients reach it, its process, its role (``master``, ``replica``,
    ``standalone``) and, in a cluster, the node id it had when the cluster was created."""

    host: str
    port: int
    process: ProcessRecord
    role: str
    node_id: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        """True while the recorded process (pid, start time, deployment id) still runs."""
        return procs.is_running(self.process)


@dataclass(kw_only=True)
class ClusterInfo:
    """What :func:`~bagua_lightning.services.redis_cluster.start_cluster` started.

    Attributes:
        nodes: every node, masters first.
        cluster: True for a Redis Cluster, False for independent standalone servers.
        replicas: replicas per master.
        state_dir: the deployment's folder (``<state_dir>/redis/<port>``).
        deployment: the id its processes and its folder's marker carry.
        maxmemory: per-node byte limit (0: none).
        password_file: the 0600 file holding the password; None when the nodes have none.
        tls_dir: the folder of the bus certificates (CA certificate, node keys); None: a plain bus.
        read_port_offset: each node's plaintext read port is its port + this (the reader user's,
            :mod:`bagua_lightning.core.read_plane`); None: no read ports.
    """

    nodes: list[NodeInfo]
    cluster: bool
    replicas: int = 0
    state_dir: Path
    deployment: str
    maxmemory: int = 0
    password_file: str | None = None
    tls_dir: str | None = None
    read_port_offset: int | None = None

    @property
    def node_ids(self) -> list[str]:
        """The cluster node ids recorded at creation (empty for standalone servers)."""
        return [n.node_id for n in self.nodes if n.node_id]

    @property
    def password_set(self) -> bool:
        return self.password_file is not None

    def client_tls(self) -> ClientTLS | None:
        """How a client reaches the nodes: their CA and the client certificate when they serve TLS, else None."""
        return client_tls(Path(self.tls_dir)) if self.tls_dir else None

    def password(self) -> str | None:
        """The nodes' password, read from its file (None when they have none)."""
        return procs.read_secret(self.password_file) if self.password_file else None

    @property
    def masters(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.role != "replica"]

    @property
    def hosts(self) -> list[dict[str, Any]]:
        """``[{"host", "port"}, ...]`` for :class:`~bagua_lightning.client.RedisStore` (masters only)."""
        return [{"host": n.host, "port": n.port} for n in self.masters]

    @property
    def hosts_string(self) -> str:
        """``host:port,host:port`` as ``BAGUA_LIGHTNING_REDIS_HOSTS`` expects it."""
        return ",".join(format_address(n.host, n.port) for n in self.masters)

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes]

    @property
    def processes(self) -> list[ProcessRecord]:
        return [n.process for n in self.nodes]

    def to_json(self) -> dict[str, Any]:
        return {"nodes": [{"host": n.host, "port": n.port, "role": n.role, "node_id": n.node_id,
                           "process": n.process.to_json()} for n in self.nodes],
                "cluster": self.cluster, "replicas": self.replicas, "deployment": self.deployment,
                "maxmemory": self.maxmemory, "password_file": self.password_file, "tls_dir": self.tls_dir,
                "read_port_offset": self.read_port_offset}

    @classmethod
    def from_json(cls, data: dict[str, Any], folder: Path) -> ClusterInfo:
        return cls(
            nodes=[NodeInfo(host=str(n["host"]), port=int(n["port"]), role=str(n["role"]),
                            node_id=str(n.get("node_id") or ""), process=ProcessRecord.from_json(n["process"]))
                   for n in data["nodes"]],
            cluster=bool(data["cluster"]),
            replicas=int(data.get("replicas", 0)),
            state_dir=folder,
            deployment=str(data["deployment"]),
            maxmemory=int(data.get("maxmemory", 0)),
            password_file=data.get("password_file"),
            tls_dir=data.get("tls_dir"),
            read_port_offset=int(data["read_port_offset"]) if data.get("read_port_offset") is not None else None,
        )


def deployment_dir(port: int, state_root: Path | None = None) -> Path:
    return (state_root or state_dir()) / "redis" / str(port)


def write_deployment(info: ClusterInfo) -> None:
    procs.write_private(info.state_dir / DEPLOYMENT_FILE, json.dumps(info.to_json(), indent=2))


def read_deployments(state_root: Path | None = None, port: int | None = None) -> list[ClusterInfo]:
    """Deployments recorded under the state folder (all, or the one with base ``port``).

    Only folders whose marker names the recorded deployment and this very folder count: a copy of another
    deployment's folder is skipped (with a warning), so nothing is done to the original's processes.
    """
    base = (state_root or state_dir()) / "redis"
    dirs = [base / str(port)] if port is not None else sorted(base.glob("*")) if base.is_dir() else []
    found = []
    for d in dirs:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, RecursionError):
            info = ClusterInfo.from_json(json.loads((d / DEPLOYMENT_FILE).read_text()), d)
            if procs.owns(d, info.deployment):
                found.append(info)
            else:
                procs.log.warning("ignoring %s: it is a copy of another deployment's folder or lacks its "
                                  "marker; its processes are left alone", d)
    return found


def stop_deployment(info: ClusterInfo, remove_data: bool = True, timeout_s: float = 10.0) -> list[int]:
    """Stop the nodes of ``info`` that are still its own processes; remove its folder; return stopped pids."""
    stopped = [n.pid for n in info.nodes if procs.stop(n.process, timeout_s)]
    if remove_data:
        procs.remove_tree(info.state_dir, info.deployment)
        if info.tls_dir:
            remove_tls_dir(Path(info.tls_dir))
    return stopped


def node_status(node: NodeInfo, password: str | None, tls: ClientTLS | None = None) -> dict[str, Any]:
    """Liveness, role, key count and memory of one node."""
    status: dict[str, Any] = {"host": node.host, "port": node.port, "pid": node.pid, "role": node.role,
                              "process": node.running}
    try:
        with client_for(node.host, node.port, password, timeout_s=1.0, tls=tls) as c:
            status["keys"] = int(c.dbsize())
            status["used_memory"] = int(c.info("memory").get("used_memory", 0))
            if node.role != "standalone":
                status["role"] = {"slave": "replica", "master": "master"}.get(c.info("replication").get("role"), node.role)
            status["up"] = True
    except (redis.RedisError, OSError) as exc:
        status["up"] = False
        status["error"] = str(exc)
    return status


def cluster_status(port: int | None = None, state_root: Path | None = None,
                   password: str | None = None) -> list[dict[str, Any]]:
    """One dict per recorded deployment: its nodes' status and, for a cluster, its state and slots.

    ``password`` overrides the deployment's own password file.
    """
    out = []
    for info in read_deployments(state_root, port):
        secret = password if password is not None else info.password()
        entry: dict[str, Any] = {"port": info.nodes[0].port if info.nodes else None, "cluster": info.cluster,
                                 "hosts": info.hosts_string, "state_dir": str(info.state_dir),
                                 "password_file": info.password_file,
                                 "nodes": [node_status(n, secret, info.client_tls()) for n in info.nodes]}
        if info.cluster:
            entry["cluster_state"] = "down"
            for n in info.masters:
                try:
                    with client_for(n.host, n.port, secret, timeout_s=1.0, tls=info.client_tls()) as c:
                        fields = cluster_info(c)
                    entry["cluster_state"] = fields.get("cluster_state", "unknown")
                    entry["slots_ok"] = int(fields.get("cluster_slots_ok", 0))
                    break
                except (redis.RedisError, OSError):
                    continue
        out.append(entry)
    return out
