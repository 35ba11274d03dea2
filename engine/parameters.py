"""What the engine communicates: the parameters, their declarations and the default bucket plan over them.

A parameter is communicated when it requires a gradient, is not a mixture-of-experts expert
(``param.expert = True``: each rank's own) and is named neither in the module's ignore list
(:data:`IGNORE_ATTRIBUTE`, Bagua's) nor among the parameters its latest forward left unused
(:data:`UNUSED_ATTRIBUTE`). The default plan (:func:`default_plan`) cuts Bagua-style at a bucket size, first
in reverse registration order (as DDP), then, after the first communicating backward, in the order gradients
became ready (rank 0's order, broadcast); :func:`check_plan` checks that a plan covers exactly the
parameters. The buckets built from a plan are :mod:`.buckets`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import PlanMismatchError
from ..proto.plan import DEFAULT_BUCKET_SIZE, BucketPlan, TensorDeclaration, split_into_buckets

if TYPE_CHECKING:  # pragma: no cover
    from .comm import CommContext

TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.uint8: "u8",
    torch.int64: "i64",
    torch.int32: "i32",
}


def declare(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[TensorDeclaration]:
    """Tensor declarations (name, numel, dtype) of ``named_params``, in the given order."""
    decls = []
    for name, p in named_params:
        if p.dtype not in TORCH_DTYPES:
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}, which buckets do not support")
        decls.append(TensorDeclaration(name=name, num_elements=p.numel(), dtype=TORCH_DTYPES[p.dtype]))
    return decls


#: Attribute of a module listing parameter and buffer names that are never communicated (Bagua's name).
IGNORE_ATTRIBUTE = "_bagua_params_and_buffers_to_ignore"
#: Attribute of a module naming the parameters its latest forward did not use (``find_unused_parameters``).
UNUSED_ATTRIBUTE = "_bagua_unused_parameters"


def is_communicated(name: str, tensor: torch.Tensor, ignore: Iterable[str] = ()) -> bool:
    """False for tensors data parallelism leaves alone: MoE experts (``tensor.expert``) and ignored names."""
    return not getattr(tensor, "expert", False) and name not in set(ignore)


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every communicated parameter that requires a gradient, in registration order.

    Left out: parameters marked ``param.expert = True`` (mixture-of-experts experts, each
    rank's own), names in ``module._bagua_params_and_buffers_to_ignore`` and the parameters
    ``find_unused_parameters`` found outside the forward's graph (``module._bagua_unused_parameters``).
    """
    ignore = set(getattr(module, IGNORE_ATTRIBUTE, None) or ()) | set(getattr(module, UNUSED_ATTRIBUTE, None) or ())
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and is_communicated(n, p, ignore)]


def average_module_parameters(module: nn.Module, comm: CommContext) -> None:
    """Replace every communicated parameter by its average over ``comm``'s group (in place): replicas that
    an algorithm let drift apart (decentralized, async) start the next algorithm identical."""
    if comm.world_size == 1:
        return
    with torch.no_grad():
        for _, p in trainable_parameters(module):
            dist.all_reduce(p.data, op=dist.ReduceOp.SUM, group=comm.group)
            p.data.div_(comm.world_size)


def default_plan(
    named_params: Sequence[tuple[str, torch.Tensor]],
    *,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    hierarchical: bool = False,
    order: Sequence[str] | None = None,
) -> BucketPlan:
    """Bagua's cut at ``bucket_size`` bytes.

    Args:
        named_params: the communicated tensors, in registration order.
        bucket_size: bytes at which a bucket closes.
        hierarchical: the plan's ``is_hierarchical_reduce``.
        order: names in gradient-ready order; names missing from it follow in
            reverse registration order. None: reverse registration order (DDP's first guess).
    """
    decls = {d.name: d for d in declare(named_params)}
    names = list(order or [])
    seen = set(names)
    unknown = seen - set(decls)
    if unknown:
        raise PlanMismatchError(f"gradient-ready order names unknown tensors {sorted(unknown)}")
    names += [n for n in reversed(list(decls)) if n not in seen]
    buckets = split_into_buckets([decls[n] for n in names], bucket_size)
    return BucketPlan(buckets=buckets, bucket_size=bucket_size, is_hierarchical_reduce=hierarchical)


def check_plan(plan: BucketPlan, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` covers exactly ``named_params`` with their sizes."""
    have = {d.name: d for d in declare(named_params)}
    planned = {t.name: t for bucket in plan.buckets for t in bucket}
    missing = sorted(set(have) - set(planned))
    extra = sorted(set(planned) - set(have))
    wrong = sorted(n for n in set(have) & set(planned) if have[n] != planned[n])
    if missing or extra or wrong:
        raise PlanMismatchError(
            f"bucket plan does not match the model: missing {missing}, unknown {extra}, "
            f"size/dtype differs for {wrong}; build it from the model's trainable parameters"
        )
