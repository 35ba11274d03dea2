"""What ``BaguaStrategy`` does for the contrib pieces inside a Lightning ``Trainer``.

- ``Trainer(sync_batchnorm=True)`` converts ``BatchNorm`` layers with torch's ``SyncBatchNorm``, which
  refuses CPU tensors: under ``BaguaStrategy`` they become our :class:`SyncBatchNorm` (Gloo and NCCL).
- With ``use_distributed_sampler=True`` Lightning swaps a loader's sampler for a ``DistributedSampler``
  unless it already is one. Our ``LoadBalancingDistributedSampler`` is one; a loader built with
  ``batch_sampler=LoadBalancingDistributedBatchSampler(...)`` is not, and Lightning cannot rebuild our batch
  sampler around a new sampler: such loaders are left as they are.

Imports Lightning: only the strategy imports this module.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from ...engine.contrib.load_balancing import LoadBalancingDistributedBatchSampler
from ...engine.contrib.sync_batchnorm import SyncBatchNorm

__all__ = ["BaguaSyncBatchNorm", "adapt_trainer"]


class _BatchNormXd(_BatchNorm):
    """A plain ``BatchNorm`` for any input ``(N, C, ...)``: what :meth:`BaguaSyncBatchNorm.revert` gives back."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"BatchNorm expects an input of shape (N, C, ...), got {input.dim()}D input.")


class BaguaSyncBatchNorm(LayerSync):
    """Lightning's layer-sync plugin with our :class:`SyncBatchNorm` (CPU and GPU)."""

    @override
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``model`` with a :class:`SyncBatchNorm`."""
        return SyncBatchNorm.convert_sync_batchnorm(model)

    @override
    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Replace every :class:`SyncBatchNorm` in ``model`` with a plain batch norm (same state)."""
        out = model
        if isinstance(model, SyncBatchNorm):
            out = _BatchNormXd(model.num_features, model.eps, model.momentum, model.affine,
                               model.track_running_stats)
            if model.affine:
                out.weight = model.weight
                out.bias = model.bias
            out.running_mean = model.running_mean
            out.running_var = model.running_var
            out.num_batches_tracked = model.num_batches_tracked
            out.training = model.training
        for name, child in model.named_children():
            out.add_module(name, self.revert(child))
        return out


def _keep_load_balancing_loaders(trainer: Any) -> None:
    connector = getattr(trainer, "_data_connector", None)
    original = getattr(connector, "_requires_distributed_sampler", None)
    if original is None or getattr(original, "_keeps_load_balancing", False):
        return

    def requires_distributed_sampler(dataloader: Any) -> bool:
        if isinstance(getattr(dataloader, "batch_sampler", None), LoadBalancingDistributedBatchSampler):
            return False
        return bool(original(dataloader))

    requires_distributed_sampler._keeps_load_balancing = True  # type: ignore[attr-defined]
    connector._requires_distributed_sampler = requires_distributed_sampler  # type: ignore[union-attr]


def adapt_trainer(strategy: Any, trainer: Any) -> None:
    """Swap in our batch-norm sync and keep load-balancing loaders (called once the trainer is known)."""
    if isinstance(getattr(strategy, "_layer_sync", None), TorchSyncBatchNorm):
        strategy._layer_sync = BaguaSyncBatchNorm()
    if trainer is not None:
        _keep_load_balancing_loaders(trainer)
