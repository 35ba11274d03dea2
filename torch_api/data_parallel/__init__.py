"""Bagua's ``data_parallel``: a DDP-shaped wrapper over ``with_bagua``."""

from __future__ import annotations

from . import functional
from .distributed import DistributedDataParallel, DistributedDataParallel_V1_9_0, to_bagua_process_group

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0", "functional", "to_bagua_process_group"]
