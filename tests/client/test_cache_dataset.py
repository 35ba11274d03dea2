"""CachedDataset and CacheLoader end to end on real Redis: parity with Bagua and the promises beyond it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import redis
import torch
from torch.utils.data import DataLoader

from bagua_lightning.cli import main as cli_main
from bagua_lightning.client import CachedDataset, CacheLoader, RedisStore
from bagua_lightning.client.cache import catalog, codec
from bagua_lightning.services.redis_cluster import ClusterInfo
from tests.client.cache_datasets import Source, Unstorable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_ENV = dict(os.environ)


def same_sample(a: Any, b: Any) -> bool:
    return (torch.equal(a[0], b[0]) and a[0].dtype == b[0].dtype and a[1] == b[1]
            and np.array_equal(a[2]["np"], b[2]["np"]) and a[2]["np"].dtype == b[2]["np"].dtype
            and a[2]["id"] == b[2]["id"])


@pytest.fixture
def cluster_store(redis_cluster3: ClusterInfo) -> Any:
    store = RedisStore(hosts=redis_cluster3.hosts)
    store.clear()
    yield store
    store.clear()
    store.shutdown()


def test_cached_samples_equal_the_originals(any_deployment: tuple[str, ClusterInfo, dict[str, object]]) -> None:
    _, info, options = any_deployment
    source = Source(40)
    ds = CachedDataset(source, dataset_name="exact", writer_buffer_size=7, hosts=info.hosts, **options)
    first = [ds[i] for i in range(len(ds))]
    second = [ds[i] for i in range(len(ds))]
    assert source.loads == 40  # the second pass came from the cache
    assert all(same_sample(a, source.__class__(40)[i]) for i, a in enumerate(first))
    assert all(same_sample(a, b) for a, b in zip(first, second, strict=True))
    assert ds.stats.hits == 40 and ds.stats.misses == 40 and ds.stats.corrupt == 0


def test_two_datasets_on_one_store_hold_the_sum_of_their_lengths(cluster_store: RedisStore,
                                                                  redis_cluster3: ClusterInfo) -> None:
    d1 = CachedDataset(Source(30), dataset_name="d1", hosts=redis_cluster3.hosts)
    d2 = CachedDataset(Source(20), dataset_name="d2", hosts=redis_cluster3.hosts)
    for d in (d1, d2):
        for i in range(len(d)):
            d[i]
    assert cluster_store.num_keys() == len(d1) + len(d2)
    assert d1.cache_loader.num_keys() == 50


def test_dataloader_with_two_workers_fetches_batches(cluster_store: RedisStore,
                                                      redis_cluster3: ClusterInfo) -> None:
    source = Source(96)
    ds = CachedDataset(source, dataset_name="dl", hosts=redis_cluster3.hosts)
    loader = DataLoader(ds, batch_size=16, num_workers=2, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    for epoch in range(2):
        seen = set()
        for images, labels, extra in loader:
            for image, label, npa in zip(images, labels.tolist(), extra["np"], strict=True):
                assert torch.equal(image, source[label][0]) and np.array_equal(npa.numpy(), source[label][2]["np"])
                seen.add(label)
        assert seen == set(range(96))
        stats = ds.stats  # summed over the workers
        assert stats.misses == 96 and stats.hits == 96 * epoch, (epoch, stats)
    # This dataset's keys only: a store of an earlier test on the same cluster may still flush its write buffer.
    assert sum(1 for c in cluster_store.nodes.primaries() for _ in c.scan_iter(match="dl:*")) == 96
    assert stats.bytes_read > 0 and stats.bytes_written >= stats.bytes_read


def test_getitems_reads_a_batch_in_one_call_and_uses_the_sources_getitems(redis_cluster3: ClusterInfo,
                                                                           cluster_store: RedisStore) -> None:
    class Batched(Source):
        calls: list[list[int]] = []

        def __getitems__(self, indices: list[int]) -> list[Any]:
            self.calls.append(list(indices))
            return [self[i] for i in indices]

    source = Batched(32)
    ds = CachedDataset(source, dataset_name="gi", hosts=redis_cluster3.hosts)
    ds.__getitems__([0, 1, 2, 3])
    batch = ds.__getitems__([3, 4, 0, 5])
    assert source.calls == [[0, 1, 2, 3], [4, 5]]  # only the misses, in one call
    assert [b[1] for b in batch] == [3, 4, 0, 5]


def test_second_job_in_a_fresh_process_reuses_the_cache(cluster_store: RedisStore,
                                                        redis_cluster3: ClusterInfo) -> None:
    first = CachedDataset(Source(24, seed=3), dataset_name="reuse", version="v1", hosts=redis_cluster3.hosts)
    first.__getitems__(list(range(24)))
    first.flush()
    out = subprocess.run(
        [sys.executable, "-m", "tests.client.cache_datasets", "second_job", redis_cluster3.hosts_string,
         "reuse", "v1", "24", "3"], cwd=REPO, env=CHILD_ENV, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"loads": 0, "hits": 24, "misses": 0}


def test_version_change_never_serves_a_stale_sample(cluster_store: RedisStore,
                                                    redis_cluster3: ClusterInfo) -> None:
    old = CachedDataset(Source(16, seed=1), dataset_name="ver", version="1", hosts=redis_cluster3.hosts)
    old.__getitems__(list(range(16)))
    changed = Source(16, seed=2)
    new = CachedDataset(changed, dataset_name="ver", version="2", hosts=redis_cluster3.hosts)
    for i in range(16):
        assert same_sample(new[i], Source(16, seed=2)[i])
    assert new.stats.hits == 0 and changed.loads == 16


def test_corrupted_entry_is_reloaded_rewritten_and_counted(cluster_store: RedisStore,
                                                           redis_cluster3: ClusterInfo) -> None:
    ds = CachedDataset(Source(8), dataset_name="bad", version="1", writer_buffer_size=1,
                       hosts=redis_cluster3.hosts)
    ds.__getitems__(list(range(8)))
    key = ds.cache_loader.redis_key(5)
    raw = bytearray(cluster_store.get(key) or b"")
    raw[-1] ^= 0xFF
    cluster_store.set(key, bytes(raw))
    cluster_store.set(ds.cache_loader.redis_key(6), b"not an entry")
    batch = ds.__getitems__(list(range(8)))
    assert all(same_sample(b, Source(8)[i]) for i, b in enumerate(batch))
    stats = ds.stats
    assert stats.corrupt == 2 and stats.hits == 6 and stats.misses == 10
    codec.decode(cluster_store.get(key) or b"", key.encode())  # rewritten with a valid entry
    ds.__getitems__([5, 6])
    assert ds.stats.hits == 8


def test_non_serializable_sample_raises_the_clear_type_error(redis_cluster3: ClusterInfo) -> None:
    ds = CachedDataset(Unstorable(), dataset_name="unstorable", hosts=redis_cluster3.hosts)
    with pytest.raises(TypeError, match=r"cannot store the sample\['value'\] of type builtins.set.*"
                                        r'serializer="pickle"'):
        ds[0]


def test_pickle_serializer_is_opt_in_and_warns(cluster_store: RedisStore, redis_cluster3: ClusterInfo) -> None:
    with pytest.warns(UserWarning, match="run code"):
        ds = CachedDataset(Unstorable(), dataset_name="pickled", serializer="pickle", hosts=redis_cluster3.hosts,
                           writer_buffer_size=1)
    assert ds[1] == {"value": {1}} and ds[1] == {"value": {1}} and ds.stats.hits == 1
    safe = CachedDataset(Source(4), dataset_name="pickled", version="n4", hosts=redis_cluster3.hosts)
    with pytest.raises(TypeError):  # a safe reader never unpickles: the entry is a miss, then a TypeError
        CachedDataset(Unstorable(), dataset_name="pickled", hosts=redis_cluster3.hosts)[1]
    assert safe.stats.hits == 0


def test_buffered_writes_are_flushed_at_process_exit(cluster_store: RedisStore,
                                                     redis_cluster3: ClusterInfo) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.client.cache_datasets", "write_and_exit", redis_cluster3.hosts_string,
         "atexit", "12"], cwd=REPO, env=CHILD_ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"pending": 12}
    assert cluster_store.num_keys() == 12


def test_cache_loader_api(cluster_store: RedisStore, redis_cluster3: ClusterInfo) -> None:
    loader = CacheLoader(backend="redis", hosts=redis_cluster3.hosts, cluster_mode=True, dataset_name="test")
    calls: list[str] = []
    assert loader.get("a", lambda k: calls.append(k) or f"value-{k}") == "value-a"
    assert loader.get("a", lambda k: calls.append(k) or "other") == "value-a"
    assert calls == ["a"] and loader.num_keys() == 1 and loader.redis_key("a") == "test:0:a"
    with pytest.raises(ValueError, match="backend='lmdb' is not supported"):
        CacheLoader(backend="lmdb")
    with pytest.raises(TypeError, match="dataset_name=3 is a int"):
        CacheLoader(dataset_name=3, hosts=redis_cluster3.hosts)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="writer_buffer_size=0"):
        CacheLoader(writer_buffer_size=0, hosts=redis_cluster3.hosts)


def test_catalog_and_cache_cli(cluster_store: RedisStore, redis_cluster3: ClusterInfo,
                               capsys: pytest.CaptureFixture[str]) -> None:
    for version in ("1", "2"):
        ds = CachedDataset(Source(10), dataset_name="cat", version=version, hosts=redis_cluster3.hosts)
        ds.__getitems__(list(range(10)))
        ds.__getitems__(list(range(10)))  # hits are not counted twice in the catalog
    hosts = ["--hosts", redis_cluster3.hosts_string]
    assert cli_main(["cache", "ls", "--json", *hosts]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["name"], e["version"], e["samples"]) for e in listed] == [("cat", "1", 10), ("cat", "2", 10)]
    assert all(e["bytes"] > 0 and e["created"] > 0 for e in listed)
    assert cli_main(["cache", "rm", "cat:1", *hosts]) == 0
    assert "deleted 10 entries" in capsys.readouterr().out
    assert cluster_store.num_keys() == 10
    assert cli_main(["cache", "rm", "cat", *hosts]) == 0
    assert cluster_store.num_keys() == 0
    assert cli_main(["cache", "ls", *hosts]) == 0
    assert "no cached datasets" in capsys.readouterr().out
    assert cli_main(["cache", "rm", "never{cached}", *hosts]) == 0
    assert "deleted 0 entries" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["my data", "ds:v1", "données/ü", "{tag}*?[x]%", ""])
def test_any_string_is_a_dataset_name(cluster_store: RedisStore, redis_cluster3: ClusterInfo, name: str) -> None:
    ds = CachedDataset(Source(4), dataset_name=name, version="v:1", hosts=redis_cluster3.hosts)
    first = ds.__getitems__([0, 1, 2, 3])
    again = CachedDataset(Source(4), dataset_name=name, version="v:1", hosts=redis_cluster3.hosts)
    second = again.__getitems__([0, 1, 2, 3])
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(first, second, strict=True))
    assert again.stats.hits == 4 and again.stats.misses == 0
    other = CachedDataset(Source(4), dataset_name=name + "x", version="v:1", hosts=redis_cluster3.hosts)
    other.__getitems__([0])
    other.flush()
    assert other.stats.misses == 1  # a different name never shares entries
    listed = [(e.name, e.version, e.samples) for e in catalog.list_datasets(cluster_store)]
    assert (name, "v:1", 4) in listed
    assert catalog.remove_dataset(cluster_store, name) == 4
    assert cluster_store.num_keys() == 1  # only the other dataset's entry is left


def test_store_keys_follow_the_documented_layout(cluster_store: RedisStore, redis_cluster3: ClusterInfo) -> None:
    ds = CachedDataset(Source(3), dataset_name="layout", version="7", hosts=redis_cluster3.hosts)
    ds.__getitems__([0, 1, 2])
    keys = sorted(k.decode() for c in cluster_store.nodes.primaries() for k in c.scan_iter(match="layout:*"))
    assert keys == ["layout:7:0", "layout:7:1", "layout:7:2"]
    assert CacheLoader(dataset_name="my data", version="ds:v1", hosts=redis_cluster3.hosts).redis_key(5) == \
        "my%20data:ds%3Av1:5"
    with redis.RedisCluster(host=redis_cluster3.nodes[0].host, port=redis_cluster3.nodes[0].port) as rc:
        assert len({rc.keyslot(k) for k in keys}) == 3  # no hash tag: a dataset spreads over every master
