"""The CLI's environment fixture (a private state folder), shared with ``tests/services/``."""

from tests.services.conftest import env

__all__ = ["env"]
