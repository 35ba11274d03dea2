"""Trainer side clients: the autotune gRPC client and the Redis sample cache."""

from typing import TYPE_CHECKING, Any

from .cache import CacheLoader as CacheLoader
from .cache import ClusterStore as ClusterStore
from .cache import RedisStore as RedisStore
from .cache import Store as Store

if TYPE_CHECKING:
    from .autotune import AutotuneClient as AutotuneClient
    from .cache.dataset import CachedDataset as CachedDataset


def __dir__() -> list[str]:
    return sorted({*globals(), "AutotuneClient", "CachedDataset"})


def __getattr__(name: str) -> Any:
    # CachedDataset imports torch.utils.data; keep `import bagua_lightning.client` torch-free for the CLI.
    if name == "CachedDataset":
        from .cache.dataset import CachedDataset

        return CachedDataset
    # AutotuneClient imports grpc and the generated messages (~0.2 s): not for every rank that only caches.
    if name == "AutotuneClient":
        from .autotune import AutotuneClient

        return AutotuneClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
