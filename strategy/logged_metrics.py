"""What ``BaguaStrategy`` logs through Lightning's loggers besides the autotune boundaries.

Plain functions, no Lightning: :func:`cached_datasets` finds every ``CachedDataset``
behind a train dataloader (through ``Subset``/``ConcatDataset`` wrappers and
collections of loaders), :func:`training_metrics` turns the plan in use and the
caches' counters into the flat numbers a logger takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..proto.plan import BucketPlan

_MAX_DEPTH = 8  # wrappers followed from a loader down to a dataset


def _loaders(obj: Any, depth: int = 0) -> Iterator[Any]:
    """The loaders in ``obj``: itself, or the values of a list/tuple/dict of them (Lightning's iterables)."""
    if depth <= _MAX_DEPTH and isinstance(obj, Mapping):
        for value in obj.values():
            yield from _loaders(value, depth + 1)
    elif depth <= _MAX_DEPTH and isinstance(obj, list | tuple):
        for value in obj:
            yield from _loaders(value, depth + 1)
    elif obj is not None:
        yield obj


def _datasets(obj: Any, depth: int = 0) -> Iterator[Any]:
    """``obj`` and what it wraps: a DataLoader's dataset, a Subset's, a ConcatDataset's or ChainDataset's
    parts (never the elements of a dataset that is itself a list)."""
    from torch.utils.data import ChainDataset, ConcatDataset, DataLoader, Subset

    if depth > _MAX_DEPTH:
        return
    yield obj
    if isinstance(obj, DataLoader | Subset):
        yield from _datasets(obj.dataset, depth + 1)
    elif isinstance(obj, ConcatDataset | ChainDataset):
        for part in obj.datasets:
            yield from _datasets(part, depth + 1)


def cached_datasets(loaders: Any) -> list[Any]:
    """Every distinct ``CachedDataset`` behind ``loaders`` (a DataLoader or a collection of them)."""
    from ..client.cache.dataset import CachedDataset

    found: dict[int, Any] = {}
    for loader in _loaders(loaders):
        for obj in _datasets(loader):
            if isinstance(obj, CachedDataset):
                found.setdefault(id(obj), obj)
    return list(found.values())


def training_metrics(plan: BucketPlan | None, plan_version: int | None, caches: Iterable[Any]) -> dict[str, float]:
    """``bagua/plan_version`` and ``bagua/num_buckets`` of the plan in use (when there is one) and, over
    every cache, ``cache/hit_rate``, ``cache/hits`` and ``cache/misses`` (this process and its loader
    workers, since the caches were created)."""
    out: dict[str, float] = {}
    if plan is not None:
        out["bagua/plan_version"] = float(plan.version if plan_version is None else plan_version)
        out["bagua/num_buckets"] = float(len(plan.buckets))
    hits = misses = 0
    any_cache = False
    for cache in caches:
        stats = cache.stats
        hits, misses, any_cache = hits + stats.hits, misses + stats.misses, True
    if any_cache:
        out["cache/hits"] = float(hits)
        out["cache/misses"] = float(misses)
        out["cache/hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
    return out
