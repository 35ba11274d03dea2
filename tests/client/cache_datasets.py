"""Small source datasets for the cache tests (importable by DataLoader workers and fresh processes)."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class Source(Dataset[Any]):
    """Deterministic samples: ``(image, label, {"np": array, "id": str})``; ``seed`` changes every value."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.n = n
        self.seed = seed
        self.loads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.loads += 1
        g = torch.Generator().manual_seed(i * 1000 + self.seed)
        image = torch.randn(3, 8, 8, generator=g)
        extra = {"np": np.arange(i, i + 4, dtype=np.int32) * (self.seed + 1), "id": f"s{self.seed}-{i}"}
        return image, i, extra


class Unstorable(Dataset[Any]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return {"value": {i}}  # a set: not storable by the safe codec


def second_job(hosts: str, name: str, version: str, n: int, seed: int) -> None:
    """A fresh process reading the whole dataset once; prints what it had to load from the source."""
    from bagua_lightning.client import CachedDataset

    source = Source(n, seed)
    ds = CachedDataset(source, dataset_name=name, version=version, hosts=hosts.split(","))
    for i in range(n):
        image, label, extra = ds[i]
        expected = source.__class__(n, seed)[i]
        assert torch.equal(image, expected[0]) and label == i and extra["id"] == expected[2]["id"]
    print(json.dumps({"loads": source.loads, "hits": ds.stats.hits, "misses": ds.stats.misses}))


def write_and_exit(hosts: str, name: str, n: int) -> None:
    """Loads ``n`` samples with a buffer larger than ``n`` and exits: the exit flush must write them."""
    from bagua_lightning.client import CachedDataset

    ds = CachedDataset(Source(n), dataset_name=name, version="exit", writer_buffer_size=10_000,
                       hosts=hosts.split(","))
    ds._len = 10**9  # no "full pass" flush: only the exit hook may write
    for i in range(n):
        ds[i]
    print(json.dumps({"pending": len(ds.cache_loader._buffer)}))


if __name__ == "__main__":
    fn = {"second_job": second_job, "write_and_exit": write_and_exit}[sys.argv[1]]
    fn(*[int(a) if a.isdigit() else a for a in sys.argv[2:]])  # type: ignore[operator]
