"""Decrypting a batch's replies from several nodes at once: one persistent thread per node connection.

Decryption is most of what TLS costs a cached read (AES-GCM from memory, about 2 GB/s a core), and one thread
decrypting the replies of every node of a batch in turn does it on one core. ``SSLObject.read`` and
``socket.recv_into`` release the GIL, so a thread per node connection decrypts that node's replies while the
others decrypt theirs, on as many cores as there are nodes in the batch.

A :class:`DecryptWorker` belongs to one node of one reading thread's held connections (created on first use,
kept across batches and reconnects, stopped when the connections are given back): no thread is started and no
buffer allocated per batch. For a batch, :meth:`TLSStream.prefetch <.tls_stream.TLSStream.prefetch>` hands it
the stream and the number of replies expected; the worker decrypts into its own buffer (reused, grown when a
batch needs more) until that many whole replies are in it (it reads only their headers, to skip over the
values), an error, or the end of the stream. The reader then takes the decrypted bytes through the stream's
``recv_into`` as from a socket (one copy, in place of the copy from the kernel a plaintext read makes), or the
worker's error, at the point where it would have met it. Two locks hand a job over and back: the worker and
the reader never touch the stream at the same time.
"""

from __future__ import annotations

import _thread
import threading
from typing import Any, Protocol


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
