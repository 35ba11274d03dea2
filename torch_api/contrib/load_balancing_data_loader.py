"""Bagua's ``bagua.torch_api.contrib.load_balancing_data_loader`` (implementation: ``engine/contrib/load_balancing.py``)."""

from ...engine.contrib.load_balancing import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
