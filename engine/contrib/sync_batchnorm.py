"""Batch normalisation with statistics over every rank's batch, on NCCL (GPU) and on Gloo (CPU).

``torch.nn.SyncBatchNorm`` refuses CPU tensors; this one runs on both. Forward: every rank computes its
per-channel mean and biased variance, one ``all_gather`` of ``[mean, var, count]`` gives every rank the
statistics of the whole batch (combined by counts, so uneven and empty local batches are exact). Backward:
one ``all_reduce`` of the per-channel sums of ``dy`` and ``dy * (x - mean)`` gives the input gradient of
the whole batch; weight and bias gradients stay local (the data-parallel exchange averages them, as it
does for any parameter).

On CUDA the statistics and element-wise steps are torch's own batch-norm kernels (those
``torch.nn.SyncBatchNorm`` uses); on CPU the same arithmetic in torch ops, accumulated in float32 or wider.
The collectives run on the default process group (or ``process_group``) from forward and backward; the
engine's background communication uses groups of its own, so they never interleave.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``all_gather`` of one tensor per rank, stacked on a new first dimension."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: Any,
    ) -> torch.Tensor:
        x = x.contiguous()
        c = x.shape[1]
        count = x.numel() // c if c else 0
        if x.is_cuda:
            if count > 0:
                mean, invstd = torch.batch_norm_stats(x, eps)
            else:
                mean = torch.zeros(c, device=x.device, dtype=torch.float32)
                invstd = torch.ones(c, device=x.device, dtype=torch.float32)
            packed = torch.cat([mean, invstd, torch.full((1,), float(count), device=x.device, dtype=mean.dtype)])
            gathered = _gather(packed, group)
            means, invstds, counts = gathered[:, :c], gathered[:, c : 2 * c], gathered[:, 2 * c]
            keep = counts > 0  # ranks with an empty batch carry no statistics
            means, invstds, counts = means[keep], invstds[keep], counts[keep]
            mean, invstd = torch.batch_norm_gather_stats_with_counts(
                x, means, invstds, running_mean, running_var, momentum, eps, counts
            )
            total = counts.sum()
            y = torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)
        else:
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            xa = x.to(acc)
            dims = _reduce_dims(x)
            if count > 0:
                local_mean = xa.mean(dims)
                local_var = xa.var(dims, unbiased=False)
            else:
                local_mean = torch.zeros(c, dtype=acc)
                local_var = torch.zeros(c, dtype=acc)
            packed = torch.cat([local_mean, local_var, torch.full((1,), float(count), dtype=acc)])
            gathered = _gather(packed, group)
            means, variances, counts = gathered[:, :c], gathered[:, c : 2 * c], gathered[:, 2 * c : 2 * c + 1]
            total = counts.sum()
            if total <= 0:
                raise ValueError("SyncBatchNorm got an empty batch on every rank; it needs at least one value.")
            mean = (means * counts).sum(0) / total
            var = ((variances + (means - mean) ** 2) * counts).sum(0) / total
            invstd = torch.rsqrt(var + eps)
            if running_mean is not None and running_var is not None:
                unbiased = var * (total / (total - 1)) if total > 1 else var
                with torch.no_grad():
                    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
            shape = [1, c] + [1] * (x.dim() - 2)
            ya = (xa - mean.view(shape)) * invstd.view(shape)
            if weight is not None:
                ya = ya * weight.to(acc).view(shape)
            if bias is not None:
                ya = ya + bias.to(acc).view(shape)
            y = ya.to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.group = group
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dy = dy.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        c = x.shape[1]
        grad_x = grad_w = grad_b = None
        if x.is_cuda:
            if x.numel() > 0:
                sum_dy, sum_dy_xmu, grad_w, grad_b = torch.batch_norm_backward_reduce(
                    dy, x, mean, invstd, weight, need_x, need_w, need_b
                )
            else:
                sum_dy = torch.zeros(c, device=x.device, dtype=mean.dtype)
                sum_dy_xmu = torch.zeros_like(sum_dy)
                grad_w = torch.zeros_like(weight) if need_w and weight is not None else None
                grad_b = torch.zeros_like(weight) if need_b and weight is not None else None
            if need_x:
                sums = torch.cat([sum_dy, sum_dy_xmu])
                dist.all_reduce(sums, group=ctx.group)
                sum_dy, sum_dy_xmu = sums[:c], sums[c:]
                if x.numel() > 0:
                    count = torch.full((1,), int(ctx.total.item()), device=x.device, dtype=torch.int32)
                    grad_x = torch.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
                else:
                    grad_x = torch.zeros_like(x)
        else:
            acc = mean.dtype
            dims = _reduce_dims(x)
            shape = [1, c] + [1] * (x.dim() - 2)
            dya = dy.to(acc)
            xmu = x.to(acc) - mean.view(shape)
            sum_dy = dya.sum(dims) if x.numel() > 0 else torch.zeros(c, dtype=acc)
            sum_dy_xmu = (dya * xmu).sum(dims) if x.numel() > 0 else torch.zeros(c, dtype=acc)
            if need_w and weight is not None:
                grad_w = (sum_dy_xmu * invstd).to(weight.dtype)
            if need_b and ctx.has_bias:
                grad_b = sum_dy.to(weight.dtype if weight is not None else x.dtype)
            if need_x:
                sums = torch.cat([sum_dy, sum_dy_xmu])
                dist.all_reduce(sums, group=ctx.group)
                mean_dy = (sums[:c] / ctx.total).view(shape)
                mean_dy_xmu = (sums[c:] / ctx.total).view(shape)
                scale = invstd.view(shape)
                if weight is not None:
                    scale = scale * weight.to(acc).view(shape)
                gx = (dya - mean_dy - xmu * (invstd.view(shape) ** 2) * mean_dy_xmu) * scale
                grad_x = gx.to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``BatchNorm`` over the batches of every rank, for any input ``(N, C, ...)``, on GPU and CPU.

    Args:
        num_features: ``C``, the number of channels.
        eps: Added to the variance for numerical stability.
        momentum: Weight of the new batch in the running statistics; ``None``: a cumulative average.
        affine: Learnable per-channel weight and bias.
        track_running_stats: Keep running mean and variance (used in eval mode).
        process_group: The ranks whose batches are normalised together; default: all of them.

    Outside training mode, or without an initialised process group of more than one rank, it is a plain
    ``BatchNorm``. Convert a model's ``BatchNorm*d`` layers with :meth:`convert_sync_batchnorm` before
    wrapping it for data-parallel training (``with_bagua`` or ``BaguaStrategy``).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()}D input.")

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return int(dist.get_world_size(self.process_group))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with the statistics of every rank's batch (training) or the running ones."""
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} channels.")
        factor = 0.0 if self.momentum is None else float(self.momentum)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else float(self.momentum)
        use_batch_stats = self.training or self.running_mean is None
        running_mean = self.running_mean if (not self.training or self.track_running_stats) else None
        running_var = self.running_var if (not self.training or self.track_running_stats) else None
        if not (use_batch_stats and self.training and self._world_size() > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, use_batch_stats,
                                factor, self.eps)
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` (or ``module`` itself) with a :class:`SyncBatchNorm`.

        Parameters, running statistics, ``training`` and ``requires_grad`` carry over. Call it before
        ``with_bagua`` or before handing the model to a ``Trainer``.

        Args:
            module: A module holding ``BatchNorm*d`` layers (or one).
            process_group: Passed to every new layer.

        Returns:
            ``module`` with its layers replaced, or the new layer when ``module`` was one.
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      process_group)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out
