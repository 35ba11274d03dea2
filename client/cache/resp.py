"""Pipelined ``GET``s on held connections, their RESP replies received straight into pooled buffers (the fast
read path of a :class:`~.store.RedisStore`).

Commands are packed in one pass (:func:`pack_gets`) and sent on a connection per node and thread held from one
fetch to the next (:class:`HeldConnections`). A batch's values are read from the socket into large reusable
buffers and handed out as views of them, so a value is copied once from the kernel and decoded where it lies
(:class:`Receiver`, :class:`BufferPool`, :class:`Replies`).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import redis
from redis.retry import Retry

from .tls_stream import DecryptWorkers, take_connection
from .values import REPLY_ALIGN

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
MAX_POOLED = 8  # receive buffers kept per store (its nodes) for reuse


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
    nodes are decrypted at once, one thread per node (:class:`~.tls_stream.DecryptWorker`; started once, kept with the
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

    def prefetch(self, conns: list[tuple[Any, Any, list[int], str]]) -> None:
        """Start decrypting the replies of every TLS connection of ``conns`` (sent, not yet read), each on its
        node's worker thread (:class:`~.tls_stream.DecryptWorker`); plaintext connections are left as they are."""
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
