"""Worker for tests/strategy/test_autotune_checkpoint.py: Lightning fits with loggers and checkpoints.

Started with torchrun's environment variables, 2 ranks, one phase per process (a resumed job is
a new process, as after a crash):

* ``fit``: ``BaguaStrategy(autotune=True, autotune_model_name=...)`` trains on a ``CachedDataset``
  (in Redis at ``--redis``) wrapped in a ``Subset``, with a ``CSVLogger``, then saves a checkpoint;
* ``resume``: a new trainer fits on from that checkpoint.

One JSON per rank and phase: every step's plan, the strategy's autotune state, the logged metrics.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from bagua_lightning.client.cache.dataset import CachedDataset
from bagua_lightning.strategy import BaguaStrategy

MODEL_NAME = "checkpointed net"
INTERVAL = 3


class Data(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 32, generator=g)
        self.y = self.x[:, :3].sum(dim=1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(L.LightningModule):
    def __init__(self, redis: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())], nn.Linear(32, 1))
        self.redis = redis
        self.records: list[list[Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        plan = self.trainer.strategy.bucket_plan  # type: ignore[attr-defined]
        self.records.append([self.trainer.global_step, plan.version, plan.fingerprint(), len(plan.buckets)])
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        cached = CachedDataset(Data(96), dataset_name="ckpt-test", hosts=[self.redis], writer_buffer_size=8)
        return DataLoader(Subset(cached, list(range(64))), batch_size=8)


def logged(out: Path, name: str) -> list[dict[str, str]]:
    path = out / name / "version_0" / "metrics.csv"
    if not path.exists():
        return []
    with open(path) as fh:
        return list(csv.DictReader(fh))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("phase", choices=("fit", "resume"))
    parser.add_argument("--address", required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    ckpt = out / "tuned.ckpt"
    res: dict[str, Any] = {}
    rc = 0
    try:
        strategy = BaguaStrategy(autotune=True, autotune_service=args.address, autotune_interval=INTERVAL,
                                 bucket_size=2048, autotune_model_name=MODEL_NAME)
        model = Net(args.redis)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
                            logger=CSVLogger(str(out), name=args.phase, version=0), log_every_n_steps=2,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0)
        trainer.fit(model, ckpt_path=str(ckpt) if args.phase == "resume" else None)
        if args.phase == "fit":
            trainer.save_checkpoint(str(ckpt))
        state = strategy.autotune_state
        res = {"records": model.records, "state": state.to_dict() if state else None,
               "metrics": logged(out, args.phase)}
        if args.phase == "fit" and trainer.is_global_zero:
            saved = torch.load(str(ckpt), weights_only=True)  # plain types only: loads without pickle
            res["checkpoint_state"] = saved.get("bagua_autotune_state")
    except Exception:
        res = {"error": traceback.format_exc()}
        rc = 1
    rank = int(os.environ.get("RANK", "0"))
    (out / f"{args.phase}_rank{rank}.json").write_text(json.dumps(res, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
