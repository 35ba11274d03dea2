"""Rendezvous (highest random weight) hashing of keys onto independent Redis servers.

Each key goes to the node with the highest ``mix(hash(key) ^ seed(node))``. Nodes are identified by
``host:port``, so the order of ``hosts`` does not matter, and adding an m+1-th node moves only the ~1/(m+1)
of the keys that now score highest on it (modulo hashing, as Bagua used, moves ~m/(m+1) of them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    # splitmix64 finaliser: a cheap bijective mix so that scores of different nodes are independent.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class RendezvousHash:
    """Maps keys to one of ``node_ids`` (e.g. ``["127.0.0.1:7000", ...]``)."""

    def __init__(self, node_ids: Sequence[str]) -> None:
        if not node_ids:
            raise ValueError("RendezvousHash needs at least one node id")
        if len(set(node_ids)) != len(node_ids):
            raise ValueError(f"node ids must be distinct, got {list(node_ids)}")
        self.node_ids = list(node_ids)
        self._seeds = [_h64(n.encode()) for n in self.node_ids]

    def node_of(self, key: str | bytes) -> int:
        """Index into ``node_ids`` of the node that owns ``key``."""
        if len(self._seeds) == 1:
            return 0
        h = _h64(key.encode() if isinstance(key, str) else key)
        best, best_score = 0, -1
        for i, seed in enumerate(self._seeds):
            score = _mix64(h ^ seed)
            if score > best_score:
                best, best_score = i, score
        return best
