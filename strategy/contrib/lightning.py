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

import lightning
import torch
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from ...engine.contrib.load_balancing import LoadBalancingDistributedBatchSampler
from ...engine.contrib.sync_batchnorm import SyncBatchNorm

__all__ = ["BaguaSyncBatchNorm", "adapt_trainer", "missing_internals"]

_LOADERS_LOST = "loaders on a LoadBalancingDistributedBatchSampler get Lightning's DistributedSampler instead"
# Lightning's private attributes this module uses: (whose, name, what a user loses without it). Lightning may
# rename them in any release; setup checks each and warns instead of silently doing nothing.
_INTERNALS = (
    ("strategy", "_layer_sync", "Trainer(sync_batchnorm=True) keeps torch's SyncBatchNorm, which refuses CPU tensors"),
    ("trainer", "_data_connector", _LOADERS_LOST),
    ("trainer._data_connector", "_requires_distributed_sampler", _LOADERS_LOST),
)


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


def missing_internals(strategy: Any, trainer: Any) -> list[str]:
    """The Lightning private attributes this module needs that ``strategy``/``trainer`` lack, each as
    ``"whose.name: what is lost"`` (empty on the Lightning versions this package supports)."""
    owners = {"strategy": strategy}
    if trainer is not None:
        owners["trainer"] = trainer
        connector = getattr(trainer, "_data_connector", None)
        if connector is not None:
            owners["trainer._data_connector"] = connector
    return [f"{whose}.{name}: {lost}" for whose, name, lost in _INTERNALS
            if whose in owners and not hasattr(owners[whose], name)]


def adapt_trainer(strategy: Any, trainer: Any) -> None:
    """Swap in our batch-norm sync and keep load-balancing loaders (called once the trainer is known).

    Warns, naming the Lightning version, for each private attribute that this Lightning does not have.
    """
    for item in missing_internals(strategy, trainer):
        attribute, lost = item.split(": ", 1)
        rank_zero_warn(f"BaguaStrategy uses Lightning's private attribute {attribute}, which Lightning "
                       f"{lightning.__version__} does not have, so {lost}. Please report this with your "
                       "Lightning version.")
    if isinstance(getattr(strategy, "_layer_sync", None), TorchSyncBatchNorm):
        strategy._layer_sync = BaguaSyncBatchNorm()
    if trainer is not None:
        _keep_load_balancing_loaders(trainer)
