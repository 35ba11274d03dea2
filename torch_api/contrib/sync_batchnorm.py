"""Bagua's ``bagua.torch_api.contrib.sync_batchnorm`` (implementation: ``strategy/contrib/sync_batchnorm.py``)."""

from ...strategy.contrib.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
