"""Trainer side clients: the autotune gRPC client and the Redis sample cache."""

from typing import TYPE_CHECKING, Any

from bagua_lightning.client.autotune import AutotuneClient as AutotuneClient
from bagua_lightning.client.cache import CacheLoader as CacheLoader
from bagua_lightning.client.cache import RedisStore as RedisStore

if TYPE_CHECKING:
    from bagua_lightning.client.cache.dataset import CachedDataset as CachedDataset


def __getattr__(name: str) -> Any:
    # CachedDataset imports torch.utils.data; keep `import bagua_lightning.client` torch-free for the CLI.
    if name == "CachedDataset":
        from bagua_lightning.client.cache.dataset import CachedDataset

        return CachedDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
