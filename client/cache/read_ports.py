"""A store's reads from the nodes' read ports (docs/deployment.md, "Open reads").

A node's read port is its client port plus the deployment's offset (:attr:`~.options.RedisOptions.read_port_offset`):
plaintext, where the password-less reader (:mod:`bagua_lightning.core.read_plane`) may only read. A backend sends
the ``GET``\\s of sealed entries there (:meth:`~.backends.Backend.fetch` with ``open_reads``), never a secret.
A read port that refuses, does not answer or breaks off mid-read is the read port's failure, not its node's:
it is left alone for :data:`RETRY_S` (one warning while it keeps failing), and its keys are read again through
the node's client port.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ...core.redis_server import reader_client
from .options import SOCKET_READ_SIZE, RedisOptions

log = logging.getLogger(__name__)

RETRY_S = 30.0  # a read port that failed is tried again after this long
NO_RETRY = Retry(NoBackoff(), 0)  # a read port that fails is left for the client port at once
REFUSED = "NOPERM"  # an error reply for a key the reader may not read: read it through the client port


class ReadPorts:
    """The read-port clients of a store's nodes, by the node's (host, client port)."""

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
