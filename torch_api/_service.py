"""Bagua's ``get_hyperparameters_service_client``: this process's client of the autotune service."""

from __future__ import annotations

import os
from functools import cache
from typing import Any

__all__ = ["get_hyperparameters_service_client"]


def get_hyperparameters_service_client() -> Any:
    """This process's client of the autotune service (one per process; a forked child makes its own).

    The service is the one ``BaguaStrategy(autotune=True)`` talks to: ``BAGUA_LIGHTNING_AUTOTUNE_SERVICE``
    (``host:port``), else ``MASTER_ADDR:BAGUA_SERVICE_PORT`` when Bagua's port variable is set, else the
    address ``bagua-lightning up`` recorded. Returns a
    :class:`bagua_lightning.client.autotune.AutotuneClient` (Bagua's ``register_tensors``,
    ``report_metrics``, ``ask_hyperparameters``, ``report_tensor_execution_order``).
    """
    from ..core.addresses import format_address
    from .env import get_bagua_service_port, get_master_addr

    address = None
    if not os.environ.get("BAGUA_LIGHTNING_AUTOTUNE_SERVICE") and get_bagua_service_port() > 0:
        address = format_address(get_master_addr(), get_bagua_service_port())
    return _service_client(os.getpid(), address)


@cache
def _service_client(pid: int, address: str | None) -> Any:
    # Keyed by pid: a gRPC channel does not survive fork, so a forked worker builds its own.
    del pid
    from ..client.autotune import AutotuneClient
    from ..core.services_file import resolve_autotune_address

    return AutotuneClient(target=resolve_autotune_address(address))
