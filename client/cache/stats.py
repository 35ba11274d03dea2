"""Cache statistics, summed over the process and its DataLoader workers."""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import asdict, dataclass

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
