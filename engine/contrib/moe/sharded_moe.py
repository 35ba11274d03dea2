"""GShard-style mixture of experts with the experts sharded over the ranks.

Each rank gates its own tokens over all ``E = ranks * local experts`` experts (top-1 or top-2, each expert
taking at most ``capacity`` tokens per rank), packs them into an ``(E, capacity, model_dim)`` buffer, and one
all-to-all sends expert ``e``'s slice to the rank that holds it (rank ``e // local``). The experts run on
``(ranks, local, capacity, model_dim)``; a second all-to-all brings the results home, where they are
combined with the gate weights. Backward runs the same two exchanges in reverse.

All-to-all: NCCL's ``all_to_all_single`` where the group is NCCL; Gloo has no all-to-all, so there it is
one batch of point-to-point ``isend``/``irecv`` pairs (each rank sends each peer exactly its slice, the
same bytes NCCL moves).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module

__all__ = [
    "MOELayer", "TopKGate", "all_to_all", "gumbel_rsample", "multiplicative_jitter", "top1gating", "top2gating",
]

Base = Module

# Samplers per device, built once (Bagua's module-level caches; the names are part of its API).
uniform_map: dict[torch.device, Callable[..., Tensor]] = {}
gumbel_map: dict[torch.device, Callable[..., Tensor]] = {}
exp_selection_uniform_map: dict[torch.device, Callable[..., Tensor]] = {}

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """``x`` times noise uniform in ``[1 - epsilon, 1 + epsilon]`` (Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    uniform = uniform_map.get(device)
    if uniform is None:
        uniform = torch.distributions.uniform.Uniform(
            torch.tensor(1.0 - epsilon, device=device), torch.tensor(1.0 + epsilon, device=device)
        ).rsample
        uniform_map[device] = uniform
    return x * uniform(x.shape)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel noise of ``shape`` on ``device``."""
    gumbel = gumbel_map.get(device)
    if gumbel is None:
        gumbel = torch.distributions.gumbel.Gumbel(
            torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
        ).rsample
        gumbel_map[device] = gumbel
    return gumbel(shape)


def _uniform(shape: torch.Size, device: torch.device) -> Tensor:
    uniform = exp_selection_uniform_map.get(device)
    if uniform is None:
        uniform = torch.distributions.uniform.Uniform(
            torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
        ).rsample
        exp_selection_uniform_map[device] = uniform
    return uniform(shape)


# ---------------------------------------------------------------------------------------------- all-to-all
def _exchange(x: Tensor, group: Any) -> Tensor:
    """Send ``x[j]`` to rank ``j`` of ``group``; ``out[j]`` is what rank ``j`` sent here."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.is_cuda and dist.get_backend(group) == "nccl":
        dist.all_to_all_single(out, x, group=group)
        return out
    me = dist.get_rank(group)
    out[me].copy_(x[me])
    ops = []
    for peer in range(world):
        if peer == me:
            continue
        peer_global = dist.get_global_rank(group, peer) if group is not None else peer
        ops.append(dist.P2POp(dist.isend, x[peer], peer_global, group))
        ops.append(dist.P2POp(dist.irecv, out[peer], peer_global, group))
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor) -> Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        # The exchange is its own inverse: slice j came from rank j, so its gradient goes back there.
        return None, _exchange(grad, ctx.group)


def all_to_all(x: Tensor, group: Any = None) -> Tensor:
    """Differentiable all-to-all over dimension 0 (size = ranks in ``group``), on NCCL and Gloo."""
    return _AllToAll.apply(group, x)


# ---------------------------------------------------------------------------------------------- gating
def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Top-1 gating: each token goes to its best expert, at most ``capacity`` tokens per expert.

    Over capacity, which tokens an expert keeps is random (uniform priority), as in GShard.

    Args:
        logits: ``(tokens, experts)`` gate logits.
        capacity_factor: Capacity as a multiple of ``tokens / experts``.
        min_capacity: Smallest capacity whatever the factor.
        used_token: ``(tokens,)`` mask; tokens with 0 go to no expert.
        noisy_gate_policy: ``"RSample"`` picks the expert on Gumbel-noised logits.

    Returns:
        ``(l_aux, combine_weights (S, E, C), dispatch_mask (S, E, C), exp_counts (E,) on CPU)``.
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    chooser = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask1 = F.one_hot(torch.argmax(chooser, dim=1), num_classes=num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.to(mask1.dtype).view(-1, 1)
    exp_counts = mask1.sum(dim=0).detach().to("cpu")
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    # Keep at most `capacity` tokens per expert, chosen by random priority.
    priority = mask1 * _uniform(mask1.shape, logits.device)
    _, top_idx = torch.topk(priority, k=min(capacity, num_tokens), dim=0)
    mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)
    locations1_s = ((torch.cumsum(mask1, dim=0) - 1) * mask1).sum(dim=1)
    gates = gates * mask1.float()
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates, locations1_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(logits: Tensor, capacity_factor: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Top-2 gating: the best expert and a Gumbel-sampled second one, weights renormalised over the two.

    Capacity is ``ceil(2 * tokens / experts * capacity_factor)``; first choices fill it before second
    choices, each in token order.

    Returns:
        ``(l_aux, combine_weights (S, E, C), dispatch_mask (S, E, C), exp_counts (E,) on CPU)``.
    """
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = math.ceil(2 * num_tokens / num_experts * capacity_factor)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
    noisy = logits + gumbel_rsample(logits.shape, logits.device)
    mask2 = F.one_hot(torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1), num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    exp_counts = mask1.sum(dim=0).detach().to("cpu")
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)
    locations1_s = (locations1 * mask1).sum(dim=1)
    locations2_s = (locations2 * mask2).sum(dim=1)
    gates1_s = (gates * mask1.float()).sum(dim=1)
    gates2_s = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1 = (gates1_s / denom).unsqueeze(1) * mask1.float()
    gates2 = (gates2_s / denom).unsqueeze(1) * mask2.float()
    combine_weights = torch.einsum("se,sc->sec", gates1, F.one_hot(locations1_s, num_classes=capacity).float())
    combine_weights = combine_weights + torch.einsum(
        "se,sc->sec", gates2, F.one_hot(locations2_s, num_classes=capacity).float()
    )
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


class TopKGate(Module):
    """The gate: a bias-free float32 ``Linear(model_dim, num_experts)`` followed by top-1 or top-2 gating.

    Args:
        model_dim: Token width.
        num_experts: Experts over all ranks.
        k: 1 or 2.
        capacity_factor: Capacity multiple in training.
        eval_capacity_factor: Capacity multiple in eval mode.
        min_capacity: Smallest capacity (top-1).
        noisy_gate_policy: None, ``"Jitter"`` (multiplicative input noise) or ``"RSample"`` (Gumbel noise on
            the logits for the choice), in training only.

    Raises:
        ValueError: ``k`` not 1 or 2, or an unknown ``noisy_gate_policy``.
    """

    wg: torch.nn.Linear

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        noisy_gate_policy: str | None = None,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"only top-1 and top-2 gating exist; got k={k}.")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}.")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy

    def forward(self, input: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Gate ``(tokens, model_dim)`` tokens: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = self.wg(x)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            if logits.shape[0] < self.min_capacity:
                raise ValueError(f"top-1 gating got {logits.shape[0]} tokens, fewer than min_capacity="
                                 f"{self.min_capacity}; send more tokens per step or lower min_capacity.")
            policy = self.noisy_gate_policy if self.training else None
            return top1gating(logits, factor, self.min_capacity, used_token, policy)
        return top2gating(logits, factor)


class MOELayer(Base):
    """Gate, dispatch over the ranks, local experts, combine (GShard's algorithm 2).

    Args:
        gate: A :class:`TopKGate` over all ``ranks * num_local_experts`` experts.
        experts: This rank's experts, applied to ``(ranks, num_local_experts, capacity, model_dim)``.
        num_local_experts: Experts per rank.
        group: The ranks the experts are sharded over; default: all.

    After a forward, ``l_aux`` (the load-balancing loss) and ``exp_counts`` (tokens per expert) are set.
    """

    def __init__(self, gate: Module, experts: Module, num_local_experts: int, group: Any = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.num_local_experts = num_local_experts
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        """Route ``input[0]`` (``(..., model_dim)``) through the experts; ``input[1]``: optional token mask."""
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        num_experts, capacity = combine_weights.shape[1], combine_weights.shape[2]
        # Index-based dispatch and combine: each kept (token, expert, slot) moves one row, instead of GShard's
        # dense einsums over the (tokens, experts, capacity) one-hot (tokens x experts x capacity x width
        # multiply-adds). The gating already synchronised with the host (exp_counts), so nonzero costs no
        # new stall.
        s_idx, e_idx, c_idx = dispatch_mask.nonzero(as_tuple=True)
        slot = e_idx * capacity + c_idx
        dispatched = tokens.new_zeros(num_experts * capacity, d_model).index_copy(0, slot, tokens[s_idx])
        dispatched = dispatched.reshape(self.world_size, self.num_local_experts, capacity, d_model)
        received = all_to_all(dispatched, self.group)
        expert_output = self.experts(received)
        returned = all_to_all(expert_output.contiguous(), self.group)
        returned = returned.reshape(num_experts * capacity, d_model)
        weights = combine_weights[s_idx, e_idx, c_idx].type_as(hidden).unsqueeze(1)
        combined = tokens.new_zeros(tokens.shape[0], d_model).index_add(0, s_idx, returned[slot] * weights)
        return combined.reshape(hidden.shape)
