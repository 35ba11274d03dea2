"""How a :class:`~.store.RedisStore` talks to its servers: a Redis Cluster or independent servers.

Batched reads send their commands on every node before reading any reply, so a batch costs about one round
trip however many nodes it touches. Each backend reports failures per call instead of raising, so the
loader can serve the keys of the reachable nodes and load the rest from the source.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from binascii import crc_hqx
from collections.abc import Sequence
from typing import Any

import redis
from redis.cluster import REDIS_CLUSTER_HASH_SLOTS, ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from .hashing import RendezvousHash
from .options import RedisOptions

log = logging.getLogger(__name__)

Value = bytes | str | memoryview
# Errors that mean "the store is unreachable or failing over", as opposed to a bug.
STORE_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
RETRYABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class Backend(ABC):
    @abstractmethod
    def fetch(self, keys: Sequence[str]) -> tuple[list[bytes | None], BaseException | None]:
        """Values (None: missing or on a failed node) and the first error met, if any."""

    @abstractmethod
    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool) -> tuple[list[bool], BaseException | None]:
        """Write; per key whether it was written (False: existed and not ``overwrite``, or failed)."""

    @abstractmethod
    def primaries(self) -> list[redis.Redis]:
        """One client per master, for administration (DBSIZE, SCAN, FLUSHDB)."""

    @abstractmethod
    def client_for_key(self, key: str) -> Any:
        """A client that accepts ordinary commands on ``key`` (for the catalog)."""

    @abstractmethod
    def close(self) -> None: ...


HIREDIS_PARSER: Any
NOT_ENOUGH_DATA: object = object()
try:  # the hiredis parser of redis-py: read many replies per socket read (see read_replies)
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
    from redis._parsers.hiredis import _HiredisParser as HIREDIS_PARSER
except ImportError:  # pragma: no cover - redis-py without its hiredis module
    HIREDIS_PARSER = None


def read_replies(conn: Any, n: int) -> list[Any]:
    """The next ``n`` replies on ``conn``; error replies are returned as ``ResponseError`` objects.

    With hiredis, replies are taken straight from redis-py's hiredis reader and the socket is read in large
    chunks: one Python step per reply instead of a ``read_response`` call each (about half the cost of a
    batch at this size). Other parsers go through ``read_response``.
    """
    parser: Any = conn._parser
    reader = getattr(parser, "_reader", None)
    if HIREDIS_PARSER is None or type(parser) is not HIREDIS_PARSER or reader is None:
        out = []
        for _ in range(n):
            try:
                out.append(conn.read_response())
            except redis.ResponseError as exc:
                out.append(exc)
        return out
    replies: list[Any] = []
    gets, append, more = reader.gets, replies.append, parser.read_from_socket
    while len(replies) < n:
        r = gets()
        if r is NOT_ENOUGH_DATA:
            more()
        else:
            append(r)
    return replies


def _read_pipelined(conns: list[tuple[redis.Redis, Any, list[int], Sequence[str]]], out: list[bytes | None],
                    redirected: list[int], multi: bool) -> BaseException | None:
    """Read the replies of commands already sent on every connection; keep the connections consistent."""
    error: BaseException | None = None
    for client, conn, idx, _keys in conns:
        try:
            if multi:  # one MGET per connection
                for j, v in zip(idx, conn.read_response(), strict=True):
                    out[j] = v
            else:  # one GET per key; MOVED/ASK/TRYAGAIN come back as error objects, the stream stays intact
                for j, v in zip(idx, read_replies(conn, len(idx)), strict=True):
                    if isinstance(v, BaseException):
                        redirected.append(j)
                    else:
                        out[j] = v
        except STORE_ERRORS as exc:
            conn.disconnect()
            error = error or exc
        finally:
            client.connection_pool.release(conn)
    return error


def pack_gets(keys: Sequence[bytes]) -> bytes:
    """RESP for one ``GET`` per key, packed in one pass (redis-py packs each command separately)."""
    return b"".join([b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(k), k) for k in keys])


def _send(client: redis.Redis, commands: list[tuple[Any, ...]] | bytes, retry: Retry) -> Any:
    """Send ``commands`` (or pre-packed RESP) on a pooled connection, reconnecting with backoff."""
    conn = client.connection_pool.get_connection()
    packed = commands if isinstance(commands, bytes) else None
    try:
        retry.call_with_retry(lambda: conn.send_packed_command([packed] if packed else conn.pack_commands(commands)),
                              lambda _err: conn.disconnect())
    except BaseException:
        conn.disconnect()
        client.connection_pool.release(conn)
        raise
    return conn


class NodesBackend(Backend):
    """Independent servers, keys placed by rendezvous hashing."""

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions) -> None:
        self.hosts = hosts
        self.options = options
        self.retry = options.retry()
        self.clients = [redis.Redis(host=h, port=p, retry=options.retry(), retry_on_error=list(RETRYABLE_ERRORS),
                                    **options.connection_kwargs()) for h, p in hosts]
        self.ring = RendezvousHash([f"{h}:{p}" for h, p in hosts])

    def _group(self, keys: Sequence[str]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        node_of = self.ring.node_of
        for j, k in enumerate(keys):
            groups.setdefault(node_of(k), []).append(j)
        return groups

    def fetch(self, keys: Sequence[str]) -> tuple[list[bytes | None], BaseException | None]:
        out: list[bytes | None] = [None] * len(keys)
        conns = []
        error: BaseException | None = None
        for node, idx in self._group(keys).items():
            try:
                conn = _send(self.clients[node], [("MGET", *[keys[j] for j in idx])], self.retry)
                conns.append((self.clients[node], conn, idx, keys))
            except STORE_ERRORS as exc:
                error = error or exc
        read_error = _read_pipelined(conns, out, [], multi=True)
        return out, error or read_error

    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool) -> tuple[list[bool], BaseException | None]:
        done = [False] * len(items)
        error: BaseException | None = None
        for node, idx in self._group([k for k, _ in items]).items():
            try:
                pipe = self.clients[node].pipeline(transaction=False)
                for j in idx:
                    pipe.set(items[j][0], items[j][1], nx=not overwrite)
                for j, ok in zip(idx, pipe.execute(), strict=True):
                    done[j] = bool(ok)
            except STORE_ERRORS as exc:
                error = error or exc
        return done, error

    def primaries(self) -> list[redis.Redis]:
        return list(self.clients)

    def client_for_key(self, key: str) -> redis.Redis:
        return self.clients[self.ring.node_of(key)]

    def close(self) -> None:
        for c in self.clients:
            c.close()


class ClusterBackend(Backend):
    """A real Redis Cluster through redis-py's cluster client."""

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions) -> None:
        self.options = options
        self.retry = options.retry()
        self.rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts], retry=options.retry(),
                               require_full_coverage=False, **options.connection_kwargs())
        self._slots: list[Any] | None = None

    def _refresh(self) -> None:
        # After a connection error the slot map may be stale (failover): reload it from a live node.
        self._slots = None
        try:
            self.rc.nodes_manager.initialize()
        except STORE_ERRORS as exc:
            log.debug("cluster slot map refresh failed: %s", exc)

    def _slot_table(self) -> list[Any]:
        """The primary serving each slot (None: uncovered), cached until the slot map is refreshed."""
        if self._slots is None:
            cache = self.rc.nodes_manager.slots_cache
            self._slots = [cache[s][0] if cache.get(s) else None for s in range(REDIS_CLUSTER_HASH_SLOTS)]
        return self._slots

    def fetch(self, keys: Sequence[str]) -> tuple[list[bytes | None], BaseException | None]:
        out: list[bytes | None] = [None] * len(keys)
        groups: dict[str, tuple[Any, list[int], list[bytes]]] = {}
        error: BaseException | None = None
        table = self._slot_table()
        for j, k in enumerate(keys):
            raw = k.encode()
            # Cache keys carry no hash tag ({ is percent-encoded in names); other keys take the full rule.
            node = table[crc_hqx(raw, 0) & 16383 if b"{" not in raw else key_slot(raw)]
            if node is None:  # a slot without a serving node
                self._refresh()
                return out, redis.exceptions.ClusterDownError(f"no cluster node serves the slot of {k!r}")
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (node, [], [])
            group[1].append(j)
            group[2].append(raw)
        conns = []
        for node, idx, raw_keys in groups.values():
            client = node.redis_connection
            if client is None:
                self._refresh()
                return out, redis.ConnectionError(f"no connection to cluster node {node.name}")
            try:
                conns.append((client, _send(client, pack_gets(raw_keys), self.retry), idx, keys))
            except STORE_ERRORS as exc:
                error = error or exc
        redirected: list[int] = []
        error = error or _read_pipelined(conns, out, redirected, multi=False)
        if redirected:  # let RedisCluster follow MOVED/ASK and update its slot map
            self._slots = None
            try:
                for j, v in zip(redirected, self.rc.mget_nonatomic([keys[j] for j in redirected]), strict=True):
                    out[j] = v
            except STORE_ERRORS as exc:
                error = error or exc
        if error is not None:
            self._refresh()
        return out, error

    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool) -> tuple[list[bool], BaseException | None]:
        try:
            pipe = self.rc.pipeline()
            for k, v in items:
                pipe.set(k, v, nx=not overwrite)
            return [bool(ok) for ok in pipe.execute()], None
        except STORE_ERRORS as exc:
            self._refresh()
            return [False] * len(items), exc

    def primaries(self) -> list[redis.Redis]:
        return [n.redis_connection for n in self.rc.get_primaries() if n.redis_connection is not None]

    def client_for_key(self, key: str) -> RedisCluster:
        return self.rc

    def close(self) -> None:
        self.rc.close()


def probe_is_cluster(hosts: list[tuple[str, int]], options: RedisOptions) -> bool:
    """Ask the first reachable host whether cluster mode is enabled."""
    last: BaseException | None = None
    for h, p in hosts:
        try:
            with redis.Redis(host=h, port=p, retry=options.retry(), **options.connection_kwargs()) as c:
                return bool(int(c.info("cluster").get("cluster_enabled", 0)))
        except (redis.AuthenticationError, redis.exceptions.NoPermissionError):
            raise  # the same credentials fail on every host; say so instead of "unreachable"
        except STORE_ERRORS as exc:
            last = exc
    raise redis.ConnectionError(f"no Redis host of {hosts} is reachable: {last}")
