"""Service side: the autotune gRPC server and local Redis tooling (no torch imports here)."""
