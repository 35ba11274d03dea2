"""How a :class:`~.store.RedisStore` talks to independent servers, and what every backend shares.

Batched reads send their commands on every node before reading any reply, so a batch costs about one round
trip however many nodes it touches. Failures are isolated per node: a node that fails is skipped (no network
call) until its next try (:class:`~.faults.NodeBreakers`), and the keys of the other nodes keep being read and
written. Backends report failures beside the values instead of raising, so the loader serves the keys of the
reachable nodes and loads the rest from the source. A Redis Cluster is :mod:`.cluster_backend`'s.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import redis
import redis.exceptions
from redis.retry import Retry

from ...core.pinned_redis import redis_client
from .faults import NodeBreakers
from .hashing import RendezvousHash
from .options import RedisOptions
from .read_ports import NO_RETRY, REFUSED, ReadPorts
from .resp import BufferPool, Receiver, Replies, _raw_socket, pack_gets, read_replies
from .tls_decrypt import DecryptWorkers
from .tls_stream import take_connection

__all__ = ["STORE_ERRORS", "Backend", "BufferPool", "HeldConnections", "NodesBackend", "Receiver", "Replies",
           "Value", "pack_gets", "probe_is_cluster", "read_replies"]

log = logging.getLogger(__name__)

Value = bytes | str | memoryview


def _redis_error_roots() -> tuple[type[BaseException], ...]:
    """The roots of redis-py's whole exception hierarchy (``RedisError``, but also ``RedisClusterException`` and
    the others that do not derive from it), plus hiredis' own errors."""
    found = {c for c in vars(redis.exceptions).values()
             if isinstance(c, type) and issubclass(c, Exception) and c.__module__.startswith("redis")}
    try:
        import hiredis

        found |= {c for c in vars(hiredis).values() if isinstance(c, type) and issubclass(c, Exception)}
    except ImportError:  # pragma: no cover - redis-py without hiredis
        pass
    return tuple(sorted((c for c in found if not any(o is not c and issubclass(c, o) for o in found)),
                        key=lambda c: c.__name__))


# Errors that mean "the store is unreachable, failing over or confused", as opposed to a bug in the caller:
# whatever redis-py (or hiredis) can raise, and socket errors. None of them may reach training.
STORE_ERRORS: tuple[type[BaseException], ...] = (*_redis_error_roots(), OSError)
RETRYABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError)
# Error replies after which a node is backed off like an unreachable one (it answers, but cannot serve).
NODE_DOWN_REPLIES = ("CLUSTERDOWN", "MASTERDOWN", "LOADING")


class Backend(ABC):
    """Reads and writes of one store, with one :class:`~.faults.NodeBreakers` per process (``breakers``)."""

    reply_bytes = 0  # size of a recent reply: sizes the receive buffers of the next fetch
    pool: BufferPool
    breakers: NodeBreakers

    @abstractmethod
    def fetch(self, keys: Sequence[bytes], views: bool = False, *, open_reads: bool = False
              ) -> tuple[list[Any], BaseException | None]:
        """Values of ``keys`` (encoded; None: missing or on a failed node) and the first error met, if any.

        ``views``: values may be read-only views of receive buffers instead of ``bytes`` (faster; for callers
        that copy what they keep). ``open_reads``: the caller authenticates and decrypts the entries itself
        (sealed with the cache key), so they may come from the nodes' read ports where they have them.
        """

    def _receiver(self, n: int) -> Receiver:
        """A receive area for ``n`` replies, sized by the values of a recent fetch."""
        return Receiver((self.reply_bytes + 32) * n, self.reply_bytes, self.pool, n)

    def _learn(self, out: list[Any]) -> None:
        for v in out:
            if v is not None:
                self.reply_bytes = len(v)
                return

    @abstractmethod
    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool) -> tuple[list[bool], BaseException | None]:
        """Write; per key whether it was written (False: existed and not ``overwrite``, or its node failed)."""

    @abstractmethod
    def writable(self) -> bool:
        """Whether some master is not backing off (no network call)."""

    @abstractmethod
    def primaries(self) -> list[redis.Redis]:
        """One client per master, for administration (DBSIZE, SCAN, FLUSHDB)."""

    @abstractmethod
    def client_for_key(self, key: str) -> Any:
        """A client that accepts ordinary commands on ``key`` (for the catalog)."""

    @abstractmethod
    def close(self) -> None: ...


Sent = tuple[redis.Redis, Any, list[int], str]  # (client, connection, key indices, node name)


def read_pipelined(conns: list[Sent], out: list[Any], errored: list[tuple[int, BaseException]], views: bool,
                   receiver: Receiver, held: HeldConnections, failed: list[tuple[str, BaseException]]) -> Any:
    """Read the ``GET`` replies of commands already sent on every (held) connection. A connection whose replies
    were not all read is dropped, never used again.

    Values go to ``out``; error replies (MOVED, ASK, CLUSTERDOWN, WRONGTYPE...) to ``errored`` as (key index,
    error); nodes whose read failed to ``failed`` as (name, error). Returns, with ``views``, the run of the values
    (see :class:`Replies`). ``views``: values may be views of the receive buffers, else ``bytes``.
    """
    order: list[int] = []  # the keys in the order their values were received
    if len(conns) > 1 and held.decrypt_threads:
        # TLS: the other nodes' replies decrypted each on its own thread while this one decrypts the first's
        held.prefetch(conns[1:])
    for at, (client, conn, idx, name) in enumerate(conns):
        try:
            sock = _raw_socket(conn)
            if sock is not None:
                replies = receiver.read(sock, len(idx))
                if not views:
                    replies = [bytes(v) if type(v) is memoryview else v for v in replies]
            else:
                replies = read_replies(conn, len(idx))
                receiver.even = False
            for j, v in zip(idx, replies, strict=True):
                if isinstance(v, BaseException):
                    errored.append((j, v))
                else:
                    out[j] = v
            order += idx
        except STORE_ERRORS as exc:
            held.drop(client, conn)
            failed.append((name, exc))
        except BaseException:
            for c in conns[at:]:  # this one and those not read: out of step, never used so
                held.drop(c[0], c[1])
            raise
    receiver.pool.give(receiver.used)
    # A failed read, an error reply (a redirection) or a nil leaves the receiver uneven: no run then.
    return receiver.run(order) if views else None


def backing_off(names: list[str]) -> BaseException | None:
    """The error of a write that skipped nodes backing off (their keys were not written), if it did."""
    return redis.ConnectionError(f"{', '.join(names)} unavailable (backing off)") if names else None


def node_down_reply(reply: BaseException) -> bool:
    """Whether an error reply says the node cannot serve at all (then it is backed off)."""
    return str(reply).startswith(NODE_DOWN_REPLIES)


class _Held:
    """One thread's held connections: ``conns``, id(client) -> (client, connection). Given back when the thread
    ends (its ``threading.local`` storage goes, and this with it)."""

    __slots__ = ("__weakref__", "conns", "workers")

    def __init__(self) -> None:
        self.conns: dict[int, tuple[Any, Any]] = {}
        self.workers = DecryptWorkers()  # TLS: one decrypting thread per node, started on first use

    def give_back(self) -> None:
        conns, self.conns = list(self.conns.values()), {}
        for client, conn in conns:
            conn.disconnect()
            client.connection_pool.release(conn)
        self.workers.stop()

    def __del__(self) -> None:
        try:
            self.give_back()
        except Exception:  # interpreter shutdown: nothing left to tidy
            pass


class HeldConnections:
    """One connection per node and thread, kept out of the node's connection pool from one fetch to the next.

    A fetch then skips the pool's checkout and return (a lock, a liveness poll of the socket, bookkeeping,
    metrics): about a tenth of the cost of reading a batch. Over TLS the held connection is a
    :class:`~.tls_stream.MemoryTLSConnection` (records decrypted from memory, many per call); with
    ``decrypt_threads`` set (off by default: slower where measured), a batch's replies from several
    nodes are decrypted at once, one thread per node (:mod:`.tls_decrypt`; started once, kept with the
    connections). Every fetch reads all the replies it asked for or
    drops the connection (:meth:`drop`), so a held connection never carries a stray reply into the next fetch;
    the reader also refuses bytes beyond the replies it expects. A forked child (a DataLoader worker) forgets the
    connections of its parent without touching them and holds its own.
    """

    def __init__(self) -> None:
        # TLS: decrypt each node's replies on its own thread (opt-in). Off by default: the hand-overs cost
        # more than the parallel decryption gains, measured on 2 cores and on 64 (docs/benchmarks.md).
        self.decrypt_threads = False
        self._pid = os.getpid()
        self._local = threading.local()
        self._threads: weakref.WeakSet[_Held] = weakref.WeakSet()

    def _held(self) -> _Held:
        if self._pid != os.getpid():  # a forked child: the parent's sockets (and threads) are the parent's
            for inherited in list(self._threads):
                inherited.conns, inherited.workers = {}, DecryptWorkers()  # forgotten, not closed
            self._pid, self._local, self._threads = os.getpid(), threading.local(), weakref.WeakSet()
        held: _Held | None = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = _Held()
            self._threads.add(held)
        return held

    def _mine(self) -> dict[int, tuple[Any, Any]]:
        return self._held().conns

    def prefetch(self, conns: list[Sent]) -> None:
        """Start decrypting the replies of every TLS connection of ``conns`` (sent, not yet read), each on its
        node's worker thread (:mod:`.tls_decrypt`); plaintext connections are left as they are."""
        self._held().workers.start([(id(client), conn, len(idx)) for client, conn, idx, _ in conns])

    def send(self, client: redis.Redis, packed: bytes, retry: Retry) -> Any:
        """Send pre-packed RESP on this thread's connection to ``client``, reconnecting with backoff."""
        mine = self._mine()
        entry = mine.get(id(client))
        if entry is None or entry[0] is not client:
            entry = mine[id(client)] = (client, take_connection(client.connection_pool))  # TLS: decrypted from memory
        conn = entry[1]
        try:
            retry.call_with_retry(lambda: conn.send_packed_command([packed]), lambda _err: conn.disconnect())
        except BaseException:
            self.drop(client, conn)
            raise
        return conn

    def drop(self, client: redis.Redis, conn: Any) -> None:
        """Disconnect ``conn`` and give it back to its pool; the next fetch takes a fresh one."""
        conn.disconnect()
        mine = self._mine()
        if mine.get(id(client), (None, None))[1] is conn:
            del mine[id(client)]
        client.connection_pool.release(conn)

    def forget(self, clients: list[Any]) -> None:
        """Give back this thread's connections to clients other than ``clients`` (nodes that left the cluster)."""
        mine = self._mine()
        live = {id(c) for c in clients}
        for key in [k for k in mine if k not in live]:
            client, conn = mine.pop(key)
            conn.disconnect()
            client.connection_pool.release(conn)
            self._held().workers.forget(key)

    def close(self) -> None:
        """Give back every thread's connections."""
        if self._pid == os.getpid():
            for held in list(self._threads):
                held.give_back()
        self._local, self._threads = threading.local(), weakref.WeakSet()


class NodesBackend(Backend):
    """Independent servers, keys placed by rendezvous hashing."""

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions,
                 breakers: NodeBreakers | None = None) -> None:
        self.hosts = hosts
        self.options = options
        self.breakers = breakers if breakers is not None else NodeBreakers(f"Redis at {hosts}")
        self.retry = options.retry()
        self.clients = [redis_client(h, p, retry=options.retry(), retry_on_error=list(RETRYABLE_ERRORS),
                                     **options.connection_kwargs()) for h, p in hosts]
        self.names = [f"{h}:{p}" for h, p in hosts]
        self.ring = RendezvousHash(self.names)
        self.pool = BufferPool()
        self.held = HeldConnections()
        self.reads = ReadPorts(options)
        self.skipped: list[str] = []

    def _group(self, keys: Sequence[str | bytes]) -> dict[int, list[int]]:
        """The keys by node; nodes backing off are left out (their keys are misses, without a network call) and
        named in ``self.skipped``."""
        groups: dict[int, list[int]] = {}
        node_of = self.ring.node_of
        for j, k in enumerate(keys):
            groups.setdefault(node_of(k), []).append(j)
        self.skipped = []
        if self.breakers.down:
            available = self.breakers.available
            self.skipped = [self.names[n] for n in groups if not available(self.names[n])]
            groups = {n: idx for n, idx in groups.items() if available(self.names[n])}
        return groups

    def fetch(self, keys: Sequence[bytes], views: bool = False, *, open_reads: bool = False
              ) -> tuple[list[Any], BaseException | None]:
        out: list[Any] = [None] * len(keys)
        conns: list[Sent] = []
        failed: list[tuple[str, BaseException]] = []
        by_reader: dict[str, tuple[str, int, list[int]]] = {}  # nodes read from their read port (open reads)
        for node, idx in self._group(keys).items():
            client, name = self.clients[node], self.names[node]
            packed = pack_gets([keys[j] for j in idx])
            host, port = self.hosts[node]
            reader = self.reads.client(host, port) if open_reads else None
            try:
                if reader is not None:
                    try:
                        conns.append((reader, self.held.send(reader, packed, NO_RETRY), idx, name))
                        by_reader[name] = (host, port, idx)
                        continue
                    except STORE_ERRORS as exc:
                        self.reads.failed(host, port, name, exc)
                conns.append((client, self.held.send(client, packed, self.retry), idx, name))
            except STORE_ERRORS as exc:
                failed.append((name, exc))
        # An error reply here (WRONGTYPE: a key of another type) leaves the value None, a miss, as MGET did;
        # a key the reader may not read, or one whose read port broke off, is read again through the client port.
        errored: list[tuple[int, BaseException]] = []
        run = read_pipelined(conns, out, errored, views, self._receiver(len(keys)), self.held, failed)
        again = [j for j, e in errored if str(e).startswith(REFUSED)]
        if by_reader and failed:
            again += self.reads.reclaim(failed, by_reader)
        down = {self.ring.node_of(keys[j]) for j, e in errored if node_down_reply(e)}
        failed += [(self.names[n], redis.exceptions.ResponseError(f"{self.names[n]} cannot serve")) for n in down]
        error = self.breakers.account([c[3] for c in conns], failed) or backing_off(self.skipped)
        if again:
            values, err = self.fetch([keys[j] for j in again], views)
            for j, v in zip(again, values, strict=True):
                out[j] = v
            error, run = error or err, None
        self._learn(out)
        return Replies(out, run), error

    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool) -> tuple[list[bool], BaseException | None]:
        done = [False] * len(items)
        tried: list[str] = []
        failed: list[tuple[str, BaseException]] = []
        for node, idx in self._group([k for k, _ in items]).items():
            name = self.names[node]
            tried.append(name)
            try:
                pipe = self.clients[node].pipeline(transaction=False)
                for j in idx:
                    pipe.set(items[j][0], items[j][1], nx=not overwrite)
                for j, ok in zip(idx, pipe.execute(raise_on_error=False), strict=True):
                    done[j] = ok is True  # None: existed (NX); an error object: not written
            except STORE_ERRORS as exc:
                failed.append((name, exc))
        return done, self.breakers.account(tried, failed) or backing_off(self.skipped)

    def writable(self) -> bool:
        return any(map(self.breakers.available, self.names))

    def primaries(self) -> list[redis.Redis]:
        return list(self.clients)

    def client_for_key(self, key: str) -> redis.Redis:
        return self.clients[self.ring.node_of(key)]

    def close(self) -> None:
        self.held.close()
        for c in self.clients:
            c.close()
        self.reads.close()


def probe_is_cluster(hosts: list[tuple[str, int]], options: RedisOptions) -> bool:
    """Ask the first reachable host whether cluster mode is enabled."""
    last: BaseException | None = None
    for h, p in hosts:
        try:
            with redis_client(h, p, retry=options.retry(), **options.connection_kwargs()) as c:
                return bool(int(c.info("cluster").get("cluster_enabled", 0)))
        except (redis.AuthenticationError, redis.exceptions.NoPermissionError):
            raise  # the same credentials fail on every host; say so instead of "unreachable"
        except STORE_ERRORS as exc:
            last = exc
    raise redis.ConnectionError(f"no Redis host of {hosts} is reachable: {last}")
