"""Local Redis deployments from real ``redis-server`` processes: a Redis Cluster or standalone servers.

Plain Python, no torch: ``bagua-lightning redis up|down|status`` and ``bagua-lightning up`` drive it, and
the trainer side reuses :func:`launch_node` to spawn its node-local cache server.

Each deployment is keyed by its base port and lives in ``<state_dir>/redis/<port>/``: one folder per node
(``redis.conf``, ``nodes.conf``, ``redis.log``) and ``deployment.json`` (ports, pids, roles; never the
password). Servers run detached in their own session, so they outlive the command that started them, and
are stopped by pid (checked against ``/proc/<pid>/cmdline`` so a recycled pid is never signalled).

The cluster is created with the commands ``redis-cli --cluster create`` uses (CLUSTER MEET, ADDSLOTSRANGE,
REPLICATE), issued from Python so one master and uneven counts work too; start-up waits, with a deadline,
until every node reports ``cluster_state:ok`` with all 16384 slots assigned and every replica is linked.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bagua_lightning.errors import ConfigurationError, ServiceUnavailableError
from bagua_lightning.services_file import ENV_REDIS_PASSWORD, state_dir

CLUSTER_SLOTS = 16384
BUS_PORT_OFFSET = 10000  # Redis Cluster's bus port is always port + 10000
MAX_PORT = 65535 - BUS_PORT_OFFSET
DEFAULT_PORT = 7000
# Epoch-order scans: LRU evicts exactly the entry the next epoch needs first (a cyclic scan larger than
# memory never hits). LFU keeps the entries that were hit before and lets stale datasets decay away.
DEFAULT_EVICTION_POLICY = "allkeys-lfu"
DEPLOYMENT_FILE = "deployment.json"


def _redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise ConfigurationError(
            "redis-server is not on PATH. Install it (Debian: `apt-get install redis-server`, or `.ci/install`)."
        )
    return path


@dataclass(kw_only=True)
class NodeConfig:
    """One ``redis-server`` process.

    Attributes:
        port: TCP port; with ``cluster`` the bus uses ``port + 10000``, so it must be <= 55535.
        host: address to bind; loopback by default, never all interfaces unless asked.
        data_dir: folder for the config, the log and ``nodes.conf``; created with mode 0700.
        cluster: start with ``cluster-enabled yes``.
        maxmemory: byte limit (0: no limit); entries are evicted with ``eviction_policy`` beyond it.
        eviction_policy: Redis ``maxmemory-policy``.
        password: ``requirepass`` (and ``masterauth`` for replicas); None: no password, which is only
            safe on loopback.
        node_timeout_ms: ``cluster-node-timeout``: how long a master may be unreachable before its replica
            is promoted.
    """

    port: int
    host: str = "127.0.0.1"
    data_dir: Path
    cluster: bool = False
    maxmemory: int = 0
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    password: str | None = None
    node_timeout_ms: int = 2000

    def __post_init__(self) -> None:
        limit = MAX_PORT if self.cluster else 65535
        if not 1 <= self.port <= limit:
            raise ConfigurationError(
                f"port {self.port} is out of range 1..{limit}"
                + (" (the cluster bus uses port + 10000)" if self.cluster else "")
                + "; pick a lower --port."
            )
        if self.maxmemory < 0:
            raise ConfigurationError(f"maxmemory {self.maxmemory} is negative; give bytes, 0 for no limit.")
        if self.node_timeout_ms < 100:
            raise ConfigurationError(f"node_timeout_ms {self.node_timeout_ms} is below 100 ms.")

    def config_text(self) -> str:
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{self.data_dir}"',
            'logfile "redis.log"',
            # The cache is rebuilt from the source when lost: no snapshots, no append-only file.
            'save ""',
            "appendonly no",
            f"maxmemory {self.maxmemory}",
            f"maxmemory-policy {self.eviction_policy}",
        ]
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                f"cluster-node-timeout {self.node_timeout_ms}",
                # Serve the slots that are up while another master fails over; clients fall back per key.
                "cluster-require-full-coverage no",
                "cluster-allow-reads-when-down no",
                # Replicas of a cache need no batching of full syncs (the default waits 5 s).
                "repl-diskless-sync-delay 0",
            ]
        if self.password:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines += [f'requirepass "{quoted}"', f'masterauth "{quoted}"']
        return "\n".join(lines) + "\n"


def launch_node(config: NodeConfig) -> subprocess.Popen[bytes]:
    """Start ``redis-server`` for ``config``, detached in its own session; return the process.

    The config file (which may hold the password) is written with mode 0600 in a 0700 folder. The caller
    waits for it with :func:`wait_ready`.
    """
    config.data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(config.data_dir, 0o700)
    conf = config.data_dir / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(config.config_text())
    if config.cluster:
        # A stale nodes.conf would make the node rejoin an old cluster with its old slots.
        (config.data_dir / "nodes.conf").unlink(missing_ok=True)
    return subprocess.Popen(
        [_redis_server_binary(), str(conf)],
        cwd=config.data_dir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def client_for(host: str, port: int, password: str | None = None, timeout_s: float = 2.0) -> redis.Redis:
    """A plain connection to one node (no cluster routing), for administration."""
    # No client-side retries: callers poll with their own deadline.
    return redis.Redis(host=host, port=port, password=password, socket_timeout=timeout_s,
                       socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))


def _poll(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    # Deadline-bounded polling of a health condition (the server has no readiness notification).
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    last: Exception | None = None
    while True:
        try:
            if predicate():
                return
        except ServiceUnavailableError:
            raise  # the predicate knows it will never become true (the process exited)
        except (redis.RedisError, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise ServiceUnavailableError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                                          + (f" (last error: {last})" if last else ""))
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def wait_ready(host: str, port: int, password: str | None, proc: subprocess.Popen[bytes] | None = None,
               timeout_s: float = 15.0) -> None:
    """Wait until the server on ``host:port`` answers PING; fail fast if ``proc`` exited."""
    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            raise ServiceUnavailableError(
                f"redis-server on port {port} exited with code {proc.returncode}; see its redis.log"
                " (is the port already in use?)"
            )
        with client_for(host, port, password, timeout_s=1.0) as c:
            return bool(c.ping())
    _poll(ready, timeout_s, f"redis-server on {host}:{port}")


def is_redis_pid(pid: int) -> bool:
    """True when ``pid`` is a live redis-server (guards against signalling a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"redis-server" in cmdline


def stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM a redis-server by pid, SIGKILL it after ``timeout_s``; no-op if it is gone."""
    if not is_redis_pid(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap our own children so they do not linger as zombies
        if not is_redis_pid(pid) or _is_zombie(pid):
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@dataclass(kw_only=True)
class NodeInfo:
    """One started node: where it listens, its pid and its role (``master``, ``replica``, ``standalone``)."""

    host: str
    port: int
    pid: int
    role: str


@dataclass(kw_only=True)
class ClusterInfo:
    """What :func:`start_cluster` started.

    Attributes:
        nodes: every node, masters first.
        cluster: True for a Redis Cluster, False for independent standalone servers.
        replicas: replicas per master.
        state_dir: the deployment's folder (``<state_dir>/redis/<port>``).
        maxmemory: per-node byte limit (0: none).
        password_set: whether the nodes require a password (the password itself is never recorded).
    """

    nodes: list[NodeInfo]
    cluster: bool
    replicas: int = 0
    state_dir: Path
    maxmemory: int = 0
    password_set: bool = False

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
        return ",".join(f"{n.host}:{n.port}" for n in self.masters)

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterInfo:
        return cls(
            nodes=[NodeInfo(**n) for n in data["nodes"]],
            cluster=bool(data["cluster"]),
            replicas=int(data.get("replicas", 0)),
            state_dir=Path(data["state_dir"]),
            maxmemory=int(data.get("maxmemory", 0)),
            password_set=bool(data.get("password_set", False)),
        )


@dataclass(kw_only=True)
class ClusterSpec:
    """What to start.

    Attributes:
        nodes: number of masters (or of standalone servers with ``cluster=False``).
        replicas: replicas per master (0 or more); needs ``cluster=True``.
        port: first port; node i listens on ``port + i`` (replicas after the masters).
        host: bind address (loopback by default).
        maxmemory: per-node byte limit, 0 for none.
        password: ``requirepass`` for every node; None reads ``BAGUA_LIGHTNING_REDIS_PASSWORD``.
        cluster: a Redis Cluster (True) or independent standalone servers (False).
        node_timeout_ms: failover detection time of the cluster.
        state_root: the state folder; None: ``bagua_lightning.services_file.state_dir()``.
        timeout_s: deadline for the whole start-up.
    """

    nodes: int = 3
    replicas: int = 0
    port: int = DEFAULT_PORT
    host: str = "127.0.0.1"
    maxmemory: int = 0
    password: str | None = None
    cluster: bool = True
    node_timeout_ms: int = 2000
    state_root: Path | None = None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigurationError(f"nodes={self.nodes}: at least one node is needed.")
        if self.replicas < 0:
            raise ConfigurationError(f"replicas={self.replicas} is negative; use 0 or more.")
        if self.replicas and not self.cluster:
            raise ConfigurationError(f"replicas={self.replicas} needs a cluster; drop --single or use --replicas 0.")
        total = self.nodes * (1 + self.replicas)
        limit = MAX_PORT if self.cluster else 65535
        if self.port < 1 or self.port + total - 1 > limit:
            raise ConfigurationError(
                f"ports {self.port}..{self.port + total - 1} exceed {limit}"
                + (" (cluster bus = port + 10000)" if self.cluster else "") + "; pick a lower --port."
            )
        if self.password is None:
            self.password = os.environ.get(ENV_REDIS_PASSWORD) or None

    @property
    def total_nodes(self) -> int:
        return self.nodes * (1 + self.replicas)


def deployment_dir(port: int, state_root: Path | None = None) -> Path:
    return (state_root or state_dir()) / "redis" / str(port)


def _write_deployment(info: ClusterInfo) -> None:
    path = info.state_dir / DEPLOYMENT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info.to_json(), indent=2))
    os.replace(tmp, path)


def read_deployments(state_root: Path | None = None, port: int | None = None) -> list[ClusterInfo]:
    """Deployments recorded under the state folder (all, or the one with base ``port``)."""
    base = (state_root or state_dir()) / "redis"
    dirs = [base / str(port)] if port is not None else sorted(base.glob("*")) if base.is_dir() else []
    found = []
    for d in dirs:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found.append(ClusterInfo.from_json(json.loads((d / DEPLOYMENT_FILE).read_text())))
    return found


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
    folder = deployment_dir(spec.port, spec.state_root)
    for old in read_deployments(spec.state_root, spec.port):
        if any(is_redis_pid(n.pid) for n in old.nodes):
            raise ConfigurationError(
                f"a Redis deployment on port {spec.port} is already running (state in {folder}); "
                "stop it with `bagua-lightning redis down` or pick another --port."
            )
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    procs: list[subprocess.Popen[bytes]] = []
    nodes: list[NodeInfo] = []
    try:
        for i in range(spec.total_nodes):
            port = spec.port + i
            cfg = NodeConfig(port=port, host=spec.host, data_dir=folder / f"node-{port}", cluster=spec.cluster,
                             maxmemory=spec.maxmemory, password=spec.password,
                             node_timeout_ms=spec.node_timeout_ms)
            proc = launch_node(cfg)
            procs.append(proc)
            role = ("master" if i < spec.nodes else "replica") if spec.cluster else "standalone"
            nodes.append(NodeInfo(host=spec.host, port=port, pid=proc.pid, role=role))
        deadline = time.monotonic() + spec.timeout_s
        for node, proc in zip(nodes, procs, strict=True):
            wait_ready(node.host, node.port, spec.password, proc, timeout_s=max(1.0, deadline - time.monotonic()))
        info = ClusterInfo(nodes=nodes, cluster=spec.cluster, replicas=spec.replicas, state_dir=folder,
                           maxmemory=spec.maxmemory, password_set=bool(spec.password))
        if spec.cluster:
            _create_cluster(info, spec.password, deadline)
        _write_deployment(info)
        return info
    except BaseException:
        for proc in procs:
            stop_pid(proc.pid)
        raise


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO as ``{field: value}`` strings."""
    raw = client.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(ln.strip().split(":", 1) for ln in text.strip().splitlines() if ":" in ln)


def _create_cluster(info: ClusterInfo, password: str | None, deadline: float) -> None:
    masters = info.masters
    replicas = [n for n in info.nodes if n.role == "replica"]
    clients = {n.port: client_for(n.host, n.port, password) for n in info.nodes}
    try:
        ids = {port: c.execute_command("CLUSTER MYID").decode() for port, c in clients.items()}
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
        _poll(everyone_knows_everyone, deadline - time.monotonic(), "cluster nodes to meet")
        for j, r in enumerate(replicas):
            master = masters[j % len(masters)]
            clients[r.port].execute_command("CLUSTER REPLICATE", ids[master.port])

        def converged() -> bool:
            for n in info.nodes:
                fields = _cluster_info(clients[n.port])
                if fields.get("cluster_state") != "ok" or fields.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                    return False
            for r in replicas:
                repl = clients[r.port].info("replication")
                if repl.get("role") != "slave" or repl.get("master_link_status") != "up":
                    return False
            return True
        _poll(converged, deadline - time.monotonic(), f"all {CLUSTER_SLOTS} slots to be served")
    finally:
        for c in clients.values():
            c.close()


def stop_cluster(port: int | None = None, state_root: Path | None = None, remove_data: bool = True) -> list[int]:
    """Stop the deployment with base ``port`` (all recorded ones when None); return the stopped pids."""
    stopped: list[int] = []
    for info in read_deployments(state_root, port):
        for n in info.nodes:
            if is_redis_pid(n.pid):
                stop_pid(n.pid)
                stopped.append(n.pid)
        if remove_data:
            shutil.rmtree(info.state_dir, ignore_errors=True)
    return stopped


def node_status(node: NodeInfo, password: str | None) -> dict[str, Any]:
    """Liveness, role, key count and memory of one node."""
    status: dict[str, Any] = {"host": node.host, "port": node.port, "pid": node.pid, "role": node.role,
                              "process": is_redis_pid(node.pid)}
    try:
        with client_for(node.host, node.port, password, timeout_s=1.0) as c:
            status["keys"] = int(c.dbsize())
            mem = c.info("memory")
            status["used_memory"] = int(mem.get("used_memory", 0))
            status["role"] = {"slave": "replica"}.get(c.info("replication").get("role"), node.role) \
                if node.role != "standalone" else "standalone"
            status["up"] = True
    except (redis.RedisError, OSError) as exc:
        status["up"] = False
        status["error"] = str(exc)
    return status


def cluster_status(port: int | None = None, state_root: Path | None = None,
                   password: str | None = None) -> list[dict[str, Any]]:
    """One dict per recorded deployment: its nodes' status and, for a cluster, its state and slots."""
    password = password if password is not None else os.environ.get(ENV_REDIS_PASSWORD) or None
    out = []
    for info in read_deployments(state_root, port):
        entry: dict[str, Any] = {"port": info.nodes[0].port if info.nodes else None, "cluster": info.cluster,
                                 "hosts": info.hosts_string, "state_dir": str(info.state_dir),
                                 "nodes": [node_status(n, password) for n in info.nodes]}
        if info.cluster:
            entry["cluster_state"] = "down"
            for n in info.masters:
                try:
                    with client_for(n.host, n.port, password, timeout_s=1.0) as c:
                        fields = _cluster_info(c)
                    entry["cluster_state"] = fields.get("cluster_state", "unknown")
                    entry["slots_ok"] = int(fields.get("cluster_slots_ok", 0))
                    break
                except (redis.RedisError, OSError):
                    continue
        out.append(entry)
    return out


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec | None = None, **kwargs: Any) -> Iterator[ClusterInfo]:
    """:func:`start_cluster` for the duration of a block; always stopped (and its data removed) after."""
    spec = spec if spec is not None else ClusterSpec(**kwargs)
    info = start_cluster(spec)
    try:
        yield info
    finally:
        stop_cluster(spec.port, spec.state_root)
