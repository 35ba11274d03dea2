"""The digests of cache entries: one per entry, over the key it is stored under and its bytes.

Kinds (the byte after the format version in an entry's header, :mod:`.codec`):

* ``hmac-sha256``, truncated to 24 bytes: when a cache key is configured. The message is
  ``u64(len(redis key)) | redis key | entry from the flags on``, so a valid entry copied under another key
  fails, and the length prefix keeps ``(key, entry)`` pairs from running into each other. HMAC-SHA256 is a
  PRF as long as SHA-256's compression function is one; a forger who does not hold the cache key succeeds
  with probability about ``2**-192`` per attempt at 24 bytes. Measured as the fastest MAC of the standard
  library where it matters (SHA-256 runs on the CPU's SHA extensions): see docs/cache.md.
* ``xxh3-64`` (the ``xxhash`` package) or ``crc32`` (zlib) without a key: corruption, not forgery.

A batch of keyed entries is verified on the calling thread and a few others at once (:func:`hmac_many`):
OpenSSL's SHA-256 releases the GIL over large inputs, so the threads hash in parallel on as many cores,
where the cores are idle (measured as it goes: see :class:`_Helpers`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import itertools
import os
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .values import CorruptEntryError


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


xxhash: Any = _optional("xxhash")  # ~30 GB/s checksums when installed; zlib's crc32 otherwise

DIGEST_CRC32, DIGEST_XXH3, DIGEST_HMAC = 1, 2, 3
DIGEST_NAMES = {DIGEST_CRC32: "crc32", DIGEST_XXH3: "xxh3-64", DIGEST_HMAC: "hmac-sha256"}
DIGEST_SIZE = 24  # bytes of the digest field

MAC_THREADS = 7  # helper threads at most, on top of the caller, that verify a keyed batch
PARALLEL_MIN_BYTES = 128 * 1024  # a keyed batch smaller than this is verified on the calling thread only
EXPLORE_BATCHES = 16  # large batches between tries of the way not in use, times (its cost / the other's)**2

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_BLOCK = 64  # bytes: SHA-256's block, HMAC's key length
_PAD16 = bytes(16)
_PAD20 = bytes(20)


def default_digest_kind() -> int:
    """The unkeyed digest this process writes: xxh3-64 when ``xxhash`` is installed, else crc32."""
    return DIGEST_XXH3 if xxhash is not None else DIGEST_CRC32


@functools.lru_cache(maxsize=8)
def _hmac_pads(secret: bytes) -> tuple[Any, Any]:
    """SHA-256 states after ``secret ^ ipad`` and ``secret ^ opad`` (RFC 2104), copied for each entry: the same
    digest as ``hmac.new``, with a few C calls per entry instead of its Python wrapper (about 1 us less)."""
    if len(secret) > _BLOCK:
        secret = hashlib.sha256(secret).digest()
    secret = secret.ljust(_BLOCK, b"\0")
    return (hashlib.sha256(bytes(b ^ 0x36 for b in secret)), hashlib.sha256(bytes(b ^ 0x5C for b in secret)))


def hmac_digest(secret: bytes, key: bytes, covered: Any) -> bytes:
    """The ``hmac-sha256`` digest of the entry part ``covered`` stored under ``key``: HMAC-SHA256 with the cache
    key of ``u64(len(key)) | key | covered``, its first :data:`DIGEST_SIZE` bytes."""
    inner, outer = _hmac_pads(secret)
    h = inner.copy()
    h.update(_U64.pack(len(key)) + key)
    h.update(covered)  # the GIL is released while OpenSSL hashes a large buffer
    o = outer.copy()
    o.update(h.digest())
    return o.digest()[:DIGEST_SIZE]


def digest(kind: int, key: bytes, secret: bytes | None, covered: Any) -> bytes:
    """Digest field of kind ``kind`` for ``key`` and the ``covered`` part of an entry (all after the field)."""
    if kind == DIGEST_XXH3:
        if xxhash is None:
            raise CorruptEntryError("entry carries an xxh3 digest; install xxhash to verify it")
        return _U64.pack(xxhash.xxh3_64_intdigest(covered, xxhash.xxh3_64_intdigest(key))) + _PAD16
    if kind == DIGEST_HMAC:
        if secret is None:
            raise CorruptEntryError("entry is authenticated with a cache key, and none is configured here")
        return hmac_digest(secret, key, covered)
    if kind == DIGEST_CRC32:
        return _U32.pack(zlib.crc32(covered, zlib.crc32(key))) + _PAD20
    raise CorruptEntryError(f"unknown digest kind {kind}")


class _Helpers:
    """The helper threads of this process, started on first use and again after a ``fork`` (a DataLoader
    worker's copy of its parent's pool has no threads), and the choice between using them or not.

    Threads only pay where cores are idle. On a machine whose cores are all busy (other processes, other
    DataLoader workers) every hand-over of the GIL waits for the OS to schedule the other thread, and a batch
    verified on two threads was measured 13x slower than on the caller alone (load 13 on 2 cores). So the cost
    per byte of both ways is measured as batches are verified (a moving average), the cheaper one is used, and
    the other is tried again now and then: the more it costs, the more rarely (a 13x worse way costs ~0.5 %).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self.count = 0
        self.cost = [0.0, 0.0]  # seconds per byte, moving averages: [caller alone, with helpers]; 0: unmeasured
        self._since = 0  # batches since the way not in use was last tried

    def pool(self) -> ThreadPoolExecutor | None:
        if self._pid == os.getpid():
            return self._pool
        with self._lock:
            if self._pid != os.getpid():
                try:
                    cores = len(os.sched_getaffinity(0))
                except AttributeError:  # not on Linux
                    cores = os.cpu_count() or 1
                self.count = min(MAC_THREADS, cores - 1)
                self._pool = (ThreadPoolExecutor(self.count, thread_name_prefix="bagua-lightning-mac")
                              if self.count > 0 else None)
                self.cost = [0.0, 0.0]
                self._since = 0
                self._pid = os.getpid()
        return self._pool

    def use_helpers(self) -> bool:
        """Whether the next large batch goes to the helpers too."""
        alone, helped = self.cost
        if not alone or not helped:
            return not helped  # measure each way once
        best = helped < alone
        self._since += 1
        ratio = max(alone, helped) / min(alone, helped)
        if self._since >= EXPLORE_BATCHES * ratio * ratio:  # try the other way again
            self._since = 0
            return not best
        return best

    def record(self, helped: bool, seconds: float, nbytes: int) -> None:
        old = self.cost[helped]
        per_byte = seconds / nbytes
        self.cost[helped] = per_byte if not old else old + (per_byte - old) / 8


_HELPERS = _Helpers()


def helper_threads() -> int:
    """How many helper threads verify a large keyed batch in this process (0: the caller alone)."""
    _HELPERS.pool()
    return _HELPERS.count


def _macs(secret: bytes, keys: Sequence[bytes], covered: Sequence[Any]) -> list[bytes]:
    return [hmac_digest(secret, k, c) for k, c in zip(keys, covered, strict=True)]


def hmac_many(secret: bytes, keys: Sequence[bytes], covered: Sequence[Any], nbytes: int) -> list[bytes]:
    """``hmac-sha256`` digests of many entries (``covered[i]`` stored under ``keys[i]``; ``nbytes`` in all).

    A batch of at least :data:`PARALLEL_MIN_BYTES` is cut into as many runs as there are threads to hash
    them (the caller and up to :data:`MAC_THREADS` helpers, one fewer than the cores this process may use),
    every thread hashing one run, the caller included, when that was measured to be cheaper than the caller
    alone (:class:`_Helpers`).
    """
    n = len(covered)
    helpers = _HELPERS
    pool = helpers.pool() if nbytes >= PARALLEL_MIN_BYTES and n > 1 else None
    if pool is None:
        return _macs(secret, keys, covered)
    helped = helpers.use_helpers()
    start = time.perf_counter()
    if not helped:
        out = _macs(secret, keys, covered)
    else:
        parts = min(n, helpers.count + 1)
        cuts = [n * p // parts for p in range(parts + 1)]
        futures: list[Future[list[bytes]]] = [
            pool.submit(_macs, secret, keys[a:b], covered[a:b]) for a, b in itertools.pairwise(cuts[1:])]
        out = _macs(secret, keys[:cuts[1]], covered[:cuts[1]])
        for f in futures:
            out += f.result()
    helpers.record(helped, time.perf_counter() - start, nbytes)
    return out
