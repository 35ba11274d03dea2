"""How a :class:`~.store.RedisStore` talks to its servers: a Redis Cluster or independent servers.

Batched reads send their commands on every node before reading any reply, so a batch costs about one round
trip however many nodes it touches. Each backend reports failures per call instead of raising, so the
loader can serve the keys of the reachable nodes and load the rest from the source.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from abc import ABC, abstractmethod
from binascii import crc_hqx
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import redis
from redis.cluster import REDIS_CLUSTER_HASH_SLOTS, ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from .hashing import RendezvousHash
from .options import RedisOptions
from .values import REPLY_ALIGN

log = logging.getLogger(__name__)

Value = bytes | str | memoryview
# Errors that mean "the store is unreachable or failing over", as opposed to a bug.
STORE_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
RETRYABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class Backend(ABC):
    @abstractmethod
    def fetch(self, keys: Sequence[bytes], views: bool = False) -> tuple[list[Any], BaseException | None]:
        """Values of ``keys`` (encoded; None: missing or on a failed node) and the first error met, if any.

        ``views``: values may be read-only views of receive buffers instead of ``bytes`` (faster; for callers
        that copy what they keep).
        """

    reply_bytes = 0  # size of a recent reply: sizes the receive buffers of the next fetch
    pool: BufferPool

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


def _raw_socket(conn: Any) -> Any:
    """The connection's socket when nothing is buffered in its parser (so the next bytes are our replies)."""
    parser: Any = conn._parser
    reader = getattr(parser, "_reader", None)
    if reader is not None:  # hiredis
        return None if reader.has_data() else conn._sock
    unread = getattr(getattr(parser, "_buffer", None), "unread_bytes", None)
    return conn._sock if callable(unread) and unread() == 0 else None


MIN_CHUNK = 1 << 16
MAX_POOLED = 8  # receive buffers kept per backend for reuse


def _refs_when_free() -> int:
    pool = [bytearray(1)]
    buf = pool.pop()
    return sys.getrefcount(buf)


_FREE = _refs_when_free()  # references to a popped buffer that no view holds (calibrated: it varies by version)


class BufferPool:
    """Receive buffers reused from one fetch to the next, once no view of them is left.

    A buffer is taken out of the pool while it is filled (so no other thread can take it) and put back after;
    it is handed out again only when its reference count shows that no view of it survives, so a caller that
    keeps a value keeps its bytes. Allocating (and zeroing) a fresh buffer per fetch cost about as much as
    parsing the replies.
    """

    def __init__(self) -> None:
        self._free: list[bytearray] = []

    def take(self, size: int) -> bytearray:
        """A free pooled buffer of at least ``size`` bytes, or a new one. Pooled buffers that some view still
        holds are forgotten (their views keep them alive), so the pool never fills up with them."""
        while True:
            try:
                buf = self._free.pop()
            except IndexError:
                break
            if sys.getrefcount(buf) <= _FREE and len(buf) >= size:
                return buf
        # An eighth more, so that a buffer fits the next batches, whose sizes vary a little. Not more: samples
        # decoded where they lie keep their batch's whole buffer alive.
        return bytearray(size + (size >> 3))

    def give(self, bufs: list[bytearray]) -> None:
        """Pool ``bufs`` (after a whole fetch: buffers given back while it runs would be forgotten as busy)."""
        for buf in bufs:
            if len(self._free) < MAX_POOLED:
                self._free.append(buf)


class Replies(list[Any]):
    """A fetch's values, in key order (views of receive buffers or ``bytes``; None: missing), and ``run``: where
    they lie when they lie evenly, else None.

    ``run = (buffer, first, stride, order)``: the value of key ``order[r]`` starts at ``first + r * stride`` in
    ``buffer`` (one header, back to back, in one buffer), so a decoder can treat the batch as one strided array.
    """

    __slots__ = ("run",)

    def __init__(self, values: list[Any], run: tuple[bytearray, int, int, list[int]] | None = None) -> None:
        super().__init__(values)
        self.run = run


class Receiver:
    """The receive area of one fetch: the ``GET`` replies of every node, back to back in pooled buffers.

    Replies are received straight into large buffers and returned as views of them: one copy from the kernel and
    no object per reply but its view, where a RESP parser copies every value twice more (into its buffer, then
    into a ``bytes``). A view keeps its buffer alive; a buffer returns to the pool once the fetch is over, and
    is handed out again only when no view of it is left (:class:`BufferPool`).

    The first value is placed on a :data:`~.values.REPLY_ALIGN` boundary (its size is guessed from the previous
    fetch), and entries are padded so that their replies span a multiple of it, so every value of a dataset of
    one sample size starts on that boundary. :attr:`even` stays true while every reply of the fetch has had the
    same header and landed right after the previous one in the same buffer.
    """

    def __init__(self, size_hint: int, value_hint: int, pool: BufferPool, replies: int = 0) -> None:
        self.pool = pool
        # Sized by the previous values (a buffer that fits is what lets a batch be decoded where it lies); the
        # first fetch knows nothing and starts with a chunk.
        self.buf = pool.take((size_hint if value_hint else max(size_hint, MIN_CHUNK)) + REPLY_ALIGN)
        self.used = [self.buf]  # the buffers filled: back to the pool once the fetch is over
        self.mv = memoryview(self.buf)
        self.filled = -(len(b"$%d\r\n" % value_hint)) % REPLY_ALIGN if value_hint else 0
        self.header, self.header_len, self.value_len = b"", 0, 0  # the last bulk header: a dataset's repeat
        self.first = -1  # where the first value lies
        self.even = True
        self.left = replies  # replies still expected in this fetch (sizes a new buffer)

    def read(self, sock: Any, n: int) -> list[Any]:
        """The next ``n`` replies on ``sock``, each a ``GET``'s: a view of its bytes, None, or a ``ResponseError``.

        Raises:
            redis.ConnectionError: the stream closed, or holds something that is not ``n`` GET replies (then the
                connection must be dropped: it is out of step).
        """
        out: list[Any] = []
        append = out.append
        buf, mv, filled = self.buf, self.mv, self.filled
        pos = filled  # this connection's replies follow the previous connection's
        need = 0  # bytes that must be in ``buf`` from ``pos`` before parsing again
        header, header_len, value_len, even = self.header, self.header_len, self.value_len, self.even
        try:
            while len(out) < n:
                if header_len and buf.startswith(header, pos, filled):
                    end = pos + header_len + value_len
                    if end + 2 <= filled:
                        append(mv[pos + header_len:end])
                        pos, need = end + 2, 0
                        continue
                e = buf.find(b"\r\n", pos, filled) if filled - pos >= need else -1
                if e < 0:
                    if need < filled - pos + 1:
                        need = filled - pos + 1
                    if pos + need > len(buf):  # does not fit: a new buffer (views of the old one stay valid)
                        per = header_len + value_len + 2 if header_len else need
                        size = max(need, MIN_CHUNK, per * (max(self.left, n) - len(out)) + need)
                        new = self.pool.take(size + REPLY_ALIGN)
                        self.used.append(new)
                        at = pos % REPLY_ALIGN  # what lay on the boundary still does
                        new[at:at + filled - pos] = mv[pos:filled]
                        buf, mv, filled, pos, even = new, memoryview(new), at + filled - pos, at, False
                    got = sock.recv_into(mv[filled:])
                    if not got:
                        raise redis.ConnectionError("Connection closed by server.")
                    filled += got
                    continue
                t = buf[pos]
                if t == 36:  # $: a bulk string, or $-1 (nil)
                    try:
                        size = int(buf[pos + 1:e])
                    except ValueError:
                        raise redis.ConnectionError(f"malformed reply header {bytes(buf[pos:e])[:40]!r}") from None
                    if size < 0:
                        append(None)
                        pos, need, even = e + 2, 0, False
                        continue
                    end = e + 2 + size
                    if end + 2 > filled:
                        need = end + 2 - pos
                        continue
                    if self.first < 0:
                        self.first = e + 2
                    elif size != value_len or e + 2 - pos != header_len:
                        even = False
                    append(mv[e + 2:end])
                    header, header_len, value_len = bytes(buf[pos:e + 2]), e + 2 - pos, size
                    pos, need = end + 2, 0
                elif t == 95:  # _: RESP3 null
                    append(None)
                    pos, need, even = e + 2, 0, False
                elif t == 45:  # -: an error (MOVED, ASK, TRYAGAIN, ...): the stream stays intact
                    append(redis.ResponseError(buf[pos + 1:e].decode("utf-8", "replace")))
                    pos, need, even = e + 2, 0, False
                else:
                    raise redis.ConnectionError(f"unexpected reply type {chr(t)!r} to GET")
            if pos != filled:  # bytes nobody asked for: the stream is out of step
                raise redis.ConnectionError(f"{filled - pos} unexpected bytes after {n} GET replies")
        except BaseException:
            self.even = False  # the next connection starts where this one did: its views stay valid
            raise
        self.buf, self.mv, self.filled = buf, mv, pos
        self.header, self.header_len, self.value_len, self.even = header, header_len, value_len, even
        self.left -= n
        return out

    def run(self, order: list[int]) -> tuple[bytearray, int, int, list[int]] | None:
        """The even run of this fetch's values (see :class:`Replies`), if they formed one and fill most of their
        buffer (samples decoded where they lie keep all of it alive: tiny batches in a large buffer are copied)."""
        if not self.even or self.first < 0 or len(self.used) != 1:
            return None
        stride = self.header_len + self.value_len + 2
        if len(self.buf) > (self.first + stride * len(order)) * 5 // 4 + REPLY_ALIGN:
            return None
        return self.buf, self.first, stride, order


def _read_pipelined(conns: list[tuple[redis.Redis, Any, list[int]]], out: list[Any], redirected: list[int],
                    views: bool, receiver: Receiver, held: HeldConnections) -> tuple[BaseException | None, Any]:
    """Read the ``GET`` replies of commands already sent on every (held) connection. A connection whose replies
    were not all read is dropped, never used again.

    Returns the first error met and, with ``views``, the run of the values (see :class:`Replies`). ``views``:
    values may be views of the receive buffers, else ``bytes``.
    """
    error: BaseException | None = None
    order: list[int] = []  # the keys in the order their values were received
    for client, conn, idx in conns:
        try:
            sock = _raw_socket(conn)
            if sock is not None:
                replies = receiver.read(sock, len(idx))
                if not views:
                    replies = [bytes(v) if type(v) is memoryview else v for v in replies]
            else:
                replies = read_replies(conn, len(idx))
                receiver.even = False
            # MOVED/ASK/TRYAGAIN come back as error objects: followed by the caller
            for j, v in zip(idx, replies, strict=True):
                if isinstance(v, BaseException):
                    redirected.append(j)
                else:
                    out[j] = v
            order += idx
        except STORE_ERRORS as exc:
            held.drop(client, conn)
            error = error or exc
        except BaseException:
            held.drop(client, conn)  # out of step: never used so
            raise
    receiver.pool.give(receiver.used)
    # A failed read, an error reply (a redirection) or a nil leaves the receiver uneven: no run then.
    return error, receiver.run(order) if views else None


_GET_HEADS = [b"*2\r\n$3\r\nGET\r\n$%d\r\n" % n for n in range(512)]  # by key length


def pack_gets(keys: Sequence[bytes]) -> bytes:
    """RESP for one ``GET`` per key, packed in one pass of C loops (redis-py packs each command separately)."""
    try:
        heads = list(map(_GET_HEADS.__getitem__, map(len, keys)))
    except IndexError:  # a key of 512 bytes or more
        heads = [b"*2\r\n$3\r\nGET\r\n$%d\r\n" % len(k) for k in keys]
    return b"".join(map(b"".join, zip(heads, keys, repeat(b"\r\n"))))


class _Held:
    """One thread's held connections: ``conns``, id(client) -> (client, connection). Given back when the thread
    ends (its ``threading.local`` storage goes, and this with it)."""

    __slots__ = ("__weakref__", "conns")

    def __init__(self) -> None:
        self.conns: dict[int, tuple[Any, Any]] = {}

    def give_back(self) -> None:
        conns, self.conns = list(self.conns.values()), {}
        for client, conn in conns:
            conn.disconnect()
            client.connection_pool.release(conn)

    def __del__(self) -> None:
        try:
            self.give_back()
        except Exception:  # interpreter shutdown: nothing left to tidy
            pass


class HeldConnections:
    """One connection per node and thread, kept out of the node's connection pool from one fetch to the next.

    A fetch then skips the pool's checkout and return (a lock, a liveness poll of the socket, bookkeeping,
    metrics): about a tenth of the cost of reading a batch. Every fetch reads all the replies it asked for or
    drops the connection (:meth:`drop`), so a held connection never carries a stray reply into the next fetch;
    the reader also refuses bytes beyond the replies it expects. A forked child (a DataLoader worker) forgets the
    connections of its parent without touching them and holds its own.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()
        self._threads: weakref.WeakSet[_Held] = weakref.WeakSet()

    def _mine(self) -> dict[int, tuple[Any, Any]]:
        if self._pid != os.getpid():  # a forked child: the parent's sockets are the parent's
            for inherited in list(self._threads):
                inherited.conns = {}  # forgotten, not closed
            self._pid, self._local, self._threads = os.getpid(), threading.local(), weakref.WeakSet()
        held: _Held | None = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = _Held()
            self._threads.add(held)
        return held.conns

    def send(self, client: redis.Redis, packed: bytes, retry: Retry) -> Any:
        """Send pre-packed RESP on this thread's connection to ``client``, reconnecting with backoff."""
        mine = self._mine()
        entry = mine.get(id(client))
        if entry is None or entry[0] is not client:
            entry = mine[id(client)] = (client, client.connection_pool.get_connection())
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

    def close(self) -> None:
        """Give back every thread's connections."""
        if self._pid == os.getpid():
            for held in list(self._threads):
                held.give_back()
        self._local, self._threads = threading.local(), weakref.WeakSet()


class NodesBackend(Backend):
    """Independent servers, keys placed by rendezvous hashing."""

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions) -> None:
        self.hosts = hosts
        self.options = options
        self.retry = options.retry()
        self.clients = [redis.Redis(host=h, port=p, retry=options.retry(), retry_on_error=list(RETRYABLE_ERRORS),
                                    **options.connection_kwargs()) for h, p in hosts]
        self.ring = RendezvousHash([f"{h}:{p}" for h, p in hosts])
        self.pool = BufferPool()
        self.held = HeldConnections()

    def _group(self, keys: Sequence[str | bytes]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        node_of = self.ring.node_of
        for j, k in enumerate(keys):
            groups.setdefault(node_of(k), []).append(j)
        return groups

    def fetch(self, keys: Sequence[bytes], views: bool = False) -> tuple[list[Any], BaseException | None]:
        out: list[Any] = [None] * len(keys)
        conns = []
        error: BaseException | None = None
        for node, idx in self._group(keys).items():
            try:
                conn = self.held.send(self.clients[node], pack_gets([keys[j] for j in idx]), self.retry)
                conns.append((self.clients[node], conn, idx))
            except STORE_ERRORS as exc:
                error = error or exc
        # An error reply here (WRONGTYPE: a key of another type) leaves the value None, a miss, as MGET did.
        receiver = self._receiver(len(keys))
        read_error, run = _read_pipelined(conns, out, [], views, receiver, self.held)
        self._learn(out)
        return Replies(out, run), error or read_error

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
        self.held.close()
        for c in self.clients:
            c.close()


class ClusterBackend(Backend):
    """A real Redis Cluster through redis-py's cluster client."""

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions) -> None:
        self.options = options
        self.retry = options.retry()
        self.rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts], retry=options.retry(),
                               require_full_coverage=False, **options.connection_kwargs())
        self._slots: tuple[list[Any], list[int]] | None = None
        self.pool = BufferPool()
        self.held = HeldConnections()

    def _refresh(self) -> None:
        # After a connection error the slot map may be stale (failover): reload it from a live node.
        self._slots = None
        try:
            self.rc.nodes_manager.initialize()
        except STORE_ERRORS as exc:
            log.debug("cluster slot map refresh failed: %s", exc)
        self.held.forget([n.redis_connection for n in self.rc.nodes_manager.nodes_cache.values()])

    def _slot_table(self) -> tuple[list[Any], list[int]]:
        """The primaries, and the index among them of the one serving each slot (-1: uncovered); cached until
        the slot map is refreshed."""
        if self._slots is None:
            cache = self.rc.nodes_manager.slots_cache
            primaries: list[Any] = []
            names: dict[str, int] = {}
            table = []
            for s in range(REDIS_CLUSTER_HASH_SLOTS):
                node = cache[s][0] if cache.get(s) else None
                if node is None:
                    table.append(-1)
                    continue
                i = names.get(node.name)
                if i is None:
                    i = names[node.name] = len(primaries)
                    primaries.append(node)
                table.append(i)
            self._slots = (primaries, table * (65536 // REDIS_CLUSTER_HASH_SLOTS))  # indexed by the whole CRC16
        return self._slots

    def fetch(self, keys: Sequence[bytes], views: bool = False) -> tuple[list[Any], BaseException | None]:
        out: list[Any] = [None] * len(keys)
        error: BaseException | None = None
        primaries, table = self._slot_table()
        # Cache keys carry no hash tag ({ is percent-encoded in names): the slot is the CRC16 of the key.
        if b"{" in b"".join(keys):
            where = [table[key_slot(k)] for k in keys]
        else:
            where = list(map(table.__getitem__, map(crc_hqx, keys, repeat(0))))  # table covers 2**16 CRCs
        if -1 in where:  # a slot without a serving node
            self._refresh()
            return out, redis.exceptions.ClusterDownError(f"no cluster node serves the slot of "
                                                          f"{keys[where.index(-1)]!r}")
        order = sorted(range(len(keys)), key=where.__getitem__)  # the keys by node, in their order
        groups = []
        at = 0
        for i in sorted(set(where)):
            idx = order[at:at + where.count(i)]
            at += len(idx)
            groups.append((primaries[i], idx, list(map(keys.__getitem__, idx))))
        conns = []
        if any(node.redis_connection is None for node, _, _ in groups):  # checked before anything is sent
            self._refresh()
            return out, redis.ConnectionError("no connection to a cluster node")
        for node, idx, raw_keys in groups:
            client = node.redis_connection
            try:
                conns.append((client, self.held.send(client, pack_gets(raw_keys), self.retry), idx))
            except STORE_ERRORS as exc:
                error = error or exc
        redirected: list[int] = []
        receiver = self._receiver(len(keys))
        read_error, run = _read_pipelined(conns, out, redirected, views, receiver, self.held)
        error = error or read_error
        if redirected:  # let RedisCluster follow MOVED/ASK and update its slot map
            self._slots = None
            try:
                for j, v in zip(redirected, self.rc.mget_nonatomic([keys[j] for j in redirected]), strict=True):
                    out[j] = v
            except STORE_ERRORS as exc:
                error = error or exc
        if error is not None:
            self._refresh()
        self._learn(out)
        return Replies(out, run), error

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
        self.held.close()
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
