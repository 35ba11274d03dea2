"""Worker for tests/strategy/test_strategy.py: BaguaStrategy inside real Lightning jobs, one JSON per rank.

``--mode torchrun``: started by torchrun with 2 processes; many fits in one process
(fit twice, DDP references, checkpoint resume, validate/test/predict, reduce/broadcast/
barrier, teardown). ``--mode nodes``: started once per node with NODE_RANK set;
Lightning's own launcher starts the second local rank (2 nodes x 2 devices) and
the hierarchical paths run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, Dataset

import bagua_lightning  # noqa: F401  (registers "bagua")
from bagua_lightning.engine.parameters import declare, trainable_parameters
from bagua_lightning.proto.plan import BucketPlan
from bagua_lightning.strategy import BaguaStrategy, QAdamOptimizer

SMALL_BUCKET = 2048


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 8, generator=g)
        w = torch.randn(8, 1, generator=g)
        self.y = (self.x @ w).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Model(L.LightningModule):
    def __init__(self, optimizer: str = "sgd", lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.optimizer_name = optimizer
        self.lr = lr
        self.losses: list[float] = []
        self.grad_synced: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def on_after_backward(self) -> None:
        # Are this backward's gradients equal on every rank (communicated) or local (accumulating)?
        self.grad_synced.append(spread([p.grad for p in self.parameters() if p.grad is not None]) == 0.0)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "qadam":
            return QAdamOptimizer(self.parameters(), lr=0.02, warmup_steps=3)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        if self.optimizer_name == "two_adams":
            return [torch.optim.Adam(self.parameters()), torch.optim.Adam(self.parameters())]
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(), batch_size=16)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(64), batch_size=16)

    test_dataloader = val_dataloader

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(32), batch_size=16)


class ManualModel(Model):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5)  # type: ignore[arg-type]
        opt.step()  # type: ignore[union-attr]
        self.losses.append(float(loss.detach()))
        return loss


ACCELERATOR = "cpu"


def comm_device() -> torch.device:
    """Where collectives of the test itself run (NCCL needs CUDA tensors; Lightning moves models to CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if ACCELERATOR == "gpu" else torch.device("cpu")


def spread(tensors: list[Any]) -> float:
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]).to(comm_device())
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float((hi - lo).abs().max())


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def trainer(strategy: Any, out: Path, **kw: Any) -> L.Trainer:
    args: dict[str, Any] = dict(
        accelerator=ACCELERATOR, devices=2, strategy=strategy, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, num_sanity_val_steps=0,
        default_root_dir=str(out), deterministic=True,
    )
    args.update(kw)
    return L.Trainer(**args)


class ApplyPlan(L.Callback):
    """At step 3, switch to one bucket per tensor (what the autotuner would do); record timings."""

    def __init__(self) -> None:
        self.timings: Any = None
        self.plan_buckets: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, BaguaStrategy)
        if trainer.global_step == 3:
            decls = declare(trainable_parameters(pl_module))
            strategy.apply_plan(BucketPlan(buckets=tuple((d,) for d in decls), bucket_size=1))
        plan = strategy.bucket_plan
        assert plan is not None
        self.plan_buckets.append(len(plan.buckets))
        self.timings = strategy.last_step_timings()


def torchrun_mode(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    # 1. Trainer(strategy="bagua") after `import bagua_lightning`: accumulation + clipping + a plan change,
    #    against Lightning's DDP with the same settings.
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    ddp_model = Model()
    trainer("ddp", out, **kw).fit(ddp_model)
    model, cb = Model(), ApplyPlan()
    t = trainer("bagua", out, callbacks=[cb], **kw)
    res["strategy_class"] = type(t.strategy).__name__
    t.fit(model)
    res["accumulate"] = {
        "diff_vs_ddp": float((flat_params(model) - flat_params(ddp_model)).abs().max()),
        "synced_pattern": model.grad_synced,
        "ddp_synced_pattern": ddp_model.grad_synced,
        "plan_buckets": cb.plan_buckets,
        "timings": len(cb.timings.buckets) if cb.timings else -1,
        "spread": spread(list(model.parameters())),
    }
    # 2. Manual optimization (with clipping) against DDP.
    ddp_manual, manual = ManualModel(), ManualModel()
    trainer("ddp", out).fit(ddp_manual)
    trainer(BaguaStrategy(bucket_size=SMALL_BUCKET), out).fit(manual)
    res["manual"] = {"diff_vs_ddp": float((flat_params(manual) - flat_params(ddp_manual)).abs().max()),
                     "spread": spread(list(manual.parameters()))}
    # 3. Checkpoint at an epoch end (8 steps) and resume = uninterrupted run (Adam with gradient_allreduce;
    #    QAdam resumed after its warm-up: its momentum buffers are re-pointed after the state is loaded).
    for name, algorithm, optimizer in (("resume_adam", "gradient_allreduce", "adam"),
                                       ("resume_qadam", "qadam", "qadam")):
        straight = Model(optimizer)
        trainer(BaguaStrategy(algorithm, bucket_size=SMALL_BUCKET), out, max_steps=-1, max_epochs=2).fit(straight)
        first = Model(optimizer)
        t1 = trainer(BaguaStrategy(algorithm, bucket_size=SMALL_BUCKET), out, max_steps=-1, max_epochs=1)
        t1.fit(first)
        ckpt = out / f"{name}.ckpt"
        t1.save_checkpoint(ckpt)
        resumed = Model(optimizer)
        trainer(BaguaStrategy(algorithm, bucket_size=SMALL_BUCKET), out, max_steps=-1, max_epochs=2).fit(
            resumed, ckpt_path=ckpt)
        res[name] = {"diff": float((flat_params(resumed) - flat_params(straight)).abs().max()),
                     "moved": float((flat_params(resumed) - flat_params(first)).abs().max()),
                     "spread": spread(list(resumed.parameters()))}
    # 4. bytegrad, qadam and bf16-mixed train: loss goes down, replicas identical.
    for name, strategy, optimizer, extra in (
        ("bytegrad", BaguaStrategy("bytegrad", bucket_size=SMALL_BUCKET), "sgd", {}),
        ("qadam", BaguaStrategy("qadam", bucket_size=SMALL_BUCKET), "qadam", {}),
        ("bf16", BaguaStrategy(bucket_size=SMALL_BUCKET), "sgd", {"precision": "bf16-mixed"}),
        *([("fp16", BaguaStrategy(bucket_size=SMALL_BUCKET), "sgd", {"precision": "16-mixed"})]
          if ACCELERATOR == "gpu" else []),
    ):
        m = Model(optimizer)
        trainer(strategy, out, max_steps=30, **extra).fit(m)
        res[name] = {"loss_first": sum(m.losses[:3]) / 3, "loss_last": sum(m.losses[-3:]) / 3,
                     "spread": spread(list(m.parameters()))}
    # 5. QAdam without exactly one QAdamOptimizer.
    errors = []
    for bad in (Model("adam"), ManualModel("two_adams")):
        try:
            trainer(BaguaStrategy("qadam"), out).fit(bad)
        except MisconfigurationException as exc:
            errors.append(str(exc))
    res["qadam_errors"] = errors
    # 6. validate / test / predict, then the collectives Lightning code uses.
    t = trainer(BaguaStrategy(), out)
    m = Model()
    res["validate"] = t.validate(m)
    res["test"] = t.test(m)
    preds = t.predict(m)
    res["predict_batches"] = len(preds) if preds else 0
    s = t.strategy
    rank = torch.tensor(float(dist.get_rank() + 1), device=comm_device())
    res["reduce"] = {op: float(s.reduce(rank.clone(), reduce_op=op))
                     for op in ("sum", "mean", "avg", "min", "max", "product")}
    res["broadcast"] = s.broadcast({"from": dist.get_rank()}, src=1)
    s.barrier()
    # 7. After all those fits: nothing of ours left behind.
    res["teardown"] = {
        "comm_threads": [th.name for th in threading.enumerate() if th.name.startswith("bagua-comm")],
        "comm_none": s.comm is None if isinstance(s, BaguaStrategy) else False,
        "model_unwrapped": isinstance(s.model, L.LightningModule),
    }
    return res


def nodes_mode(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    kw = dict(num_nodes=2, max_steps=6)
    ddp_model = Model()
    trainer("ddp", out, **kw).fit(ddp_model)

    class Probe(L.Callback):
        hierarchical = False

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            comm = trainer.strategy.comm  # type: ignore[attr-defined]
            Probe.hierarchical = bool(comm.is_hierarchical_possible and comm.num_nodes == 2)

    model = Model()
    trainer(BaguaStrategy(hierarchical=True, bucket_size=SMALL_BUCKET), out, callbacks=[Probe()], **kw).fit(model)
    res["hierarchical_possible"] = Probe.hierarchical
    res["allreduce"] = {"diff_vs_ddp": float((flat_params(model) - flat_params(ddp_model)).abs().max()),
                        "spread": spread(list(model.parameters()))}
    for name, optimizer in (("bytegrad", "sgd"), ("qadam", "qadam")):
        m = Model(optimizer)
        trainer(BaguaStrategy(name, hierarchical=True, bucket_size=SMALL_BUCKET), out, num_nodes=2,
                max_steps=24).fit(m)
        res[name] = {"loss_first": sum(m.losses[:3]) / 3, "loss_last": sum(m.losses[-3:]) / 3,
                     "spread": spread(list(m.parameters()))}
    return res


def worker_main(torchrun_mode: Callable[[Path], dict[str, Any]],
                nodes_mode: Callable[[Path], dict[str, Any]]) -> int:
    """Shared entry of the Lightning test workers: parse ``OUT --mode --accelerator``, run, write one JSON per rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=["torchrun", "nodes"], required=True)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    args = parser.parse_args()
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    out = Path(args.out)
    torch.set_num_threads(1)
    rc = 0
    try:
        res = torchrun_mode(out) if args.mode == "torchrun" else nodes_mode(out)
    except Exception:
        res = {"error": traceback.format_exc()}
        rc = 1
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    (out / f"{args.mode}_rank{rank}.json").write_text(json.dumps(res, indent=1, default=str))
    return rc


def main() -> int:
    return worker_main(torchrun_mode, nodes_mode)


if __name__ == "__main__":
    sys.exit(main())
