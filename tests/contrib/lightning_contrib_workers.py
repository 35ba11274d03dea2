"""Contrib pieces inside real Lightning jobs under BaguaStrategy (torchrun, 2 CPU ranks), one JSON per rank."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import bagua_lightning  # noqa: F401
from bagua_lightning.strategy import BaguaStrategy
from bagua_lightning.strategy.contrib import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
    MoE,
    fuse_optimizer,
    is_moe_param,
)


class Data(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=g) * 2 + 1
        self.y = torch.randn(n, 1, generator=g)
        self.length = (torch.rand(n, generator=g) * 50).int() + 1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def _net() -> nn.Module:
    torch.manual_seed(0)
    # No bias before the norm: its true gradient is 0 and Adam would amplify rounding noise there.
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


class Model(L.LightningModule):
    def __init__(self, fused: bool = False, balanced: bool = False) -> None:
        super().__init__()
        self.net = _net()
        self.fused, self.balanced = fused, balanced
        self.seen: list[list[int]] = []
        self.bn_classes: set[str] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.append(idx.tolist())
        self.bn_classes.add(type(self.net[1]).__name__)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        return fuse_optimizer(opt) if self.fused else opt

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.fused:
            optimizer.optimizer.fuse_step(optimizer_closure)
        else:
            optimizer.step(closure=optimizer_closure)

    def train_dataloader(self) -> DataLoader[Any]:
        data = Data()
        if not self.balanced:
            return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))
        sampler = LoadBalancingDistributedSampler(data, complexity_fn=lambda s: int(data.length[s[2]]))
        self.batch_sampler = LoadBalancingDistributedBatchSampler(
            sampler, batch_fn=lambda ids: [ids[i : i + 4] for i in range(0, len(ids), 4)])
        return DataLoader(data, batch_sampler=self.batch_sampler)


class MoEModel(L.LightningModule):
    """A small MoE regression; each rank fits its own batch, experts differ per rank from the start."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 16)
        self.moe = MoE(16, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), num_local_experts=2,
                       min_capacity=2, capacity_factor=2.0)
        self.out = nn.Linear(16, 1)
        torch.manual_seed(100 + dist.get_rank())
        for p in self.parameters():
            if is_moe_param(p):
                nn.init.normal_(p, std=0.2)
        self.experts_at_start = [p.detach().clone() for p in self.parameters() if is_moe_param(p)]
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        loss = nn.functional.mse_loss(self.out(h), y) + 0.01 * l_aux
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        data = Data(16)  # one batch of 8 per rank, seen every step
        return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))


def _spread(tensors: list[torch.Tensor]) -> float:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float((hi - lo).max())


def _trainer(**kw: Any) -> L.Trainer:
    args: dict[str, Any] = dict(accelerator="cpu", devices=2, strategy=BaguaStrategy(), max_steps=4, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**args, **kw})


def _reference(steps: int) -> nn.Module:
    """One process, plain BatchNorm over both ranks' batches (rank r reads indices r, r+2, ...)."""
    net, data = _net(), Data()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for k in range(steps):
        idx = list(range(16 * k, 16 * k + 16))
        opt.zero_grad()
        nn.functional.mse_loss(net(data.x[idx]), data.y[idx]).backward()
        opt.step()
    return net


def _diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def main(out: Path) -> None:
    res: dict[str, Any] = {}
    try:
        ref = _reference(4)
        for name, fused in (("sync_bn", False), ("sync_bn_fused", True)):
            model = Model(fused=fused)
            _trainer(sync_batchnorm=True).fit(model)
            res[name] = {"diff_vs_reference": _diff(model.net, ref), "bn": sorted(model.bn_classes),
                         "seen_first": model.seen[0]}
        # Asynchronous averaging: a background thread communicates while SyncBatchNorm's collectives run in
        # forward and backward; they use different process groups, so the job neither hangs nor garbles.
        model = Model()
        strategy = BaguaStrategy(algorithm="async", sync_interval_ms=5, warmup_steps=2)
        _trainer(sync_batchnorm=True, strategy=strategy, max_steps=12).fit(model)
        res["async_sync_bn"] = {"bn": sorted(model.bn_classes),
                                "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
        model = Model(balanced=True)
        _trainer(max_epochs=1, max_steps=-1).fit(model)
        res["balanced"] = {"seen": model.seen, "expected": model.batch_sampler.padded_batches}
        moe = MoEModel()
        _trainer(max_steps=30).fit(moe)
        experts = [p for p in moe.parameters() if is_moe_param(p)]
        res["moe"] = {
            "shared_spread": _spread([p for p in moe.parameters() if not is_moe_param(p)]),
            "expert_spread": _spread(experts),
            "experts_trained": not all(torch.equal(a, b) for a, b in zip(moe.experts_at_start, experts, strict=True)),
            "loss_first": moe.losses[0], "loss_best_late": min(moe.losses[-10:]),
        }
    except Exception:
        res["error"] = traceback.format_exc()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Results are written. Leave without interpreter teardown: a normal exit after the async algorithm's
    # side process groups sometimes aborts in C++ ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)
