"""Worker for tests/strategy/test_autotune_lightning.py: ``BaguaStrategy(autotune=True)`` in real Lightning fits.

Started with torchrun's environment variables, 2 ranks. Three fits in one process:
``reference`` (no autotune), ``tuned`` (autotune against ``--address``, with validation
inside the fit and a CSV logger) and ``second_job`` (a new strategy and model of the
same class: a second job of the same model). One JSON per rank.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bagua_lightning.strategy import BaguaStrategy


class Data(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 48, generator=g)
        self.y = self.x[:, :4].sum(dim=1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class TunedNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(48, 48), nn.Tanh())], nn.Linear(48, 1))
        self.records: list[list[Any]] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Runs after the strategy's on_train_batch_start: the plan this step communicates with.
        plan = self.trainer.strategy.bucket_plan  # type: ignore[attr-defined]
        self.records.append([self.trainer.global_step, plan.version, plan.fingerprint(), len(plan.buckets)])
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Data(1024), batch_size=16)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Data(64), batch_size=16)


class RegisteredFirst(L.Callback):
    """Rank 0 starts training once its session is registered with the service (which the worker does in the
    background): a job of a few steps on a loaded machine would otherwise end before its first report."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        worker = getattr(getattr(trainer.strategy, "_autotune", None), "worker", None)
        deadline = time.monotonic() + 60
        while worker is not None and not worker.registered and time.monotonic() < deadline:
            time.sleep(0.05)


def fit(strategy: BaguaStrategy, out: Path, name: str, steps: int) -> tuple[TunedNet, BaguaStrategy]:
    model = TunedNet()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=[RegisteredFirst()],
                        logger=CSVLogger(str(out), name=name, version=0), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=10,
                        limit_val_batches=2, num_sanity_val_steps=0, deterministic=True)
    trainer.fit(model)
    return model, strategy


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def logged(out: Path, name: str) -> list[dict[str, str]]:
    path = out / name / "version_0" / "metrics.csv"
    if not path.exists():
        return []
    with open(path) as fh:
        return [row for row in csv.DictReader(fh) if row.get("autotune/plan_version")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--address", required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    rc = 0
    try:
        ref, _ = fit(BaguaStrategy(bucket_size=4096), out, "reference", args.steps)
        tuned, strategy = fit(BaguaStrategy(autotune=True, autotune_service=args.address, autotune_interval=3,
                                            bucket_size=4096), out, "tuned", args.steps)
        second, strategy2 = fit(BaguaStrategy(autotune=True, autotune_service=args.address, autotune_interval=3,
                                              bucket_size=4096), out, "second_job", 6)
        assert strategy.autotune_summary is not None and strategy2.autotune_summary is not None
        res = {
            "rank": dist.get_rank() if dist.is_initialized() else -1,
            "param_diff": float((flat(ref) - flat(tuned)).abs().max()),
            "loss_diff": max(abs(a - b) for a, b in zip(ref.losses, tuned.losses, strict=True)),
            "tuned_records": tuned.records,
            "second_records": second.records,
            "summary": strategy.autotune_summary.line(),
            "summary_completed": strategy.autotune_summary.completed,
            "second_summary": strategy2.autotune_summary.line(),
            "metrics": logged(out, "tuned"),
        }
    except Exception:
        res = {"error": traceback.format_exc()}
        rc = 1
    rank = int(__import__("os").environ.get("RANK", "0"))
    (out / f"lightning_rank{rank}.json").write_text(json.dumps(res, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
