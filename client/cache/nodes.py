"""The nodes of a :class:`~.store.RedisStore`: how it talks to its servers (independent servers here, a Redis
Cluster in :mod:`.cluster_nodes`), and what both share.

A store holds one :class:`ServerNodes` or :class:`~.cluster_nodes.ClusterNodes`, per process (its ``nodes``);
neither is a store (:class:`~.store.Store` is the one interface samples are read through). Batched reads send
their commands on every node before reading any reply, so a batch costs about one round trip however many
nodes it touches. Failures are isolated per node: a node that fails is skipped (no network call) until its
next try (:class:`~.faults.NodeBreakers`), and the keys of the other nodes keep being read and written. Nodes
report failures beside the values instead of raising, so the loader serves the keys of the reachable nodes and
loads the rest from the source.

**Read ports** (docs/deployment.md, "Open reads"; :class:`ReadPorts`). A node's read port is its client port
plus the deployment's offset (:attr:`~.options.RedisOptions.read_port_offset`): plaintext, where the
password-less reader (:mod:`bagua_lightning.core.read_plane`) may only read. The ``GET``\\s of sealed entries
(``fetch(keys, sealed=True)``) go there, never a secret. A read port that refuses, does not answer or breaks
off mid-read is the read port's failure, not its node's: it is left alone for :data:`RETRY_S` (one warning
while it keeps failing), and its keys are read again through the node's client port. The converse holds too: a
read port's answer is not its node's. A node that is down (backing off) is tried again through its client port
only, which proves the node (TLS, the password), so whatever answers on a dead node's read port (a squatter
that takes every read and answers nil) can neither end the node's outage nor start a new one at every try.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from ...core.pinned_redis import redis_client
from ...core.redis_server import reader_client
from .faults import NodeBreakers
from .hashing import RendezvousHash
from .options import SOCKET_READ_SIZE, RedisOptions
from .resp import BufferPool, HeldConnections, Receiver, Replies, _raw_socket, pack_gets, read_replies

__all__ = ["STORE_ERRORS", "Nodes", "ReadPorts", "ServerNodes", "Value", "probe_is_cluster"]

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


RETRY_S = 30.0  # a read port that failed is tried again after this long
NO_RETRY = Retry(NoBackoff(), 0)  # a read port that fails is left for the client port at once
REFUSED = "NOPERM"  # an error reply for a key the reader may not read: read it through the client port


class ReadPorts:
    """The read-port clients of a store's nodes, by the node's (host, client port) (see the module's docstring)."""

    def __init__(self, options: RedisOptions) -> None:
        self.options = options
        self.offset = options.read_port_offset
        self._clients: dict[tuple[str, int], redis.Redis] = {}
        self._off: dict[tuple[str, int], float] = {}  # read ports that failed -> when to try again

    def client(self, host: str, port: int) -> redis.Redis | None:
        """The read-port client of the node at ``host:port``; None: no read ports, or this one failed lately."""
        where = (host, port)
        if self.offset is None or time.monotonic() < self._off.get(where, 0.0):
            return None
        client = self._clients.get(where)
        if client is None:
            client = self._clients[where] = reader_client(
                host, port + self.offset, self.options.socket_timeout_s, self.options.connect_timeout_s,
                socket_read_size=SOCKET_READ_SIZE)
        return client

    def failed(self, host: str, port: int, name: str, exc: BaseException) -> None:
        """Leave the read port of the node at ``host:port`` alone for :data:`RETRY_S`."""
        where = (host, port)
        if where not in self._off:
            log.warning("the read port %s:%d of cache node %s failed (%s); reading through its client port, "
                        "trying the read port again in %.0f s", host, port + (self.offset or 0), name, exc, RETRY_S)
        self._off[where] = time.monotonic() + RETRY_S

    def reclaim(self, failed: list[tuple[str, BaseException]], by_reader: dict[str, tuple[str, int, list[int]]]
                ) -> list[int]:
        """Take the failures of the read ports (``by_reader``: node name -> host, port, key indices read there)
        out of ``failed``, their nodes did not fail; the indices of their keys, to read again."""
        again: list[int] = []
        for name, lost in [f for f in failed if f[0] in by_reader]:
            host, port, idx = by_reader[name]
            self.failed(host, port, name, lost)
            again += idx
        failed[:] = [f for f in failed if f[0] not in by_reader]
        return again

    def clients(self) -> list[Any]:
        return list(self._clients.values())

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


class Nodes:
    """What :class:`ServerNodes` and :class:`~.cluster_nodes.ClusterNodes` share: the settings, the per-node
    breakers, the connections held per thread, the receive buffers and the read ports.

    Both have ``fetch(keys, sealed)`` (encoded keys; values as views of the receive buffers, in a
    :class:`~.resp.Replies`; None: missing or on a failed node; and the first error met), ``put(items,
    overwrite)``, ``writable()``, ``primaries()`` (one client per master, for administration),
    ``client_for_key(key)`` (for the catalog) and ``close()``.
    """

    reply_bytes = 0  # size of a recent reply: sizes the receive buffers of the next fetch

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions, breakers: NodeBreakers | None) -> None:
        self.options = options
        self.breakers = breakers if breakers is not None else NodeBreakers(f"Redis at {hosts}")
        self.retry = options.retry()
        self.pool = BufferPool()
        self.held = HeldConnections()
        self.reads = ReadPorts(options)
        self.skipped: list[str] = []  # nodes left out of the last batch: backing off

    def _receiver(self, n: int) -> Receiver:
        """A receive area for ``n`` replies, sized by the values of a recent fetch."""
        return Receiver((self.reply_bytes + 32) * n, self.reply_bytes, self.pool, n)

    def _learn(self, out: list[Any]) -> None:
        for v in out:
            if v is not None:
                self.reply_bytes = len(v)
                return


Sent = tuple[redis.Redis, Any, list[int], str]  # (client, connection, key indices, node name)


def read_pipelined(conns: list[Sent], out: list[Any], errored: list[tuple[int, BaseException]], receiver: Receiver,
                   held: HeldConnections, failed: list[tuple[str, BaseException]]) -> Any:
    """Read the ``GET`` replies of commands already sent on every (held) connection. A connection whose replies
    were not all read is dropped, never used again.

    Values go to ``out``; error replies (MOVED, ASK, CLUSTERDOWN, WRONGTYPE...) to ``errored`` as (key index,
    error); nodes whose read failed to ``failed`` as (name, error). Values are views of the receive buffers (or
    ``bytes`` where redis-py's parser had bytes of its own buffered). Returns the run of the values (see
    :class:`~.resp.Replies`).
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
    return receiver.run(order)


def backing_off(names: list[str]) -> BaseException | None:
    """The error of a write that skipped nodes backing off (their keys were not written), if it did."""
    return redis.ConnectionError(f"{', '.join(names)} unavailable (backing off)") if names else None


def node_down_reply(reply: BaseException) -> bool:
    """Whether an error reply says the node cannot serve at all (then it is backed off)."""
    return str(reply).startswith(NODE_DOWN_REPLIES)


class ServerNodes(Nodes):
    """Independent servers, keys placed by rendezvous hashing."""

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions,
                 breakers: NodeBreakers | None = None) -> None:
        super().__init__(hosts, options, breakers)
        self.hosts = hosts
        self.clients = [redis_client(h, p, retry=options.retry(), retry_on_error=list(RETRYABLE_ERRORS),
                                     **options.connection_kwargs()) for h, p in hosts]
        self.names = [f"{h}:{p}" for h, p in hosts]
        self.ring = RendezvousHash(self.names)

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

    def fetch(self, keys: Sequence[bytes], sealed: bool = False) -> tuple[list[Any], BaseException | None]:
        out: list[Any] = [None] * len(keys)
        conns: list[Sent] = []
        failed: list[tuple[str, BaseException]] = []
        by_reader: dict[str, tuple[str, int, list[int]]] = {}  # nodes read from their read port (sealed)
        for node, idx in self._group(keys).items():
            client, name = self.clients[node], self.names[node]
            packed = pack_gets([keys[j] for j in idx])
            host, port = self.hosts[node]
            reader = self.reads.client(host, port) if sealed and name not in self.breakers.down else None
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
        run = read_pipelined(conns, out, errored, self._receiver(len(keys)), self.held, failed)
        again = [j for j, e in errored if str(e).startswith(REFUSED)]
        if by_reader and failed:
            again += self.reads.reclaim(failed, by_reader)
        down = {self.ring.node_of(keys[j]) for j, e in errored if node_down_reply(e)}
        failed += [(self.names[n], redis.exceptions.ResponseError(f"{self.names[n]} cannot serve")) for n in down]
        error = self.breakers.account([c[3] for c in conns], failed) or backing_off(self.skipped)
        if again:
            values, err = self.fetch([keys[j] for j in again])
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
