"""One ``redis-server`` process: its configuration, start, readiness, and administration connections.

Shared by the service side (``bagua-lightning up``, ``redis up``) and the trainer side (the node-local
cache server), so neither imports the other. No torch here.

Secrets: the password is never on a command line and never in ``redis.conf``. ``redis-server`` reads its
config file and then, through the trailing ``-`` argument, the ``requirepass``/``masterauth`` lines from
its standard input, which is a pipe closed right after. The only copy at rest is the 0600 secret file the
caller keeps (see :mod:`bagua_lightning.core.procs`). Every process carries its deployment's id in its
environment, so only the deployment that started it stops it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:  # redis-py takes ~0.5 s to import: only where a connection is made
    import redis

from . import procs
from .errors import ConfigurationError, ServiceUnavailableError
from .read_plane import READER_USER, reader_acl_line
from .tls_trust import ClientTLS

CLUSTER_SLOTS = 16384
BUS_PORT_OFFSET = 10000  # a node's cluster bus listens on port + 10000
TLS_PORT_OFFSET = 20000  # with a TLS bus, a node's TLS port (replication, certified peers only): see tls_port
MAX_CLUSTER_PORT = 65535 - BUS_PORT_OFFSET
# Failover of a cache (see docs/deployment.md for the measured recovery time): a master unreachable for
# NODE_TIMEOUT_MS is failed over to its replica. A replica may take over however long its link was down
# (validity factor 0): a cache replica's data is never "too old" to serve, missing entries are only misses.
DEFAULT_NODE_TIMEOUT_MS = 2000
# Epoch-order scans: LRU evicts exactly the entry the next epoch needs first (a cyclic scan larger than
# memory never hits). LFU keeps the entries that were hit before and lets stale datasets decay away.
DEFAULT_EVICTION_POLICY = "allkeys-lfu"
CONFIG_FILE = "redis.conf"
LOG_FILE = "redis.log"


def tls_port(port: int) -> int:
    """The TLS port of the node with client port ``port`` when its bus speaks TLS: ``port + 20000``, or
    ``port - 20000`` where that would pass 65535 (the bus takes ``port + 10000``, so ``port`` >= 45536)."""
    return port + TLS_PORT_OFFSET if port + TLS_PORT_OFFSET <= 65535 else port - TLS_PORT_OFFSET


def read_port_offset(base_port: int, count: int = 1) -> int:
    """The read port offset of the nodes on ``base_port .. base_port + count - 1`` (see
    :mod:`~bagua_lightning.core.read_plane`): ``+20000``, the slot :func:`tls_port` uses (free when the client
    port itself speaks TLS), when every node's port + 20000 <= 65535, else ``-20000``.

    Raises:
        ConfigurationError: neither fits every node (ports that straddle both limits).
    """
    ports = range(base_port, base_port + max(1, count))
    for offset in (TLS_PORT_OFFSET, -TLS_PORT_OFFSET):
        if all(1 <= p + offset <= 65535 for p in ports):
            return offset
    raise ConfigurationError(f"ports {ports.start}..{ports.stop - 1}: no read port offset (+/-{TLS_PORT_OFFSET}) "
                             "fits every node; pick another --redis-port.")


def redis_server_binary() -> str:
    """Path of ``redis-server``; :class:`ConfigurationError` naming the fix when it is not installed."""
    path = shutil.which("redis-server")
    if path is None:
        raise ConfigurationError(
            "redis-server is not on PATH. Install it (Debian: `apt-get install redis-server`, or `.ci/install`)."
        )
    return path


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True, kw_only=True)
class NodeTLS:
    """The certificate files of one cluster node (PEM; the key file is 0600 in a 0700 folder).

    With these, the cluster bus and replication run over mutual TLS: a peer is accepted only with a
    certificate signed by ``ca_file``, the deployment's own CA. With ``clients``, the node's client port
    itself speaks TLS only (``port 0``, ``tls-port`` = the node's port): a client must show a certificate of
    the same CA, and verifies the node's before it sends the password. Without, clients keep the plain,
    password-protected port and the TLS port (:func:`tls_port`) serves replication.
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    clients: bool = False


@dataclass(kw_only=True)
class NodeConfig:
    """One ``redis-server`` process.

    Attributes:
        port: TCP port; with ``cluster`` the bus uses ``port + 10000``, so it must be <= 55535.
        host: address(es) to bind, space-separated; loopback by default, never all interfaces unless asked.
        data_dir: folder for the config, the log and ``nodes.conf``; created with mode 0700.
        deployment: id of the deployment that starts it (in its environment; see :mod:`~bagua_lightning.core.procs`).
        cluster: start with ``cluster-enabled yes``.
        maxmemory: byte limit (0: no limit); entries are evicted with ``eviction_policy`` beyond it.
        eviction_policy: Redis ``maxmemory-policy``.
        password: ``requirepass`` (and ``masterauth`` for replicas), handed over on stdin; None: no password,
            which is only safe on loopback for a single user.
        node_timeout_ms: ``cluster-node-timeout``: how long a master may be unreachable before its replica
            is promoted.
        tls: certificate files: the cluster bus (``port + 10000``) and replication (TLS port
            :func:`tls_port`) run over mutual TLS; None: a plain bus that any local process may join.
        announce_ip: ``cluster-announce-ip``, the address other nodes and clients are given (needed when
            ``host`` is a wildcard); None: the address Redis finds itself.
        read_port: with ``tls.clients`` and a password: a plaintext *read port* where the password-less,
            read-only user :data:`~bagua_lightning.core.read_plane.READER_USER` may GET/MGET/PING (see
            :mod:`~bagua_lightning.core.read_plane`); None: no plaintext port at all.
        persist: keep the data across a restart of the process (or of the machine): an append-only file in
            ``data_dir`` (``appendonly yes``, ``appendfsync everysec``: a killed process loses no write it
            answered, a machine that loses power at most the last second's); False: nothing on disk.
    """

    port: int
    host: str = "127.0.0.1"
    data_dir: Path
    deployment: str
    cluster: bool = False
    maxmemory: int = 0
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    password: str | None = None
    node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS
    tls: NodeTLS | None = None
    announce_ip: str | None = None
    read_port: int | None = None
    persist: bool = False

    def __post_init__(self) -> None:
        if self.tls is not None and not self.cluster and not self.tls.clients:
            raise ConfigurationError(f"port {self.port}: TLS is for the cluster bus; a standalone server has none.")
        limit = MAX_CLUSTER_PORT if self.cluster else 65535
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= limit:
            raise ConfigurationError(
                f"port {self.port!r} is out of range 1..{limit}"
                + (f" (the cluster bus uses port + {BUS_PORT_OFFSET})" if self.cluster else "") + "; pick a lower --port."
            )
        if self.read_port is not None:
            self._check_read_port()
        if self.maxmemory < 0:
            raise ConfigurationError(f"maxmemory {self.maxmemory} is negative; give bytes, 0 for no limit.")
        if self.node_timeout_ms < 100:
            raise ConfigurationError(f"node_timeout_ms {self.node_timeout_ms} is below 100 ms.")

    def _check_read_port(self) -> None:
        port = self.read_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigurationError(f"read port {port!r} of node {self.port} is out of range 1..65535.")
        taken = {self.port: "its client port", **({self.port + BUS_PORT_OFFSET: "its cluster bus port"}
                                                  if self.cluster else {})}
        if port in taken:
            raise ConfigurationError(f"read port {port} of node {self.port} is {taken[port]}; pick another offset.")
        if self.tls is None or not self.tls.clients:
            raise ConfigurationError(f"read port {port} of node {self.port}: a read port needs TLS on the client "
                                     "port (it is the only plaintext port); without client TLS there is none.")
        if not self.password:
            raise ConfigurationError(f"read port {port} of node {self.port}: a node without a password would "
                                     "give every plaintext client the default user; set a password.")

    def config_text(self) -> str:
        """The ``redis.conf`` text: everything but the password."""
        client_tls = self.tls is not None and self.tls.clients
        # TLS for clients: the plain port is closed, the node's port speaks TLS only; with a read port, that
        # plaintext port is open for the password-less reader (GET/MGET/PING of sealed entries) alone.
        plain = self.port if not client_tls else self.read_port if self.read_port is not None else 0
        lines = [
            f"port {plain}",
            f"bind {self.host}",
            "protected-mode yes",
            "daemonize no",
            # Keep the command line and environment readable: the deployment id in the environment is how
            # `down` recognises the process (a rewritten title overwrites that memory).
            "set-proc-title no",
            f"dir {_quote(str(self.data_dir))}",
            f"logfile {LOG_FILE}",
            # No snapshots. With `persist`, an append-only file (its rewrites start with an RDB preamble):
            # Redis writes it before it answers, so a node killed, or a machine rebooted, comes back with what
            # it held (up to the last second's writes on a power loss: fsync every second). Else a cache
            # rebuilt from the source when lost: nothing on disk.
            'save ""',
            *(["appendonly yes", "appendfsync everysec", 'appenddirname "appendonlydir"'] if self.persist
              else ["appendonly no"]),
            f"maxmemory {self.maxmemory}",
            f"maxmemory-policy {self.eviction_policy}",
        ]
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                f"cluster-node-timeout {self.node_timeout_ms}",
                "cluster-replica-validity-factor 0",
                # Serve the slots that are up while another master fails over; clients fall back per key.
                "cluster-require-full-coverage no",
                "cluster-allow-reads-when-down no",
                # Replicas of a cache need no batching of full syncs (the default waits 5 s).
                "repl-diskless-sync-delay 0",
            ]
            if self.announce_ip:
                lines.append(f"cluster-announce-ip {self.announce_ip}")
        if self.tls is not None:
            if self.cluster:
                # The bus port is derived from the TLS port when the bus speaks TLS: pin it to port + 10000.
                lines += [f"cluster-port {self.port + BUS_PORT_OFFSET}", "tls-cluster yes"]
            lines += [
                f"tls-port {self.port if client_tls else tls_port(self.port)}",
                f"tls-cert-file {_quote(str(self.tls.cert_file))}",
                f"tls-key-file {_quote(str(self.tls.key_file))}",
                f"tls-ca-cert-file {_quote(str(self.tls.ca_file))}",
                "tls-replication yes",
                "tls-auth-clients yes",
            ]
        if client_tls and self.read_port is not None:
            lines.append(reader_acl_line())  # the user READER_USER: no password, GET/MGET/PING only
        return "\n".join(lines) + "\n"

    def secret_text(self) -> str:
        """The config lines read from stdin: the password, when there is one."""
        if not self.password:
            return ""
        return f"requirepass {_quote(self.password)}\nmasterauth {_quote(self.password)}\n"


def launch_node(config: NodeConfig) -> subprocess.Popen[bytes]:
    """Start ``redis-server`` for ``config``, detached in its own session; return the process.

    ``redis.conf`` (no secrets) is written with mode 0600 in a 0700 folder; the password goes through a
    pipe on stdin. The caller waits for it with :func:`wait_ready`.
    """
    procs.private_dir(config.data_dir)
    conf = procs.write_private(config.data_dir / CONFIG_FILE, config.config_text())
    if config.cluster:
        # A stale nodes.conf would make the node rejoin an old cluster with its old slots.
        (config.data_dir / "nodes.conf").unlink(missing_ok=True)
    shutil.rmtree(config.data_dir / "appendonlydir", ignore_errors=True)  # nor old data: a new node starts empty
    proc = subprocess.Popen(
        [redis_server_binary(), str(conf), "-"],
        cwd=config.data_dir,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=procs.child_env(config.deployment),
        start_new_session=True,
    )
    if proc.stdin is not None:  # always, with stdin=PIPE
        try:
            proc.stdin.write(config.secret_text().encode())
        finally:
            proc.stdin.close()
    return proc


def client_for(host: str, port: int, password: str | None = None, timeout_s: float = 2.0,
               tls: ClientTLS | None = None) -> redis.Redis:
    """A connection to one node (no cluster routing), for administration; over TLS with ``tls`` (the node's
    certificate verified against that CA alone before the password is sent)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from .pinned_redis import pinned_kwargs, redis_client

    # No client-side retries: callers poll with their own deadline.
    return redis_client(host, port, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                        retry=Retry(NoBackoff(), 0), **(pinned_kwargs(tls) if tls is not None else {}))


def reader_client(host: str, read_port: int, timeout_s: float = 2.0, connect_timeout_s: float | None = None,
                  **kwargs: Any) -> redis.Redis:
    """A plaintext connection to a node's read port as :data:`~bagua_lightning.core.read_plane.READER_USER`;
    no secret is ever sent (``AUTH bagua-reader ""``: the user has ``nopass``), over RESP2 (one ``AUTH``, no
    ``HELLO``), without ``CLIENT SETINFO`` (the reader may not) and without retries (a caller with somewhere
    else to read goes there at once). ``kwargs``: more redis-py connection options (``socket_read_size``)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from .pinned_redis import redis_client

    return redis_client(host, read_port, username=READER_USER, password="", socket_timeout=timeout_s,
                        socket_connect_timeout=connect_timeout_s or timeout_s, retry=Retry(NoBackoff(), 0),
                        protocol=2, driver_info=None, **kwargs)


def wait_ready(host: str, port: int, password: str | None, proc: subprocess.Popen[bytes] | None = None,
               timeout_s: float = 15.0, tls: ClientTLS | None = None) -> None:
    """Wait until the server on ``host:port`` answers PING; fail fast if ``proc`` exited.

    Raises:
        ServiceUnavailableError: ``proc`` exited, the deadline passed, or the server refused our password
            (then it is not the server we started).
    """
    import redis

    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            raise ServiceUnavailableError(
                f"redis-server on port {port} exited with code {proc.returncode}; is port {port} already in "
                "use? See its redis.log."
            )
        try:
            with client_for(host, port, password, timeout_s=1.0, tls=tls) as c:
                return bool(c.ping())
        except (redis.AuthenticationError, redis.ResponseError) as exc:
            raise ServiceUnavailableError(f"{host}:{port} answers but refuses our password ({exc}); "
                                          "another server holds that port.") from exc
    procs.poll(ready, timeout_s, f"redis-server on {host}:{port}", retry_on=(redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError))


def check_reader(host: str, read_port: int, timeout_s: float = 2.0) -> None:
    """Check that ``host:read_port`` lets the password-less reader in (PING); :class:`ServiceUnavailableError`
    naming the port otherwise."""
    import redis

    try:
        with reader_client(host, read_port, timeout_s) as c:
            c.ping()
    except (redis.RedisError, OSError) as exc:
        raise ServiceUnavailableError(f"the read port {host}:{read_port} does not let {READER_USER} in ({exc}); "
                                      "see the node's redis.log.") from exc


def is_redis_pid(pid: int) -> bool:
    """True while ``pid`` is a live (non-zombie) ``redis-server``; a query only, never a licence to signal."""
    try:
        proc = psutil.Process(pid)
        return proc.name() == "redis-server" and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def stop_pid(pid: int, timeout_s: float = 10.0) -> bool:
    """Stop the ``redis-server`` ``pid`` that this process itself started moments ago (e.g. a store's own
    node-local server); only a redis-server carrying a deployment id is signalled. True when stopped."""
    if not is_redis_pid(pid):
        procs.reap(pid)
        return False
    try:
        deployment = psutil.Process(pid).environ().get(procs.ENV_DEPLOYMENT)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if not deployment:
        return False
    return procs.stop(procs.record(pid, deployment), timeout_s)


def cluster_info_fields(raw: Any) -> dict[str, str]:
    """A ``CLUSTER INFO`` reply (redis-py's dict, or raw ``field:value`` lines) as ``{field: value}``."""
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.strip().split(":", 1) for line in text.strip().splitlines() if ":" in line)


def cluster_info(client: redis.Redis) -> dict[str, str]:
    """``CLUSTER INFO`` of the node behind ``client``."""
    return cluster_info_fields(client.execute_command("CLUSTER INFO"))
