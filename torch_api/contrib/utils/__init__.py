"""Bagua's ``bagua.torch_api.contrib.utils``: the key-value stores behind the sample cache."""

__all__ = ["redis_store", "store"]
