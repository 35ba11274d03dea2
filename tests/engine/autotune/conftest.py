"""The autotune service fixtures (a real server as its own OS process), shared with ``tests/services/``."""

from tests.services.conftest import shared_service, start_service

__all__ = ["shared_service", "start_service"]
