"""Key-value stores for the sample cache: :class:`Store`, the one interface samples are read through, and its
implementations :class:`RedisStore` and :class:`ClusterStore`.

``RedisStore`` picks its topology from what it finds:

* ``hosts`` that form a Redis Cluster: redis-py's ``RedisCluster`` (slot map, MOVED/ASK, failover to a
  promoted replica, retries with backoff). Batched reads group keys by the node that serves their slot and
  pipeline one GET per key on every node at once; a redirected key is re-read through ``RedisCluster``.
* ``hosts`` that are independent servers: with ``cluster_mode=True`` keys are sharded client side with
  rendezvous hashing (:mod:`.hashing`), one MGET per server per batch, all servers queried at once; with
  ``cluster_mode=False`` the ranks of node n use only host ``n % m`` (Bagua's behaviour).
* ``hosts=None``: ``BAGUA_LIGHTNING_REDIS_HOSTS`` or the services file when they name servers, else a
  node-local server shared by the jobs of the node (:mod:`.local_server`).

Connections are opened lazily and per process: after a ``fork`` (DataLoader workers) the child opens its own,
and a pickled store (``spawn``) carries only its configuration.

Failures are isolated per node (:class:`~.faults.NodeBreakers`): a node that fails is skipped without network
calls until its next try while the others keep serving, and a store that cannot connect at all backs off the
same way (the nodes: :mod:`.nodes`, :mod:`.cluster_nodes`). :meth:`RedisStore.fetch` and :meth:`RedisStore.put`
never raise for anything Redis does; one warning
is logged per outage (per process), one info line when every node answers again.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import redis

from ...core.errors import ConfigurationError
from ...core.read_plane import SEALED_KEY_PREFIX
from ...core.services_file import resolve_redis_hosts
from ...core.tls_trust import explain_untrusted
from .catalog import RESERVED_KEYS, Catalog, RedisCatalog
from .cluster_nodes import ClusterNodes
from .entry import SEAL_PREFIX
from .faults import CONNECT, NodeBreakers, OutagePolicy
from .hashing import RendezvousHash
from .nodes import STORE_ERRORS, ServerNodes, Value, probe_is_cluster
from .options import RedisOptions, parse_hosts

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 100 * 1024**3  # bytes per node, as in Bagua (capped to the machine when not asked for)
# Ends the outage warning of a store on named servers: the command that starts (and the one that checks) them.
OUTAGE_HINT = "; `bagua-lightning up` starts the services, `bagua-lightning status` shows which answer"
Fetched = tuple[list[Any], BaseException | None]  # values: bytes, read-only buffers (memoryview) or None
Written = tuple[list[bool], BaseException | None]


class Store(ABC):
    """A key-value store of ``bytes`` values: Bagua's ``Store`` interface plus what the cache loader needs.

    Subclasses implement Bagua's operations (``mget``, ``mset``, ``num_keys``, ``clear``, ``status``,
    ``shutdown``); ``get``/``set`` go through them. The loader uses only :meth:`fetch` and :meth:`put`, which
    never raise for a failing store (they return the error beside the values, so training goes on with the
    source), :meth:`catalog` and :meth:`writable`. Stores that can do better than the defaults (one round trip
    for many keys, values as views of receive buffers, write-if-absent on the server) override them.

    A store whose ``isolates_failures`` is True backs off failing nodes itself (and warns); the loader then
    keeps no store-wide circuit breaker around it.
    """

    isolates_failures = False

    @abstractmethod
    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` in the same order; None for a missing key."""

    @abstractmethod
    def mset(self, dictionary: Mapping[str, Value]) -> None:
        """Set every key of ``dictionary``."""

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None if the key does not exist."""
        return self.mget([key])[0]

    def set(self, key: str, value: Value) -> None:
        """Set ``key`` to ``value``."""
        self.mset({key: value})

    @abstractmethod
    def num_keys(self) -> int:
        """Number of keys in the store."""

    @abstractmethod
    def clear(self) -> None:
        """Delete every key."""

    @abstractmethod
    def status(self) -> bool:
        """True when the store is alive (every node answers)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Close connections and stop the servers this store started; servers it found keep running."""

    def fetch(self, keys: Sequence[str | bytes], sealed: bool = False) -> Fetched:
        """Values of ``keys`` (``str``, or UTF-8 encoded ``bytes``; values None where missing or unreachable) and
        the first error met; never raises for the store. Values are ``bytes`` or read-only buffers
        (``memoryview``) valid as long as they are referenced (stores that can skip copies return those).

        ``sealed``: the caller authenticates and decrypts the entries itself (sealed with the cache key), so a
        store may read them where no secret is sent, such as a deployment's read ports (docs/deployment.md,
        "Open reads"). The loader says so when it has a cache key.
        """
        try:
            return list(self.mget([k.decode() if isinstance(k, bytes) else k for k in keys])), None
        except Exception as exc:  # any store's failure is a miss for the loader, never a crash of training
            return [None] * len(keys), exc

    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool = True) -> Written:
        """Write ``items`` (with ``overwrite=False`` existing keys are kept); per key whether it was written,
        and the first error met. Never raises for the store."""
        try:
            if overwrite:
                self.mset(dict(items))
                return [True] * len(items), None
            existing = self.mget([k for k, _ in items])
            new = {k: v for (k, v), old in zip(items, existing, strict=True) if old is None}
            if new:
                self.mset(new)
            return [old is None for old in existing], None
        except Exception as exc:
            return [False] * len(items), exc

    def catalog(self) -> Catalog | None:
        """The datasets catalog this store keeps, or None (the loader then keeps no bookkeeping)."""
        return None

    def writable(self) -> bool:
        """False when a write now would reach no node at all (every one backing off): the loader then skips
        encoding entries it could not write. Without a network call."""
        return True


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _as_bytes(fetched: Fetched) -> list[bytes | None]:
    """The values of a fetch as ``bytes`` (``mget``'s), or its error raised."""
    values, error = fetched
    _raise(error)
    return [v if v is None or type(v) is bytes else bytes(v) for v in values]


class ClusterStore(Store):
    """Entries sharded over several stores by their keys (rendezvous hashing on the store's position).

    Args:
        stores: the stores to shard entries on; their order decides where a key lives, so every process
            of a job must list them in the same order.
    """

    def __init__(self, stores: Sequence[Store]) -> None:
        stores = list(stores)
        if not stores or not all(isinstance(s, Store) for s in stores):
            raise ConfigurationError(f"ClusterStore(stores={stores!r}) needs a non-empty list of Store objects.")
        self.stores = stores
        self.isolates_failures = all(s.isolates_failures for s in stores)
        self._ring = RendezvousHash([f"store-{i}" for i in range(len(stores))])

    def _groups(self, keys: Sequence[str | bytes]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for j, k in enumerate(keys):
            groups.setdefault(self._ring.node_of(k), []).append(j)
        return groups

    def fetch(self, keys: Sequence[str | bytes], sealed: bool = False) -> Fetched:
        out: list[Any] = [None] * len(keys)
        error: BaseException | None = None
        for i, idx in self._groups(keys).items():
            sub = [keys[j] for j in idx]
            values, err = self.stores[i].fetch(sub, sealed=True) if sealed else self.stores[i].fetch(sub)
            error = error or err
            for j, v in zip(idx, values, strict=True):
                out[j] = v
        return out, error

    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool = True) -> Written:
        done = [False] * len(items)
        error: BaseException | None = None
        for i, idx in self._groups([k for k, _ in items]).items():
            ok, err = self.stores[i].put([items[j] for j in idx], overwrite)
            error = error or err
            for j, flag in zip(idx, ok, strict=True):
                done[j] = flag
        return done, error

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        return _as_bytes(self.fetch(list(keys)))

    def mset(self, dictionary: Mapping[str, Value]) -> None:
        _raise(self.put(list(dictionary.items()))[1])

    def writable(self) -> bool:
        return any(s.writable() for s in self.stores)

    def num_keys(self) -> int:
        return sum(s.num_keys() for s in self.stores)

    def clear(self) -> None:
        for s in self.stores:
            s.clear()

    def status(self) -> bool:
        return all(s.status() for s in self.stores)

    def shutdown(self) -> None:
        for s in self.stores:
            s.shutdown()


def default_capacity_per_node() -> int:
    """The local server's ``maxmemory`` when the user names none: Bagua's 100 GiB, or a quarter of this
    machine's memory where that is less."""
    from ...core.local_redis import default_capacity

    return min(DEFAULT_CAPACITY, default_capacity())


def node_index() -> int:
    """Index of this machine among the job's nodes (``GROUP_RANK``/``NODE_RANK``, else rank // local size)."""
    for name in ("GROUP_RANK", "NODE_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    rank, local = os.environ.get("RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if rank.isdigit() and local.isdigit() and int(local) > 0:
        return int(rank) // int(local)
    return 0


class RedisStore(Store):
    """A Redis-backed store: a Redis Cluster, independent servers, or a node-local server.

    Args:
        hosts: servers as ``[{"host": "10.0.0.1", "port": 7000}, ...]`` (or ``"host:port"`` strings).
            None: ``BAGUA_LIGHTNING_REDIS_HOSTS``, the services file, else a local server shared by the jobs
            of this node.
        cluster_mode: for independent servers: shard keys over all of them (True) or use host ``n % m`` on
            the n-th node (False). A real Redis Cluster is always used as a cluster.
        capacity_per_node: ``maxmemory`` in bytes of a spawned local server (no effect on existing servers).
            None: Bagua's 100 GiB, or a quarter of this machine's memory where that is less (no warning);
            a number larger than the machine's memory is capped to that quarter with a warning.
        outage_policy: back-off of a failing node (and of connecting); default :class:`OutagePolicy()`.
        **options: :class:`RedisOptions` fields (``password``, ``tls_ca``, ``tls_cert``, ``tls_key``,
            ``username``, ``ssl``, timeouts, retries).
    """

    isolates_failures = True

    def __init__(self, hosts: Sequence[Any] | None = None, cluster_mode: bool = True,
                 capacity_per_node: int | None = None, outage_policy: OutagePolicy | None = None,
                 **options: Any) -> None:
        if outage_policy is not None and not isinstance(outage_policy, OutagePolicy):
            raise ConfigurationError(f"outage_policy={outage_policy!r}; give an OutagePolicy or None.")
        if capacity_per_node is None:
            capacity_per_node = default_capacity_per_node()
        elif isinstance(capacity_per_node, bool) or not isinstance(capacity_per_node, int) or capacity_per_node <= 0:
            raise ConfigurationError(f"capacity_per_node={capacity_per_node!r}; give a positive number of bytes.")
        self.options = RedisOptions.from_kwargs(options)
        self.cluster_mode = bool(cluster_mode)
        self.capacity_per_node = capacity_per_node
        self.managed_pid: int | None = None  # a local server this store started
        self.local = False
        if hosts is None:
            resolved = resolve_redis_hosts()
            if resolved is not None:
                hosts = resolved[0]
            else:
                from .local_server import job_servers

                # Every node's server, exchanged over the job's torch.distributed store when there is one:
                # one store over all of them, so a sample cached on one node is a hit on every node.
                servers = job_servers(capacity_per_node, self.options.start_timeout_s)
                hosts = servers.hosts
                self.options.password = servers.password
                self.local = True
                if len(hosts) > 1:
                    self.cluster_mode = True  # shard over every node's server, not only this node's
                elif servers.local is not None and servers.started_here:
                    self.managed_pid = servers.local.pid
        self.hosts = parse_hosts(hosts)
        if not self.local:  # a node-local server's password came with its address (and it speaks no TLS)
            self.options.resolve_tls(self.hosts)
            self.options.resolve_password(self.hosts)
            self.options.resolve_read_plane(self.hosts)
        hint = "" if self.local else OUTAGE_HINT  # a node-local server is started by the jobs themselves
        self.breakers = NodeBreakers(f"the sample cache ({self!r})", outage_policy, hint=hint)
        self._nodes: ServerNodes | ClusterNodes | None = None
        self._pid = os.getpid()
        self._creator_pid = self._pid

    # Connections belong to one process: drop them when pickled or inherited through fork.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_nodes"] = None
        state["managed_pid"] = None  # only the creating process stops the server it started
        return state  # ``breakers`` pickles without its outage: a spawned worker presumes every node up

    @property
    def nodes(self) -> ServerNodes | ClusterNodes:
        """The connected nodes, set up on first use in this process (raises a Redis error if unreachable)."""
        if self._nodes is None or self._pid != os.getpid():
            self._pid = os.getpid()
            self._nodes = self._connect()
        return self._nodes

    def _connect(self) -> ServerNodes | ClusterNodes:
        if (len(self.hosts) > 1 or not self.local) and probe_is_cluster(self.hosts, self.options):
            return ClusterNodes(self.hosts, self.options, self.breakers)
        if self.cluster_mode or len(self.hosts) == 1:
            return ServerNodes(self.hosts, self.options, self.breakers)
        return ServerNodes([self.hosts[node_index() % len(self.hosts)]], self.options, self.breakers)

    def _usable(self) -> tuple[ServerNodes | ClusterNodes | None, BaseException | None]:
        """The nodes, connected if need be, or None and why: connecting failed now, or backs off (then without
        a network call)."""
        nodes = self._nodes
        if nodes is not None and self._pid == os.getpid():
            return nodes, None
        if not self.breakers.available(CONNECT):
            return None, redis.ConnectionError(f"{self!r} is unavailable (backing off)")
        try:
            nodes = self.nodes
        except STORE_ERRORS as exc:  # nothing answers (RedisClusterException included): back off
            self.breakers.failure(CONNECT, exc)
            return None, exc
        self.breakers.success(CONNECT)
        return nodes, None

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.nodes, ClusterNodes)

    def fetch(self, keys: Sequence[str | bytes], sealed: bool = False) -> Fetched:
        """Values of the reachable nodes (one pipelined round trip per node, all nodes at once; views of the
        receive buffers) and the first error met; never raises for the store. ``sealed``: from the nodes' read
        ports where the deployment has them (``read_port_offset``)."""
        raw = cast("Sequence[bytes]", keys) if str not in set(map(type, keys)) else [
            k.encode() if isinstance(k, str) else k for k in keys]
        nodes, error = self._usable()
        if nodes is None:
            return [None] * len(keys), explain_untrusted(error)
        try:
            values, error = nodes.fetch(raw, sealed)
        except STORE_ERRORS as exc:  # the nodes report node failures beside the values; this is anything else
            self._lost(exc)
            return [None] * len(keys), explain_untrusted(exc)
        return values, error if error is None else explain_untrusted(error)

    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool = True) -> Written:
        """Write ``items`` pipelined per node (``SET`` / ``SET NX``); the keys of failing nodes are not written.
        Never raises for the store.

        Raises:
            ConfigurationError: a key under ``"!sealed:"`` whose value is not a sealed entry: the read ports
                serve those keys without a password (:mod:`bagua_lightning.core.read_plane`).
        """
        for key, value in items:
            if key.startswith(SEALED_KEY_PREFIX) and (  # a str is never a sealed entry
                    isinstance(value, str) or bytes(memoryview(value)[:len(SEAL_PREFIX)]) != SEAL_PREFIX):
                raise ConfigurationError(
                    f"key {key!r}: keys under {SEALED_KEY_PREFIX!r} hold sealed cache entries only, as the "
                    "deployment's read ports serve them without a password; store this value under another key.")
        nodes, error = self._usable()
        if nodes is None:
            return [False] * len(items), error
        try:
            return nodes.put(items, overwrite)
        except STORE_ERRORS as exc:
            self._lost(exc)
            return [False] * len(items), exc

    def _lost(self, exc: BaseException) -> None:
        # Reconnect (and re-probe the topology) at the next try.
        self.breakers.failure(CONNECT, exc)
        nodes, self._nodes = self._nodes, None
        if nodes is not None:
            try:
                nodes.close()
            except STORE_ERRORS:
                pass

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        return _as_bytes(self.fetch(list(keys)))

    def mset(self, dictionary: Mapping[str, Value]) -> None:
        _raise(self.put(list(dictionary.items()), overwrite=True)[1])

    def writable(self) -> bool:
        if not self.breakers.down:
            return True
        nodes = self._nodes
        if nodes is None or self._pid != os.getpid():
            return self.breakers.available(CONNECT)
        return nodes.writable()

    def catalog(self) -> Catalog:
        return RedisCatalog(self.nodes.client_for_key(RESERVED_KEYS[0]), self.nodes.primaries)

    def _each_primary(self, fn: Callable[[redis.Redis], Any]) -> list[Any]:
        return [fn(c) for c in self.nodes.primaries()]

    def num_keys(self) -> int:
        """Keys on every master, not counting the project's own bookkeeping keys."""
        total = sum(self._each_primary(lambda c: int(c.dbsize())))
        reserved = sum(int(self.nodes.client_for_key(k).exists(k)) for k in RESERVED_KEYS)
        return total - reserved

    def clear(self) -> None:
        self._each_primary(lambda c: c.flushdb())

    def status(self) -> bool:
        try:
            return all(self._each_primary(lambda c: bool(c.ping())))
        except STORE_ERRORS:
            return False

    def shutdown(self) -> None:
        if self.managed_pid is not None and os.getpid() == self._creator_pid:
            # The server this store started (a node-local one): stopped through its own authenticated
            # connection, so no process is ever signalled by pid.
            try:
                self.nodes.primaries()[0].shutdown(nosave=True)
            except STORE_ERRORS as exc:
                log.warning("could not stop the local Redis this store started: %s", exc)
            self.managed_pid = None
        if self._nodes is not None:
            self._nodes.close()
            self._nodes = None

    def __repr__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        return f"RedisStore(hosts={hosts!r}, cluster_mode={self.cluster_mode}, local={self.local})"
