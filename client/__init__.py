"""Trainer side clients: the autotune gRPC client and the Redis sample cache."""

from bagua_lightning.client.autotune import AutotuneClient as AutotuneClient
