"""Bagua's ``bagua.torch_api.contrib.cached_dataset``: :class:`CachedDataset`.

``CachedDataset(dataset, backend="redis", dataset_name="", writer_buffer_size=20, **kwargs)`` wraps a
map-style dataset and caches its samples in a key-value store (see
:class:`bagua_lightning.client.cache.dataset.CachedDataset` for the key layout, the safe codec and the extra
keyword arguments); ``cached_dataset.cache_loader`` is its :class:`~.cache_loader.CacheLoader`.
"""

from ...client.cache.dataset import CachedDataset

__all__ = ["CachedDataset"]
