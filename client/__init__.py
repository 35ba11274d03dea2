"""Trainer side clients: the autotune gRPC client and the Redis sample cache."""
