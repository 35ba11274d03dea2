"""``MoE``: the layer a model uses (gate + sharded experts + output dropout)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .experts import Experts
from .sharded_moe import NOISY_GATE_POLICIES, MOELayer, TopKGate

__all__ = ["MoE"]


class MoE(torch.nn.Module):
    """A mixture-of-experts layer whose experts are sharded over the ranks of the default process group.

    Args:
        hidden_size: Token width, the layer's input and output size.
        expert: The expert module (e.g. an MLP ``hidden_size -> ... -> hidden_size``); each rank holds
            ``num_local_experts`` copies, ``world_size * num_local_experts`` experts in all.
        num_local_experts: Experts per rank.
        k: Top-k gating, 1 or 2.
        output_dropout_prob: Dropout on the output.
        capacity_factor: Expert capacity as a multiple of ``tokens / experts``, in training.
        eval_capacity_factor: The same in eval mode.
        min_capacity: Smallest capacity per expert.
        noisy_gate_policy: None, ``"Jitter"`` or ``"RSample"``.
        group: The ranks to shard experts over; default: all of them.

    Raises:
        ValueError: ``k`` not 1 or 2, or an unknown ``noisy_gate_policy``.

    The experts' parameters are marked ``expert = True`` (:func:`is_moe_param`): data-parallel training
    (``with_bagua``, ``BaguaStrategy``) leaves them out of gradient averaging and of the start-up broadcast.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: torch.nn.Module,
        num_local_experts: int = 1,
        k: int = 1,
        output_dropout_prob: float = 0.0,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        noisy_gate_policy: str | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}.")
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.num_experts = num_local_experts * world
        gate = TopKGate(hidden_size, self.num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy)
        # The attribute name keeps checkpoints interchangeable with Bagua's.
        self.deepspeed_moe = MOELayer(gate, Experts(expert, num_local_experts), num_local_experts, group=group)
        self.dropout = torch.nn.Dropout(output_dropout_prob)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``hidden_states`` (``(..., hidden_size)``) through the experts.

        Args:
            hidden_states: The tokens.
            used_token: Optional ``(tokens,)`` mask; tokens with 0 go to no expert (output 0).

        Returns:
            ``(output, l_aux, exp_counts)``: the output (same shape as the input), the load-balancing loss
            to add to the training loss, and how many tokens chose each expert.
        """
        output = self.dropout(self.deepspeed_moe(hidden_states, used_token))
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts  # type: ignore[return-value]
