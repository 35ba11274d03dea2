"""The nodes of a :class:`~.store.RedisStore` on a Redis Cluster: pipelined reads and writes per master, isolated
per node.

redis-py's ``RedisCluster`` keeps the slot map (and connects to the nodes); reads and writes go to each master
directly, grouped by the master that serves their slot, so that one failing master costs only its own keys:

* a master that fails (connection error, timeout, ``CLUSTERDOWN``) is backed off (:class:`~.faults.NodeBreakers`):
  its keys are misses, without a network call, until its next try, and the other masters keep serving;
* the slot map is reloaded after a failure, on a redirection (``MOVED``/``ASK``) and, while a master is down,
  regularly, so that a promoted replica serves its slots as soon as the cluster says so; reloads are
  rate-limited and back off while no node answers (a MOVED storm costs one reload per interval);
* a key whose slot no master serves is a miss.

Reads of sealed entries (``fetch(keys, sealed=True)``, the loader's with a cache key) go to each master's read
port (:class:`~.nodes.ReadPorts`); the slot map still comes from the client port, and a key the reader may not read, or
one whose read port failed, is read again through the client port.
"""

from __future__ import annotations

import logging
import time
from binascii import crc_hqx
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import redis
from redis.cluster import REDIS_CLUSTER_HASH_SLOTS, RedisCluster
from redis.crc import key_slot

from ...core.pinned_redis import close_cluster, cluster_client
from .faults import CONNECT, NodeBreakers
from .nodes import (
    NO_RETRY,
    REFUSED,
    STORE_ERRORS,
    Nodes,
    Sent,
    Value,
    backing_off,
    node_down_reply,
    read_pipelined,
)
from .options import RedisOptions
from .resp import Replies, pack_gets

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 0.5  # the slot map is reloaded at most this often (failover, MOVED)
REDIRECTS = ("MOVED", "ASK")


class ClusterNodes(Nodes):
    """A real Redis Cluster: slot map from redis-py's cluster client, reads and writes per master."""

    def __init__(self, hosts: list[tuple[str, int]], options: RedisOptions,
                 breakers: NodeBreakers | None = None) -> None:
        super().__init__(hosts, options, breakers)
        self.rc: RedisCluster = cluster_client(hosts, retry=options.retry(), require_full_coverage=False,
                                               **options.connection_kwargs())
        self._slots: tuple[list[Any], list[int]] | None = None
        self._next_refresh = 0.0

    def _refresh(self, failed: str | None = None) -> bool:
        """Reload the slot map from a live node (a failover may have moved slots); rate-limited. Whether it ran."""
        now = time.monotonic()
        if now < self._next_refresh or not self.breakers.available(CONNECT):
            return False
        self._next_refresh = now + REFRESH_INTERVAL_S
        self._slots = None
        try:
            # A node known to be down is asked last: on a real network it would cost a connect timeout.
            self.rc.nodes_manager.initialize(disconnect_startup_nodes_pools=False, last_failed_node_name=failed)
        except STORE_ERRORS as exc:  # includes RedisClusterException ("Redis Cluster cannot be connected")
            log.debug("cluster slot map refresh failed: %s", exc)
            self.breakers.failure(CONNECT, exc)
            return True
        self.breakers.success(CONNECT)
        nodes = self.rc.nodes_manager.nodes_cache.values()
        self.held.forget([n.redis_connection for n in nodes] + self.reads.clients())
        self.breakers.keep({n.name for n in self._slot_table()[0]})
        return True

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

    def _groups(self, keys: Sequence[bytes]) -> tuple[list[tuple[Any, list[int]]], list[int]]:
        """The keys by the master serving them, and the keys of uncovered slots. Masters backing off are left
        out (their keys are misses, without a network call) and named in ``self.skipped``."""
        primaries, table = self._slot_table()
        # Cache keys carry no hash tag ({ is percent-encoded in names): the slot is the CRC16 of the key.
        if b"{" in b"".join(keys):
            where = [table[key_slot(k)] for k in keys]
        else:
            where = list(map(table.__getitem__, map(crc_hqx, keys, repeat(0))))  # table covers 2**16 CRCs
        order = sorted(range(len(keys)), key=where.__getitem__)  # the keys by node, in their order
        groups = []
        uncovered: list[int] = []
        down = self.breakers.down
        self.skipped = []
        at = 0
        for i in sorted(set(where)):
            idx = order[at:at + where.count(i)]
            at += len(idx)
            if i < 0:
                uncovered = idx
            elif not down or self.breakers.available(primaries[i].name):
                groups.append((primaries[i], idx))
            else:
                self.skipped.append(primaries[i].name)
        return groups, uncovered

    def _prepare(self, keys: Sequence[bytes]) -> tuple[list[tuple[Any, list[int]]], list[int]]:
        if self.breakers.down:  # a master is down: has a replica taken over? (rate-limited)
            self._refresh(next(iter(self.breakers.down)))
        groups, uncovered = self._groups(keys)
        if uncovered:
            self._refresh()
        return groups, uncovered

    def _send(self, node: Any, packed: bytes, sealed: bool) -> Sent:
        """Send the GETs ``packed`` to master ``node``: to its read port with ``sealed`` where it has one that
        answers, else to its client port (always while the master is down: only its client port proves it is back,
        see :mod:`.nodes`)."""
        reader = self.reads.client(node.host, node.port) if sealed and node.name not in self.breakers.down else None
        if reader is not None:
            try:
                return reader, self.held.send(reader, packed, NO_RETRY), [], node.name
            except STORE_ERRORS as exc:
                self.reads.failed(node.host, node.port, node.name, exc)
        client = node.redis_connection
        if client is None:
            raise redis.ConnectionError(f"no connection to cluster node {node.name}")
        return client, self.held.send(client, packed, self.retry), [], node.name

    def fetch(self, keys: Sequence[bytes], sealed: bool = False, *, again: bool = True
              ) -> tuple[list[Any], BaseException | None]:
        out: list[Any] = [None] * len(keys)
        groups, uncovered = self._prepare(keys)
        failed: list[tuple[str, BaseException]] = []
        conns: list[Sent] = []
        by_reader: dict[str, tuple[str, int, list[int]]] = {}  # masters read from their read port
        for node, idx in groups:
            try:
                client, conn, _, name = self._send(node, pack_gets([keys[j] for j in idx]), sealed)
                conns.append((client, conn, idx, name))
                if client is not node.redis_connection:
                    by_reader[name] = (node.host, node.port, idx)
            except STORE_ERRORS as exc:
                failed.append((node.name, exc))
        errored: list[tuple[int, BaseException]] = []
        run = read_pipelined(conns, out, errored, self._receiver(len(keys)), self.held, failed)
        redirected, refused = self._errored(errored, conns, failed)
        if by_reader and failed:  # a read port that broke off is the read port's failure, not the master's
            refused += self.reads.reclaim(failed, by_reader)
        error = self._account([c[3] for c in conns], failed, uncovered, keys)
        again_keys = refused if not (redirected and self._refresh() and again) else refused + redirected
        if again_keys:  # read once more (through the new slot map, or the client port), else misses
            values, err = self.fetch([keys[j] for j in again_keys], again=False)
            for j, v in zip(again_keys, values, strict=True):
                out[j] = v
            error = error or err
            run = None
        self._learn(out)
        return Replies(out, run), error or backing_off(self.skipped)

    def _errored(self, errored: list[tuple[int, BaseException]], conns: list[Sent],
                 failed: list[tuple[str, BaseException]]) -> tuple[list[int], list[int]]:
        """Sort error replies: redirections and keys the reader may not read (returned, to be read again), nodes
        that cannot serve (to ``failed``), anything else a miss."""
        if not errored:
            return [], []
        node_of = {j: name for _, _, idx, name in conns for j in idx}
        redirected, refused = [], []
        for j, reply in errored:
            text = str(reply)
            if text.startswith(REDIRECTS):
                redirected.append(j)
            elif text.startswith(REFUSED):
                refused.append(j)
            elif node_down_reply(reply) and all(name != node_of[j] for name, _ in failed):
                failed.append((node_of[j], reply))
        return redirected, refused

    def _account(self, tried: list[str], failed: list[tuple[str, BaseException]], uncovered: list[int],
                 keys: Sequence[Any]) -> BaseException | None:
        """Tell the breakers which masters failed and which answered; reload the map after a failure; the
        first error."""
        error = self.breakers.account(tried, failed)
        if failed:
            self._refresh(failed[0][0])
            return error
        if uncovered:
            return redis.exceptions.SlotNotCoveredError(f"no cluster node serves the slot of {keys[uncovered[0]]!r}")
        return None

    def put(self, items: Sequence[tuple[str, Value]], overwrite: bool) -> tuple[list[bool], BaseException | None]:
        done = [False] * len(items)
        keys = [k.encode() for k, _ in items]
        groups, uncovered = self._prepare(keys)
        tried: list[str] = []
        failed: list[tuple[str, BaseException]] = []
        redirected = False
        for node, idx in groups:
            tried.append(node.name)
            try:
                client = node.redis_connection
                if client is None:
                    raise redis.ConnectionError(f"no connection to cluster node {node.name}")
                pipe = client.pipeline(transaction=False)
                for j in idx:
                    pipe.set(keys[j], items[j][1], nx=not overwrite)
                results = pipe.execute(raise_on_error=False)
            except STORE_ERRORS as exc:
                failed.append((node.name, exc))
                continue
            for j, ok in zip(idx, results, strict=True):
                if isinstance(ok, BaseException):  # not written; a redirection means the map is stale
                    redirected = redirected or str(ok).startswith(REDIRECTS)
                    if node_down_reply(ok) and tried[-1] not in {n for n, _ in failed}:
                        failed.append((node.name, ok))
                else:
                    done[j] = ok is True  # None: existed (NX)
        if redirected:
            self._refresh()
        return done, self._account(tried, failed, uncovered, keys) or backing_off(self.skipped)

    def writable(self) -> bool:
        return any(self.breakers.available(n.name) for n in self._slot_table()[0])

    def primaries(self) -> list[redis.Redis]:
        return [n.redis_connection for n in self.rc.get_primaries() if n.redis_connection is not None]

    def client_for_key(self, key: str) -> RedisCluster:
        primaries, table = self._slot_table()
        i = table[key_slot(key.encode())]
        if i >= 0 and not self.breakers.available(primaries[i].name):
            raise redis.ConnectionError(f"cluster node {primaries[i].name} is unavailable (backing off)")
        return self.rc

    def close(self) -> None:
        self.held.close()
        self.reads.close()
        close_cluster(self.rc)
