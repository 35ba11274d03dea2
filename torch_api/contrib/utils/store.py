"""Bagua's ``bagua.torch_api.contrib.utils.store``: :class:`Store` and :class:`ClusterStore`.

``Store`` is the interface of a key-value store of bytes (``set``, ``get``, ``mset``, ``mget``,
``num_keys``, ``clear``, ``status``, ``shutdown``); ``ClusterStore(stores)`` shards entries over several
stores by key.
"""

from ....client.cache.store import ClusterStore, Store

__all__ = ["ClusterStore", "Store"]
