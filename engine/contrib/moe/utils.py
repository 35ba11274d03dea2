"""Marking expert parameters: they live on one rank each and are never averaged across ranks."""

from __future__ import annotations

import torch

__all__ = ["is_moe_param", "mark_expert_params"]


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert (``param.expert`` is true), as Bagua marks them.

    The data-parallel engine leaves such parameters out of gradient averaging and of the initial broadcast
    from rank 0: each rank holds different experts.
    """
    return bool(getattr(param, "expert", False))


def mark_expert_params(module: torch.nn.Module) -> None:
    """Mark every parameter of ``module`` as an expert parameter (``expert = True``, ``allreduce = False``)."""
    for p in module.parameters():
        p.expert = True  # type: ignore[attr-defined]
        p.allreduce = False  # type: ignore[attr-defined]
