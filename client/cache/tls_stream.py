"""TLS for the cache's read connections, decrypted from memory: one system call per large chunk of the stream.

CPython's ``SSLSocket.recv_into`` returns at most one TLS record (<= 16 KB of plaintext) per call, and OpenSSL,
reading the socket itself without read-ahead, spends two ``recv`` system calls on each record (its 5-byte
header, then its body): a batch of 64 CIFAR samples from three nodes took ~110 calls into ``_ssl`` and ~220
system calls where plaintext took 5 reads. :class:`TLSStream` reads the TCP stream in large chunks (one
``recv_into`` for whatever has arrived, up to :data:`CHUNK`) into an ``ssl.MemoryBIO`` and decrypts with
``SSLObject.read`` straight into the caller's buffer, every complete record that has arrived in one call.

Nothing about trust changes: the handshake, the certificate chain and host name checks are OpenSSL's own, run
by ``SSLContext.wrap_bio`` exactly as ``wrap_socket`` runs them, and a server that fails them receives the
ClientHello and nothing else. The context is the pinned one
(:meth:`~bagua_lightning.core.tls_trust.ClientTLS.context`: the deployment's CA is the only trusted root).

:func:`take_connection` gives the held read connections of a pinned TLS pool a :class:`MemoryTLSConnection`
(the same settings as the pool's :class:`~bagua_lightning.core.pinned_redis.PinnedSSLConnection`s); other
connections of the pool (administration, writes through redis-py pipelines) are those.

**Decrypting on a thread per node** (opt-in, ``decrypt_threads``): a batch's replies from several nodes decrypted
at once, one persistent thread per node connection. Decryption is most of what TLS costs a cached read (AES-GCM from memory, about 2 GB/s a core), and one thread
decrypting the replies of every node of a batch in turn does it on one core. ``SSLObject.read`` and
``socket.recv_into`` release the GIL, so a thread per node connection decrypts that node's replies while the
others decrypt theirs, on as many cores as there are nodes in the batch.

A :class:`DecryptWorker` belongs to one node of one reading thread's held connections (created on first use,
kept across batches and reconnects, stopped when the connections are given back): no thread is started and no
buffer allocated per batch. For a batch, :meth:`TLSStream.prefetch` hands it
the stream and the number of replies expected; the worker decrypts into its own buffer (reused, grown when a
batch needs more) until that many whole replies are in it (it reads only their headers, to skip over the
values), an error, or the end of the stream. The reader then takes the decrypted bytes through the stream's
``recv_into`` as from a socket (one copy, in place of the copy from the kernel a plaintext read makes), or the
worker's error, at the point where it would have met it. Two locks hand a job over and back: the worker and
the reader never touch the stream at the same time.
"""

from __future__ import annotations

import _thread
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ...core.pinned_redis import PinnedSSLConnection

CHUNK = 256 * 1024  # bytes of ciphertext per system call at most (a batch from one node is a few hundred KB)


class TLSStream:
    """The socket-like object a :class:`MemoryTLSConnection` reads and writes: TLS over a connected TCP socket,
    through an ``SSLObject`` and two memory BIOs (the handshake runs in the constructor).

    ``recv_into`` fills the caller's buffer with every record already received (reading the socket only when
    none is, and then once, as much as has arrived); ``sendall`` encrypts and sends. Timeouts are the TCP
    socket's (``settimeout``), as with ``SSLSocket``; EOF, clean or not, reads as 0 bytes
    (``suppress_ragged_eofs``, as redis-py's ``SSLSocket`` has it).
    """

    __slots__ = ("_in", "_job", "_obj", "_out", "_raw", "_raw_view", "_read", "_sock")

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_hostname: str | None) -> None:
        self._sock = sock
        self._job: DecryptWorker | None = None  # decrypting the next replies on its own thread (prefetch)
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_side=False, server_hostname=server_hostname)
        # The C object's read: ssl.SSLObject.read is a Python wrapper around it, a call per record.
        obj: Any = getattr(self._obj, "_sslobj", self._obj)
        self._read: Callable[[int, Any], int] = obj.read  # with a buffer: the bytes written
        self._raw = bytearray(CHUNK)  # ciphertext lands here, then goes to the BIO
        self._raw_view = memoryview(self._raw)
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
        self._flush()  # the client's Finished (and certificate): TLS 1.3 completes the client's side first

    # -- reading -----------------------------------------------------------------------------------------------
    def _fill(self) -> None:
        """Receive once (blocking, with the socket's timeout) what has arrived, into the incoming BIO."""
        if self._out.pending:  # a post-handshake reply (key update) goes out before waiting for more
            self._flush()
        n = self._sock.recv_into(self._raw)
        if n:
            self._in.write(self._raw_view[:n])
        else:
            self._in.write_eof()  # OpenSSL then says whether the close was clean (close_notify) or not

    def prefetch(self, worker: DecryptWorker, replies: int) -> None:
        """Have ``worker`` decrypt the next ``replies`` replies on its thread, now; ``recv_into`` then hands
        out what it decrypted (:class:`DecryptWorker`). Nothing else may use the stream until they are read."""
        self._settle()
        self._job = worker
        worker.submit(self, replies)

    def _settle(self) -> None:
        """Wait for a prefetch still running (the stream is then this thread's again)."""
        job = self._job
        if job is not None and not job.joined:
            job.join()

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Decrypt into ``buffer`` (up to ``nbytes``, 0: all of it) every record received so far; if none is,
        receive once first. Returns the bytes written, 0 at end of stream. After :meth:`prefetch`: what the
        worker decrypted, then its error or end of stream, if it met one."""
        if flags:
            raise ValueError(f"flags={flags} is not supported on a TLS stream (neither is it on an SSLSocket)")
        job = self._job
        if job is None:
            return self.decrypt_into(buffer, nbytes)
        job.join()
        ready = job.filled - job.pos
        if ready:
            view = buffer if type(buffer) is memoryview else memoryview(buffer)
            k = min(ready, nbytes if 0 < nbytes <= len(view) else len(view))
            view[:k] = job.view[job.pos:job.pos + k]
            job.pos += k
            if k == ready and job.error is None and not job.eof:
                self._job = None
            return k
        self._job = None
        if job.error is not None:
            raise job.error
        return 0 if job.eof else self.decrypt_into(buffer, nbytes)

    def decrypt_into(self, buffer: Any, nbytes: int = 0) -> int:
        """:meth:`recv_into` straight from the stream (the worker's, or the reader's without a prefetch)."""
        view = buffer if type(buffer) is memoryview else memoryview(buffer)
        want = nbytes if 0 < nbytes <= len(view) else len(view)
        read = self._read
        got = 0
        while got < want:
            try:
                n = read(want - got, view[got:] if got else view)
                if not n:
                    break  # the peer's close_notify: the end of the stream
                got += n
            except ssl.SSLWantReadError:
                if got:
                    break  # what has arrived; the caller asks again if it needs more
                self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
        return got

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        buf = bytearray(bufsize)
        n = self.recv_into(buf, bufsize, flags)
        del buf[n:]
        return bytes(buf)

    def pending(self) -> int:
        """Bytes already taken from the socket and not yet read (decrypted or not): what ``poll`` cannot see."""
        self._settle()
        job = self._job
        staged = job.filled - job.pos if job is not None else 0
        return staged + self._obj.pending() + self._in.pending

    # -- writing -----------------------------------------------------------------------------------------------
    def _flush(self) -> None:
        out = self._out
        while out.pending:
            self._sock.sendall(out.read())

    def sendall(self, data: Any) -> None:
        self._settle()
        self._obj.write(data)  # a memory BIO takes it all: one record per 16 KB
        self._flush()

    def send(self, data: Any) -> int:
        self.sendall(data)
        return len(memoryview(data).cast("B"))

    # -- the socket's own --------------------------------------------------------------------------------------
    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def fileno(self) -> int:
        return self._sock.fileno()

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def getsockopt(self, *args: Any) -> Any:
        return self._sock.getsockopt(*args)

    def getsockname(self) -> Any:
        return self._sock.getsockname()

    def getpeername(self) -> Any:
        return self._sock.getpeername()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)  # wakes a worker waiting on the socket: it ends its job with an error

    def close(self) -> None:
        self._settle()
        self._job = None
        self._sock.close()

    # -- what was negotiated -----------------------------------------------------------------------------------
    def getpeercert(self, binary_form: bool = False) -> Any:
        return self._obj.getpeercert(binary_form)

    def version(self) -> str | None:
        return self._obj.version()

    def cipher(self) -> tuple[str, str, int] | None:
        return self._obj.cipher()


class MemoryTLSConnection(PinnedSSLConnection):
    """A pinned TLS connection (same arguments, same errors, the deployment's CA only) whose socket is a
    :class:`TLSStream`."""

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        return TLSStream(sock, self.tls.context(), self.host)


def take_connection(pool: Any) -> Any:
    """A connection to hold for reads: a :class:`MemoryTLSConnection` of the pool's settings where the pool
    makes pinned TLS connections (outside the pool: it never hands it to anyone else; giving it back to the
    pool is a no-op), else one from the pool."""
    if issubclass(pool.connection_class, PinnedSSLConnection) and getattr(pool, "cache", None) is None:
        return MemoryTLSConnection(**pool.connection_kwargs)
    return pool.get_connection()

class DecryptingStream(Protocol):
    """What a worker needs of a connection's TLS stream (:class:`~.tls_stream.TLSStream`): decrypt what has
    arrived into ``view`` and say how many bytes (0: the stream ended)."""

    def decrypt_into(self, view: memoryview) -> int: ...


FIRST_BUFFER = 1 << 20  # bytes; grows (rarely: a buffer stays with its worker) to what a batch of a node needs
BULK, NULL, ERROR = 36, 95, 45  # $, _, -
NOT_GET = -2


class DecryptWorker:
    """A thread that decrypts the replies of one connection for one batch at a time (see the module)."""

    __slots__ = ("_done", "_go", "_n", "_stop", "_stream", "buf", "eof", "error", "filled", "joined", "pos", "thread",
                 "view")

    def __init__(self) -> None:
        self._go, self._done = _thread.allocate_lock(), _thread.allocate_lock()
        self._go.acquire()
        self._done.acquire()
        self._stream: DecryptingStream | None = None
        self._n = 0
        self._stop = False
        self.buf = bytearray(FIRST_BUFFER)
        self.view = memoryview(self.buf)
        self.filled = self.pos = 0  # decrypted bytes in ``buf``, and how many of them the reader has taken
        self.error: BaseException | None = None
        self.eof = False
        self.joined = True  # the last job's end was waited for
        self.thread = threading.Thread(target=self._run, name="bagua-tls-decrypt", daemon=True)
        self.thread.start()

    def submit(self, stream: DecryptingStream, replies: int) -> None:
        """Decrypt the next ``replies`` replies of ``stream``."""
        self.join()  # the previous job's end (its stream was read or closed, which waits for it already)
        self._stream, self._n = stream, replies
        self.filled = self.pos = 0
        self.error, self.eof, self.joined = None, False, False
        self._go.release()

    def join(self) -> None:
        """Wait until the job is done (once per job)."""
        if not self.joined:
            self._done.acquire()
            self.joined = True

    def stop(self) -> None:
        """End the thread once its job (if any) is done; the worker is not used again."""
        self.join()
        self._stop = True
        self._go.release()

    # -- the worker's thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._go.acquire()
            if self._stop:
                return
            try:
                self._decrypt()
            except BaseException as exc:  # handed to the reader, who meets it where it would have
                self.error = exc
            finally:
                self._stream = None
                self._done.release()

    def _decrypt(self) -> None:
        stream = self._stream
        assert stream is not None
        left, scan = self._n, 0  # replies not yet whole in ``buf``; where the next one starts
        buf = self.buf
        while left:
            if self.filled == len(buf):  # a batch larger than any before: a larger buffer, kept
                grown = bytearray(2 * len(buf))
                grown[:self.filled] = self.view[:self.filled]
                self.buf, self.view, buf = grown, memoryview(grown), grown
            got = stream.decrypt_into(self.view[self.filled:])
            if not got:
                self.eof = True
                return
            self.filled += got
            while left:  # skip over every reply now whole
                end = _reply_end(buf, scan, self.filled)
                if end == NOT_GET:
                    return  # the reader's parser refuses it, where it would have met it
                if end < 0:
                    break
                scan, left = end, left - 1


def _reply_end(buf: bytearray, pos: int, filled: int) -> int:
    """Where the reply at ``pos`` ends if it lies whole before ``filled``, else -1; :data:`NOT_GET` for
    anything but a GET's reply."""
    e = buf.find(b"\r\n", pos, filled)
    if e < 0:
        return -1
    if buf[pos] != BULK:
        return e + 2 if buf[pos] in (NULL, ERROR) else NOT_GET
    try:
        size = int(buf[pos + 1:e])
    except ValueError:
        return NOT_GET
    end = e + 2 if size < 0 else e + 4 + size
    return end if end <= filled else -1


class DecryptWorkers:
    """The workers of one reading thread's held connections, one per node (keyed like them)."""

    __slots__ = ("_workers",)

    def __init__(self) -> None:
        self._workers: dict[int, DecryptWorker] = {}

    def start(self, jobs: list[tuple[int, Any, int]]) -> None:
        """For each ``(node key, connection, replies)`` whose socket is a TLS stream, decrypt its replies on
        the node's worker."""
        for key, conn, replies in jobs:
            sock = conn._sock
            if hasattr(sock, "prefetch"):  # a TLS stream (tls_stream.TLSStream), not a plain socket
                worker = self._workers.get(key)
                if worker is None:
                    worker = self._workers[key] = DecryptWorker()
                sock.prefetch(worker, replies)

    def forget(self, key: int) -> None:
        worker = self._workers.pop(key, None)
        if worker is not None:
            worker.stop()

    def stop(self) -> None:
        workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.stop()
