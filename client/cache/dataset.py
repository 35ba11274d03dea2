"""CachedDataset: a map-style dataset whose samples are cached in Redis after their first load."""

from __future__ import annotations

import operator
import os
from typing import Any

from torch.utils.data import Dataset

from .loader import CacheLoader, CacheStats


def _index(i: Any) -> int:
    try:
        return operator.index(i)
    except TypeError:
        raise TypeError(f"CachedDataset index {i!r} of type {type(i).__name__} is not an integer") from None


class CachedDataset(Dataset[Any]):
    """Wraps a map-style dataset and caches its samples in a key-value store (Redis).

    Sample ``i`` is stored under ``"{dataset_name}:{version}:{i}"``. Use a new ``version`` whenever the
    source or its preprocessing changes (``bagua_lightning.client.cache.fingerprint`` derives one); by
    default it is ``"n<len(dataset)>"``, which only catches a change of length.

    A DataLoader with a batch size fetches each batch through :meth:`__getitems__`: one pipelined multi-get
    for the whole batch, the misses loaded from the source (through the source's own ``__getitems__`` when it
    has one) and written back in one pipelined call. New entries are written when ``writer_buffer_size`` of
    them are pending, after every full pass over the dataset in the process, and when the process (or a
    DataLoader worker) exits.

    Args:
        dataset: the map-style dataset to wrap.
        backend: key-value store implementation; only ``"redis"``.
        dataset_name: name of the dataset; datasets with the same name and version share entries.
        writer_buffer_size: number of new samples to collect before writing them.
        **kwargs: :class:`CacheLoader` arguments (``version``, ``serializer``, ``store``) and
            :class:`RedisStore` arguments (``hosts``, ``cluster_mode``, ``capacity_per_node``, ``password``...).
    """

    def __init__(self, dataset: Dataset[Any], backend: str = "redis", dataset_name: str = "",
                 writer_buffer_size: int = 20, **kwargs: Any) -> None:
        self.dataset = dataset
        self._len = len(dataset)  # type: ignore[arg-type]
        kwargs.setdefault("version", f"n{self._len}")
        self.cache_loader = CacheLoader(backend=backend, dataset_name=dataset_name,
                                        writer_buffer_size=writer_buffer_size, **kwargs)
        self._served = 0
        self._served_pid = os.getpid()

    def __len__(self) -> int:
        return self._len

    def _check(self, index: Any) -> int:
        i = _index(index)
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} is out of range for a dataset of {self._len} samples")
        return i % self._len  # one key per sample: -1 and len-1 are the same entry

    def __getitem__(self, index: Any) -> Any:
        i = self._check(index)
        value = self.cache_loader.get_many([i], self._load_many)[0]
        self._count(1)
        return value

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        n = self._len
        if indices and set(map(type, indices)) == {int} and min(indices) >= 0 and max(indices) < n:
            idx = list(indices)  # plain in-range ints: the sampler's batches
        else:
            idx = [i if type(i) is int and 0 <= i < n else self._check(i) for i in indices]
        values = self.cache_loader.get_many(idx, self._load_many)
        self._count(len(idx))
        return values

    def _load_many(self, indices: list[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        if callable(getitems):
            return list(getitems(indices))
        return [self.dataset[i] for i in indices]

    def _count(self, n: int) -> None:
        # A full pass over the dataset in this process (an epoch without workers): write what is pending.
        if self._served_pid != os.getpid():
            self._served_pid, self._served = os.getpid(), 0
        before = self._served // self._len if self._len else 0
        self._served += n
        if self._len and self._served // self._len != before:
            self.cache_loader.flush()

    def flush(self) -> None:
        """Write pending entries now (e.g. at the end of an epoch with persistent workers)."""
        self.cache_loader.flush()

    @property
    def stats(self) -> CacheStats:
        """Hits, misses, corrupt entries, errors and bytes, summed over this process and its workers."""
        return self.cache_loader.stats
