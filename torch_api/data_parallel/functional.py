"""Bagua's ``data_parallel.functional``: an autograd-aware allreduce over a torch process group.

``all_reduce(tensor, op, group)`` returns the reduction of ``tensor`` over ``group`` (a torch
``ProcessGroup``, default ``dist.group.WORLD``) through the group's Bagua communicator; the gradient of
the result is the same reduction of the incoming gradient, as in Bagua. Only ``SUM`` and ``MAX`` are
accepted, as there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from .._ops import ReduceOp

__all__ = ["ReduceOp", "all_reduce", "torch_reduce_op_to_bagua"]


def torch_reduce_op_to_bagua(op: Any) -> ReduceOp:
    """The Bagua :class:`ReduceOp` of ``torch.distributed.ReduceOp.SUM`` or ``MAX``."""
    if op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if op == dist.ReduceOp.MAX:
        return ReduceOp.MAX
    raise ValueError(f"op={op!r} is not supported here; use torch.distributed.ReduceOp.SUM or MAX")


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over every rank of ``group`` with ``op``; returns the result (``tensor`` is kept).

    Args:
        tensor: Input of the collective.
        op: ``torch.distributed.ReduceOp.SUM`` or ``MAX``.
        group: The torch process group (None: ``dist.group.WORLD``).

    Returns:
        The reduced tensor, identical on every rank; differentiable.
    """
    if group is None:
        group = dist.group.WORLD
    torch_reduce_op_to_bagua(op)  # a clear error before any communication
    return _AllReduce.apply(op, group, tensor)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx: Any, op: Any, group: Any, tensor: torch.Tensor) -> torch.Tensor:
        from ..communication import allreduce_inplace

        ctx.group, ctx.op = group, op
        out = tensor.detach().clone()
        allreduce_inplace(out, torch_reduce_op_to_bagua(op), group.bagua_patch().bagua_get_global_communicator())
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, _AllReduce.apply(ctx.op, ctx.group, grad_output))
