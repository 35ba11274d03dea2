"""The experts a rank holds: ``num_local_experts`` copies of one expert module."""

from __future__ import annotations

import copy

import torch

from .utils import mark_expert_params

__all__ = ["Experts"]


class Experts(torch.nn.Module):
    """``num_local_experts`` independent copies of ``expert``; their parameters are marked as expert ones.

    Args:
        expert: The expert module, applied to ``(..., model_dim)`` tensors (an MLP, a ``Linear``, ...).
        num_local_experts: How many experts this rank holds.
    """

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1) -> None:
        super().__init__()
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts must be at least 1, got {num_local_experts}.")
        # The attribute name keeps checkpoints interchangeable with Bagua's.
        self.bagua_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        mark_expert_params(self)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Apply local expert ``i`` to ``inputs[:, i]`` for ``inputs`` of shape ``(ranks, local experts, C, M)``."""
        outputs = []
        for i, expert in enumerate(self.bagua_experts):
            out = expert(inputs[:, i : i + 1])
            if isinstance(out, tuple):  # an expert returning (output, bias): keep the output
                out = out[0]
            outputs.append(out)
        return torch.cat(outputs, dim=1)
