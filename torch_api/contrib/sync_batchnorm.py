"""Bagua's ``bagua.torch_api.contrib.sync_batchnorm`` (implementation: ``engine/contrib/sync_batchnorm.py``)."""

from ...engine.contrib.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
