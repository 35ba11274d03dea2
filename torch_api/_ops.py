"""Reduction operators and the local pieces of the collectives that a backend lacks.

Which reductions each backend runs natively (the rest are emulated, see ``docs/torch_api_comm.md``):

- NCCL: SUM, PRODUCT, MIN, MAX, AVG. Bitwise BAND/BOR/BXOR: allgather, then reduce locally.
- Gloo: SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR. AVG: SUM, then divide by the number of ranks
  (Gloo has no AVG before torch 2.6).
"""

from __future__ import annotations

import functools
from enum import IntEnum

import torch
import torch.distributed as dist

from ..core.errors import ConfigurationError

__all__ = ["ReduceOp", "all_gather_single", "as_reduce_op", "divide_", "native_op", "reduce_rows"]

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older releases lack the new name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ReduceOp(IntEnum):
    """Reductions (Bagua's values): ``SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BOR``, ``BAND``, ``BXOR``, ``AVG``."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}


def as_reduce_op(op: object) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` (a ReduceOp, or its integer value); a ValueError naming it otherwise."""
    if isinstance(op, int) and not isinstance(op, bool) and op in ReduceOp._value2member_map_:
        return ReduceOp(op)
    raise ValueError(f"op={op!r} is not a ReduceOp; use one of {[o.name for o in ReduceOp]}")


def check_op_dtype(op: ReduceOp, tensor: torch.Tensor) -> None:
    """Bitwise reductions need integer or bool tensors (a ValueError naming the dtype otherwise)."""
    if op in _BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"ReduceOp.{op.name} needs an integer or bool tensor, got {tensor.dtype}")


def native_op(op: ReduceOp, backend: str) -> dist.ReduceOp.RedOpType | None:
    """The torch reduction that runs ``op`` on ``backend`` in one collective, or None to emulate it.

    AVG on Gloo maps to SUM (the caller divides after): :func:`divide_`.
    """
    if op is ReduceOp.AVG:
        return dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM
    if op in _BITWISE and backend == "nccl":
        return None
    return _TORCH_OPS[op]


def divide_(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """``tensor /= n`` in place; integers truncate toward zero, as NCCL's AVG does."""
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(n)
    if tensor.dtype == torch.bool:
        raise ConfigurationError("ReduceOp.AVG is not defined for bool tensors; use SUM, MIN, MAX or a bitwise op")
    return tensor.div_(n, rounding_mode="trunc")


def reduce_rows(rows: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Reduce ``rows`` (one row per rank, shape ``(n, ...)``) along dim 0 with ``op``, keeping the dtype."""
    n = rows.shape[0]
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        out = rows.sum(0, dtype=rows.dtype) if rows.dtype != torch.bool else rows.any(0)
        return divide_(out, n) if op is ReduceOp.AVG else out
    if op is ReduceOp.PRODUCT:
        return rows.prod(0, dtype=rows.dtype) if rows.dtype != torch.bool else rows.all(0)
    if op is ReduceOp.MIN:
        return rows.amin(0)
    if op is ReduceOp.MAX:
        return rows.amax(0)
    fn = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(fn, rows.unbind(0))
