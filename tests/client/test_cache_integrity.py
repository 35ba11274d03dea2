"""Entries in a real Redis that are forged, hostile or foreign: each is a miss that is reloaded and rewritten."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from bagua_lightning.client import CachedDataset, RedisStore
from bagua_lightning.client.cache import codec
from bagua_lightning.services.redis_cluster import ClusterInfo
from tests.client.cache_datasets import Source

SECRET = b"the job's cache key"


def test_forged_entry_with_a_valid_checksum_is_a_miss_under_a_cache_key(store: RedisStore,
                                                                        redis_cluster3: ClusterInfo) -> None:
    ds = CachedDataset(Source(4), dataset_name="keyed", hosts=redis_cluster3.hosts, cache_key=SECRET,
                       writer_buffer_size=1)
    ds.__getitems__([0, 1, 2, 3])
    key = ds.cache_loader.redis_key(2)
    # Someone who can write to Redis but has no cache key stores a well-formed entry with a valid digest.
    forged = (torch.full((3, 8, 8), 666.0), 2, {"np": np.zeros(4, dtype=np.int32), "id": "forged"})
    # (straight through redis-py: RedisStore refuses a value in clear under the sealed prefix)
    store.nodes.client_for_key(key).set(key, bytes(codec.encode(forged, key.encode())))
    out = ds.__getitems__([0, 1, 2, 3])
    assert out[2][2]["id"] == "s0-2" and torch.equal(out[2][0], Source(4)[2][0])
    assert ds.stats.corrupt == 1
    rewritten = store.get(key) or b""
    assert codec.decode(rewritten, key.encode(), secret=SECRET)[2]["id"] == "s0-2"
    with pytest.raises(codec.CorruptEntryError):
        codec.decode(rewritten, key.encode())  # keyed entries need the key
    unkeyed = CachedDataset(Source(4), dataset_name="keyed", hosts=redis_cluster3.hosts, cache_key=b"")
    unkeyed.__getitems__([0])
    assert unkeyed.stats.hits == 0  # a job without the key never reads (or is fooled by) sealed entries


def test_cache_key_comes_from_the_deployment(store: RedisStore, redis_cluster3: ClusterInfo,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAGUA_LIGHTNING_CACHE_KEY", SECRET.decode())
    ds = CachedDataset(Source(2), dataset_name="env-keyed", hosts=redis_cluster3.hosts, writer_buffer_size=1)
    ds.__getitems__([0, 1])
    key = ds.cache_loader.redis_key(0)
    assert codec.decode(store.get(key) or b"", key.encode(), secret=SECRET)[1] == 0


def test_deeply_nested_entry_is_a_miss_reloaded_and_rewritten(store: RedisStore, redis_cluster3: ClusterInfo) -> None:
    ds = CachedDataset(Source(3), dataset_name="deep", hosts=redis_cluster3.hosts, writer_buffer_size=1)
    ds.__getitems__([0, 1, 2])
    key = ds.cache_loader.redis_key(1)
    meta = b"[\x01\x00\x00\x00" * 2000 + b"[\x00\x00\x00\x00"  # 2,000 nested lists, valid digest
    store.set(key, bytes(codec._assemble(key.encode(), None, codec.default_digest_kind(), 0, meta, b"", [], 0)))
    for _ in range(2):  # the second pass reads the rewritten entry
        out = ds.__getitems__([0, 1, 2])
        assert out[1][2]["id"] == "s0-1"
    assert ds.stats.corrupt == 1
    assert codec.decode(store.get(key) or b"", key.encode())[1] == 1


class Images(Dataset[Any]):
    """A torchvision-style dataset without a tensor transform: ``(PIL.Image, int)``."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.images = [Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)) for _ in range(n)]
        self.loads = 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Any:
        self.loads += 1
        return self.images[i].convert("L" if i % 2 else "RGB"), i


def test_pil_dataset_is_cached_as_it_is(store: RedisStore, redis_cluster3: ClusterInfo) -> None:
    source = Images(6)
    first = CachedDataset(source, dataset_name="pil", hosts=redis_cluster3.hosts)
    assert [first[i] for i in range(6)] == [source[i] for i in range(6)]
    again = CachedDataset(Images(6), dataset_name="pil", hosts=redis_cluster3.hosts)
    out = again.__getitems__(list(range(6)))
    assert again.stats.hits == 6 and again.dataset.loads == 0  # type: ignore[attr-defined]
    assert out == [source[i] for i in range(6)] and all(type(img) is Image.Image for img, _ in out)
    with pytest.raises(IndexError, match="out of range"):
        again[6]
    assert again[-1] == source[5]
