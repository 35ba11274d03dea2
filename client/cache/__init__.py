"""The sample cache: a safe codec, stores (Redis, sharded), CacheLoader and CachedDataset.

``CachedDataset`` and ``CacheLoader`` import torch; the codec, the stores and the catalog do not.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from .codec import CorruptEntryError, decode, encode
from .faults import OutagePolicy
from .loader import CacheLoader, CacheStats
from .store import ClusterStore, RedisOptions, RedisStore, Store

if TYPE_CHECKING:
    from .dataset import CachedDataset

__all__ = [
    "CacheLoader",
    "CacheStats",
    "CachedDataset",
    "ClusterStore",
    "CorruptEntryError",
    "OutagePolicy",
    "RedisOptions",
    "RedisStore",
    "Store",
    "decode",
    "encode",
    "fingerprint",
]


def fingerprint(*parts: Any) -> str:
    """A short version string for a dataset: a hash of ``parts``.

    Strings, bytes and numbers are hashed by value; ``os.PathLike`` objects by path, size and modification
    time (a file or every file under a folder), so editing the source files changes the version.
    """
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, os.PathLike):
            path = os.fspath(part)
            files = [path] if not os.path.isdir(path) else sorted(
                os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
            for f in files:
                st = os.stat(f)
                h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        elif isinstance(part, bytes):
            h.update(part)
        else:
            h.update(repr(part).encode())
        h.update(b"\x1f")
    return h.hexdigest()


def __dir__() -> list[str]:
    return sorted({*globals(), "CachedDataset"})


def __getattr__(name: str) -> Any:
    if name == "CachedDataset":  # imports torch.utils.data
        from .dataset import CachedDataset

        return CachedDataset
    raise AttributeError(name)
