"""CacheLoader: values computed by an expensive function, cached in a key-value store by key; its statistics
(:class:`CacheStats`), summed over the process and its DataLoader workers."""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ...core.errors import ConfigurationError
from ...core.read_plane import SEALED_KEY_PREFIX
from . import codec
from .catalog import entry_prefix
from .digests import keyed_digest_kind
from .faults import OutagePolicy, OutageTracker, quiet_outages
from .keyring import Keyring
from .store import STORE_ERRORS, RedisStore, Store

log = logging.getLogger("bagua_lightning.client.cache")

BACKENDS = ("redis",)
SERIALIZERS = ("safe", "pickle")
DEFAULT_VERSION = "0"


FIELDS = ("hits", "misses", "corrupt", "errors", "bytes_read", "bytes_written", "writes", "write_errors")
_SLOTS = 65  # slot 0: the main process; slot 1 + worker id for DataLoader workers (folded beyond 64)


@dataclass(kw_only=True)
class CacheStats:
    """Counters of a cache loader.

    Attributes:
        hits: samples decoded from the cache.
        misses: samples loaded from the source (not cached, evicted, corrupt, or the store unavailable).
        corrupt: entries that failed their checksum or format check (each also counts as a miss).
        errors: store calls that did not get every answer (a node unreachable, timed out, failing over, or
            backing off after failing: then its keys are skipped without a network call).
        bytes_read: bytes of entries read from the cache.
        bytes_written: bytes of entries written to the cache.
        writes: entries written.
        write_errors: entries that could not be written because their node (or the whole store) failed.
    """

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    write_errors: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self, prefix: str = "cache/") -> dict[str, float]:
        """Flat numbers for ``LightningModule.log_dict`` or any metrics logger."""
        out = {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}
        out[f"{prefix}hit_rate"] = self.hit_rate
        return out


class SharedCounters:
    """Counters in shared memory, one row per process, so the parent sees its forked workers' counts.

    Each process writes only its own row (no lock needed); :meth:`snapshot` sums the rows.
    """

    def __init__(self) -> None:
        self._arr = multiprocessing.RawArray("q", _SLOTS * len(FIELDS))
        self._index = {name: i for i, name in enumerate(FIELDS)}
        self._pid = -1
        self._base = 0

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_pid"] = -1
        return state

    def _row(self) -> int:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            slot = 0
            try:
                from torch.utils.data import get_worker_info

                info = get_worker_info()
                if info is not None:
                    slot = 1 + info.id % (_SLOTS - 1)
            except ImportError:  # pragma: no cover
                pass
            self._base = slot * len(FIELDS)
        return self._base

    def add(self, name: str, n: int = 1) -> None:
        self._arr[self._row() + self._index[name]] += n

    def snapshot(self) -> CacheStats:
        totals = [0] * len(FIELDS)
        for slot in range(_SLOTS):
            base = slot * len(FIELDS)
            for i in range(len(FIELDS)):
                totals[i] += self._arr[base + i]
        return CacheStats(**dict(zip(FIELDS, totals, strict=True)))

    def reset(self) -> None:
        for i in range(len(self._arr)):
            self._arr[i] = 0


class CacheLoader:
    """Caches values of an expensive ``load_fn`` by key in Redis, so later reads skip the computation.

    Entries are stored under ``"{dataset_name}:{version}:{key}"`` with the name and version percent-encoded
    (:mod:`.catalog`): loaders with the same name and version share entries (also across jobs), a new version
    never sees the old ones. Values go through the safe codec (:mod:`.codec`), each entry carrying a digest
    bound to its key, keyed with the cache key when one is configured; an entry that does not decode, for
    any reason, is a miss that is reloaded, rewritten and counted. When the store is unreachable values come
    from ``load_fn``, a warning is logged once per outage, and caching resumes when the store is back.

    Args:
        backend: key-value store implementation; only ``"redis"``.
        dataset_name: name of the dataset, any string (``""`` is shared by every unnamed loader, as in
            Bagua).
        writer_buffer_size: number of new entries to collect before writing them in one pipelined call.
        version: the dataset's version (user-chosen, or a fingerprint such as
            :func:`bagua_lightning.client.cache.fingerprint`); default ``"0"``.
        serializer: ``"safe"`` (default) or ``"pickle"``, which stores any picklable value but runs code
            from the cache when reading it: only for a Redis that nobody untrusted can write to.
        store: an existing :class:`Store` to use instead of creating a ``RedisStore``.
        cache_key: the secret that seals entries (AES-256-GCM, docs/cache.md); None: the deployment's
            (:func:`bagua_lightning.core.services_file.resolve_cache_keys`; during a key rotation both keys
            open entries and new ones are sealed with the new one, :mod:`.keyring`), ``b""``: none (unkeyed
            digest). Every job sharing a cache must use the same key: an entry written without it, or with
            another, is a miss.
        outage_policy: back-off while the store is unavailable.
        record_catalog: keep the datasets catalog up to date on writes.
        **kwargs: :class:`RedisStore` arguments (``hosts``, ``cluster_mode``, ``capacity_per_node``,
            ``password``, ``username``, ``ssl``, timeouts).
    """

    # With a cache key, entries are sealed (encrypted and authenticated, docs/cache.md) and read from the
    # deployment's read ports where it has them; False writes them authenticated only (the earlier format,
    # for benchmarks and for readers of earlier releases).
    seal: bool | None = None

    def __init__(self, backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 1, *,
                 version: str = DEFAULT_VERSION, serializer: str = "safe", store: Store | None = None,
                 outage_policy: OutagePolicy | None = None, record_catalog: bool = True,
                 cache_key: bytes | str | None = None, **kwargs: Any) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not supported; use one of {list(BACKENDS)}.")
        if serializer not in SERIALIZERS:
            raise ValueError(f"serializer={serializer!r} is not supported; use 'safe' or 'pickle'.")
        if not isinstance(writer_buffer_size, int) or writer_buffer_size < 1:
            raise ConfigurationError(f"writer_buffer_size={writer_buffer_size!r}; use an integer >= 1.")
        self._prefix = entry_prefix(dataset_name, str(version))  # validates both
        self.dataset_name = dataset_name
        self.version = str(version)
        self.writer_buffer_size = writer_buffer_size
        self.serializer = serializer
        if serializer == "pickle":
            warnings.warn(
                'CacheLoader(serializer="pickle"): entries are unpickled when read, so anyone who can write to '
                "this Redis can run code in every training process. Use it only with a trusted, "
                "password-protected Redis.", UserWarning, stacklevel=2)
        self.store: Store = store if store is not None else RedisStore(outage_policy=outage_policy, **kwargs)
        self.record_catalog = record_catalog
        self._allow_pickle = serializer == "pickle"
        # The cache keys by id (.keyring): the deployment's, read again during a rotation, or the one given.
        given = cache_key.encode() if isinstance(cache_key, str) else cache_key
        self._keyring = Keyring.resolve() if given is None else Keyring([given]) if given else None
        self._secret = self._keyring.current if self._keyring is not None else None
        # A RedisStore backs off each failing node itself (the keys of the others keep hitting); any other
        # store gets one circuit breaker around all of it.
        self._outage: OutageTracker | None = None if self.store.isolates_failures else OutageTracker(
            f"the sample cache ({self.store!r})", outage_policy)
        self._counters = SharedCounters()
        self._buffer: dict[str, tuple[memoryview, bool]] = {}  # redis key -> (entry, overwrite)
        self._lock = threading.Lock()
        _register_exit_flush(self)

    # The write buffer and the lock are per process; a pickled loader starts empty.
    def __getstate__(self) -> dict[str, Any]:
        if self._buffer:
            self.flush()
        state = self.__dict__.copy()
        state["_buffer"] = {}
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _register_exit_flush(self)

    def _key_prefix(self) -> str:
        """What the store keys of this loader's entries start with: sealed entries (a cache key, ``seal`` not
        False, ``cryptography`` installed) live apart, under the one prefix the read ports may read
        (:mod:`bagua_lightning.core.read_plane`); entries in clear never do."""
        sealing = self._secret is not None and self.seal is not False and keyed_digest_kind() == codec.DIGEST_SEAL
        return SEALED_KEY_PREFIX + self._prefix if sealing else self._prefix

    def redis_key(self, key: Hashable) -> str:
        """The store key of ``key``: ``"{dataset_name}:{version}:{key}"``, name and version encoded (sealed:
        after ``"!sealed:"``)."""
        return f"{self._key_prefix()}{key}"

    def get(self, key: Any, load_fn: Callable[[Any], Any]) -> Any:
        """The cached value of ``key``, or ``load_fn(key)`` (then cached) on a miss: Bagua's one-key form of
        :meth:`get_many` (``CachedDataset`` reads through that)."""
        return self.get_many([key], functools.partial(_each, load_fn))[0]

    def get_many(self, keys: Sequence[Any], load_many_fn: Callable[[list[Any]], Sequence[Any]]) -> list[Any]:
        """Values of ``keys`` in order, fetched in one batched read; misses come from ``load_many_fn(missing)``.

        Raises:
            TypeError: a loaded value the codec cannot store (the message names it and the opt-in); checked when
                the value is written, so not while every node of the store is unavailable.
        """
        if _registered_pid[0] != os.getpid():  # first use in a forked DataLoader worker
            _register_exit_flush(self)
        prefix = self._key_prefix()
        rkeys = list(map(prefix.__add__, map(str, keys)))  # f"{prefix}{key}", in C loops
        out: list[Any] = [None] * len(keys)
        found = [False] * len(keys)
        overwrite = [False] * len(keys)
        counters = self._counters
        to_fetch = list(range(len(keys)))
        if self._buffer:
            to_fetch = self._from_buffer(rkeys, out, found, to_fetch)
        outage = self._outage
        if to_fetch and (outage is None or outage.available()):
            everything = len(to_fetch) == len(rkeys)
            fetch_keys = list(map(str.encode, rkeys if everything else [rkeys[j] for j in to_fetch]))
            values, error = self.store.fetch(fetch_keys, sealed=True) if prefix.startswith(SEALED_KEY_PREFIX) \
                else self.store.fetch(fetch_keys)
            decoded = codec.decode_many(values, fetch_keys, self._allow_pickle, self._secret)
            if self._keyring is not None:  # entries another key of the ring sealed (a rotation), opened with it
                self._secret = self._keyring.reopen(decoded, values, fetch_keys, self._allow_pickle)
            if everything and codec.Bad not in set(map(type, decoded)):  # every key a hit: the usual batch
                out = decoded
                found = [True] * len(keys)
                nbytes = sum(map(len, values))
            else:
                nbytes = 0
                for j, sample, value in zip(to_fetch, decoded, values, strict=True):
                    if type(sample) is codec.Bad:
                        if sample is not codec.MISSING:
                            counters.add("corrupt")
                            overwrite[j] = True
                            log.debug("cache entry %s is invalid (%s); reloading it", rkeys[j], sample.error)
                        continue
                    out[j] = sample
                    found[j] = True
                    nbytes += len(value)
            if error is not None:
                counters.add("errors")
                if outage is not None:
                    outage.failure(error)
            elif outage is not None:
                outage.success()
            counters.add("bytes_read", nbytes)
        missing = [j for j, hit in enumerate(found) if not hit]
        counters.add("hits", len(keys) - len(missing))
        if missing:
            counters.add("misses", len(missing))
            loaded = load_many_fn([keys[j] for j in missing])
            if len(loaded) != len(missing):
                raise ValueError(f"load function returned {len(loaded)} values for {len(missing)} keys")
            for j, value in zip(missing, loaded, strict=True):
                out[j] = value
            if not self.store.writable():  # every node backing off: no entry could be written, skip encoding
                counters.add("write_errors", len(missing))
                return out
            for j, value in zip(missing, loaded, strict=True):
                entry = codec.encode(value, rkeys[j].encode(), allow_pickle=self._allow_pickle, secret=self._secret,
                                     seal=self.seal)
                self._buffer[rkeys[j]] = (entry, overwrite[j])
            _pending[id(self)] = self  # kept alive until flushed, at the latest at exit
            if len(self._buffer) >= self.writer_buffer_size:
                self.flush()
        return out

    def _from_buffer(self, rkeys: list[str], out: list[Any], found: list[bool], to_fetch: list[int]) -> list[int]:
        rest = []
        for j in to_fetch:
            pending = self._buffer.get(rkeys[j])
            if pending is None:
                rest.append(j)
            else:
                out[j] = codec.decode(pending[0], rkeys[j].encode(), allow_pickle=self._allow_pickle,
                                      secret=self._secret)
                found[j] = True
        return rest

    def flush(self) -> None:
        """Write the buffered entries now (a store failure drops them and is counted, never raised)."""
        if self._lock is None or not self._buffer:
            return
        with self._lock:
            items, self._buffer = self._buffer, {}
            _pending.pop(id(self), None)
        if self._outage is not None and not self._outage.available():
            self._counters.add("write_errors", len(items))
            return
        new = [(k, v) for k, (v, ow) in items.items() if not ow]
        rewrite = [(k, v) for k, (v, ow) in items.items() if ow]
        created_n = created_bytes = 0
        failed = 0
        for batch, overwrite in ((new, False), (rewrite, True)):
            if not batch:
                continue
            done, error = self.store.put(batch, overwrite)
            if error is not None:
                self._counters.add("errors")
                if self._outage is not None:
                    self._outage.failure(error)
                # The keys of the nodes that answered are written; the others (a failed node, or one backing
                # off) count as failed. (An NX key that existed on a live node is counted so too: a
                # slight overcount, only during an outage.)
                failed += done.count(False)
            for (_, v), ok in zip(batch, done, strict=True):
                if ok:
                    self._counters.add("writes")
                    self._counters.add("bytes_written", v.nbytes)
                if ok and not overwrite:
                    created_n += 1
                    created_bytes += v.nbytes
        if failed:
            self._counters.add("write_errors", failed)
        elif self.record_catalog:
            try:
                catalog = self.store.catalog()
                if catalog is not None:
                    catalog.record(self.dataset_name, self.version, created_n, created_bytes)
            except STORE_ERRORS as exc:
                log.debug("catalog update failed: %s", exc)

    def num_keys(self) -> int:
        """Number of keys in the backing store (all datasets, as in Bagua)."""
        return self.store.num_keys()

    def cleanup(self) -> None:
        """Write pending entries, then release the store (Bagua's ``cleanup``): its connections close, and a
        node-local server stops only if this process started it."""
        self.flush()
        self.store.shutdown()

    @property
    def stats(self) -> CacheStats:
        """Counters of this loader, summed over this process and its DataLoader workers."""
        return self._counters.snapshot()

    def reset_stats(self) -> None:
        self._counters.reset()


def _each(load_fn: Callable[[Any], Any], keys: list[Any]) -> list[Any]:
    return [load_fn(k) for k in keys]


# Flush every loader with pending entries when the process exits. DataLoader workers leave through
# multiprocessing, which skips atexit but runs its own finalizers, so both hooks are registered (a second
# flush finds nothing). Loaders with pending entries are held here so that they outlive their dataset.
_pending: dict[int, CacheLoader] = {}
_registered_pid: list[int] = [-1]


def _flush_all() -> None:
    # Best effort: an entry whose store is gone by now is simply not cached (logged at debug level).
    with quiet_outages():
        for loader in list(_pending.values()):
            try:
                loader.flush()
            except Exception as exc:
                log.debug("flush at exit failed: %s", exc)


def _register_exit_flush(loader: CacheLoader) -> None:
    if _registered_pid[0] != os.getpid():
        _registered_pid[0] = os.getpid()
        atexit.register(_flush_all)
        multiprocessing.util.Finalize(None, _flush_all, exitpriority=100)
