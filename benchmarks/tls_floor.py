"""The least a Python TLS client must spend to decrypt a batch: the limit of t/c (see cache_throughput.py).

:class:`DecryptFloor` pairs two ``SSLObject``s in memory (TLS 1.3, an ECDSA P-256 certificate of a fresh CA, as
``bagua-lightning up`` makes them; the suite OpenSSL picks by default, as Redis and redis-py do) and times the
client decrypting exactly the bytes of one batch of replies: ciphertext written into the incoming BIO a piece
at a time (:data:`PIECE`, what one ``recv`` of the stream brings) and read out, record by record, into a
preallocated buffer. No network, no parsing, no system call: what
``SSLObject.read`` costs, copies included (BIO, record buffer, caller's buffer). A batch over TLS cannot take
less than the same batch in plaintext plus this, so ``median(c + floor) / median(t)`` is how close (t) is to
the limit (1: at it).
"""

from __future__ import annotations

import os
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any

from bagua_lightning.services.redis_tls import make_node_certificates

PIECE = 128 * 1024  # ciphertext handed to the BIO at a time: about what one recv of the stream returns


class DecryptFloor:
    """An in-memory TLS 1.3 client and server; :meth:`time` times the client decrypting ``nbytes``."""

    def __init__(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "tls"
            make_node_certificates(folder, [1], ["127.0.0.1"])
            server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            server_ctx.load_cert_chain(folder / "node-1.crt", folder / "node-1.key")
            client_ctx = ssl.create_default_context(cafile=str(folder / "ca.crt"))
        self._cin, self._cout, self._sin, self._sout = (ssl.MemoryBIO() for _ in range(4))
        self.client = client_ctx.wrap_bio(self._cin, self._cout, server_hostname="127.0.0.1")
        self.server = server_ctx.wrap_bio(self._sin, self._sout, server_side=True)
        for _ in range(8):
            for side in (self.client, self.server):
                try:
                    side.do_handshake()
                except ssl.SSLWantReadError:
                    pass
            self._sin.write(self._cout.read())
            self._cin.write(self._sout.read())
        assert self.client.version() == "TLSv1.3", self.client.version()
        self._payload = os.urandom(1 << 20)
        self._out = bytearray(1 << 21)

    @property
    def cipher(self) -> str:
        got = self.client.cipher()
        return got[0] if got else "?"

    def time(self, nbytes: int) -> tuple[float, float]:
        """Seconds (clock, thread CPU) the client spends decrypting ``nbytes`` of plaintext sent as the server
        sends it (records of up to 16 KB); the encryption is done first, untimed."""
        view = memoryview(self._payload)
        left = nbytes
        while left:
            self.server.write(view[:min(left, len(view))])
            left -= min(left, len(view))
        wire = memoryview(self._sout.read())
        out = memoryview(self._out)
        read: Any = self.client.read  # with a buffer: the bytes written
        incoming = self._cin
        pos = 0
        start, cpu = time.perf_counter(), time.thread_time()
        for at in range(0, len(wire), PIECE):  # as the stream receives it: a piece, then every record in it
            incoming.write(wire[at:at + PIECE])
            while True:
                try:
                    pos += read(len(out) - pos, out[pos:])
                except ssl.SSLWantReadError:
                    break
                if pos > len(out) - 16384:  # batches larger than the buffer: start over (the bytes are not kept)
                    pos = 0
        return time.perf_counter() - start, time.thread_time() - cpu
