"""MoE rank program: the sharded layer against a one-process reference holding every expert."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bagua_lightning.engine.contrib.moe import MoE, is_moe_param, top1gating, top2gating
from tests.contrib.workers import _init

M, LOCAL, TOKENS = 8, 2, 24


def _expert(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(M, 16), torch.nn.ReLU(), torch.nn.Linear(16, M))


def _reference(x: torch.Tensor, wg: torch.nn.Linear, experts: list[torch.nn.Module], k: int, cf: float,
               min_cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = wg(x.float())
    if k == 1:
        l_aux, combine, dispatch, _ = top1gating(logits, cf, min_cap)
    else:
        l_aux, combine, dispatch, _ = top2gating(logits, cf)
    dispatched = torch.einsum("sec,sm->ecm", dispatch.type_as(x), x)
    outs = torch.stack([experts[e](dispatched[e]) for e in range(len(experts))])
    return torch.einsum("sec,ecm->sm", combine.type_as(x), outs), l_aux


def moe(backend: str, k: int) -> None:
    rank, world, device = _init(backend)
    n_exp = world * LOCAL
    cf, min_cap = 1.0, 2  # small capacity: some tokens are dropped, on both sides alike
    experts = [_expert(100 + e).to(device) for e in range(n_exp)]
    torch.manual_seed(0)
    layer = MoE(M, _expert(0), num_local_experts=LOCAL, k=k, capacity_factor=cf, min_capacity=min_cap).to(device)
    assert layer.num_experts == n_exp
    local = layer.deepspeed_moe.experts.bagua_experts
    for i in range(LOCAL):
        local[i].load_state_dict(experts[rank * LOCAL + i].state_dict())
    expert_params = [p for p in layer.parameters() if is_moe_param(p)]
    assert len(expert_params) == 4 * LOCAL and not any(is_moe_param(p) for p in layer.deepspeed_moe.gate.parameters())
    wg_ref = torch.nn.Linear(M, n_exp, bias=False).to(device)
    wg_ref.load_state_dict(layer.deepspeed_moe.gate.wg.state_dict())

    torch.manual_seed(1000 + rank)
    x_all = torch.randn(TOKENS, M, device=device)
    w_out = torch.randn(TOKENS, M, device=device)
    x = x_all.clone().requires_grad_(True)
    torch.manual_seed(7 + rank)
    out, l_aux, counts = layer(x.view(2, TOKENS // 2, M))
    ((out.reshape(TOKENS, M) * w_out).sum() + l_aux).backward()

    xr = x_all.clone().requires_grad_(True)
    torch.manual_seed(7 + rank)
    ref_out, ref_aux = _reference(xr, wg_ref, experts, k, cf, min_cap)
    ((ref_out * w_out).sum() + ref_aux).backward()

    assert counts.sum().item() == TOKENS and counts.shape == (n_exp,), counts
    torch.testing.assert_close(out.reshape(TOKENS, M), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_aux, ref_aux)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.deepspeed_moe.gate.wg.weight.grad, wg_ref.weight.grad, rtol=1e-5, atol=1e-5)
    # An expert's gradient gathers every rank's tokens routed to it: the sum of the per-rank references.
    for ex in experts:
        for p in ex.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
    for i in range(LOCAL):
        for p, q in zip(local[i].parameters(), experts[rank * LOCAL + i].parameters(), strict=True):
            torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(p), q.grad,
                                       rtol=1e-4, atol=1e-5)
    print(f"rank {rank}: moe ok ({backend}, world {world}, k={k}, tokens per expert {counts.tolist()})", flush=True)
    dist.destroy_process_group()
