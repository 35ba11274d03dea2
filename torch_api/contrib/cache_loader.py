"""Bagua's ``bagua.torch_api.contrib.cache_loader``: :class:`CacheLoader`.

``CacheLoader(backend="redis", dataset_name="", writer_buffer_size=1, **kwargs)`` caches the values of an
expensive function by key: ``loader.get(key, load_fn)``, ``loader.num_keys()``. ``**kwargs`` go to
:class:`~.utils.redis_store.RedisStore` (``hosts``, ``cluster_mode``, ``capacity_per_node``, ...). See
:class:`bagua_lightning.client.cache.loader.CacheLoader`.
"""

from ...client.cache.loader import CacheLoader

__all__ = ["CacheLoader"]
