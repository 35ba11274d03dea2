"""Fault-tolerant training through Lightning: run once per node under torchrun; kill a node, start it again.

    bagua-lightning lighthouse --port 29510 &                     # the coordinator, once per job
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    BAGUA_LIGHTNING_NODE_ID=node0 torchrun --nproc-per-node 2 --master-port 29620 \\
        -m bagua_lightning.examples.elastic_lightning --out /tmp/ft &
    BAGUA_LIGHTNING_NODE_ID=node1 torchrun --nproc-per-node 2 --master-port 29621 \\
        -m bagua_lightning.examples.elastic_lightning --out /tmp/ft &

The one line that makes a Lightning job fault-tolerant is the strategy's
``BaguaStrategy(fault_tolerance=FaultTolerance(...))``; each node is a ``Trainer(num_nodes=1)`` of its own.
Each rank appends one JSON line per committed step to ``OUT/<node>-<rank>.jsonl`` (as
``examples/elastic_train.py`` does, plus ``global_step``) and writes its final weights to
``OUT/<node>-<rank>.final.pt``; the epoch-end validation writes ``OUT/<node>-<rank>.val.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..engine.fault_tolerance import FaultTolerance
from ..strategy.strategy import BaguaStrategy
from .elastic_train import _data, node_arguments


class Regression(pl.LightningModule):
    def __init__(self, hidden: int, step_sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.step_sleep = step_sleep
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_sleep)
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(float(nn.functional.mse_loss(self.net(x), y)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Record(pl.Callback):
    """One JSON line per committed step (every batch Lightning sees is one), and the epoch-end validation."""

    def __init__(self, out: Path, node: str) -> None:
        self.out, self.node = out, node

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        steps = trainer.strategy.fault_tolerance_steps  # type: ignore[attr-defined]
        commit = steps.last_commit
        m = commit.membership
        with (self.out / f"{self.node}-{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps({"step": m.step, "count": m.count, "nodes": list(m.nodes), "indices": commit.indices,
                                "step_indices": commit.step_indices, "global_step": trainer.global_step,
                                "t": time.time()}) + "\n")

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        path = self.out / f"{self.node}-{trainer.global_rank}.val.json"
        path.write_text(json.dumps({"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                                    "batches": len(module.val_losses)}))  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = node_arguments(__doc__.splitlines()[0], hidden=32)
    p.add_argument("--algorithm", default="gradient_allreduce")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bagua_lightning").setLevel(logging.INFO)  # membership changes, healing

    node = os.environ.get("BAGUA_LIGHTNING_NODE_ID", "node0")
    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed + rank + 1000 * int(node[-1]))  # different on purpose: healing makes them equal
    x, y = _data(args.samples, 16, args.seed)
    train = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16)
    model = Regression(args.hidden, args.step_sleep)
    strategy = BaguaStrategy(algorithm=args.algorithm, fault_tolerance=FaultTolerance(
        min_nodes=args.min_nodes, timeout_s=args.timeout, quorum_timeout_s=args.quorum_timeout))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), num_nodes=1,
                         strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Record(args.out, node)])
    trainer.fit(model, train, val)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               args.out / f"{node}-{trainer.global_rank}.final.pt")
    print(f"{node}/{trainer.global_rank}: done at global_step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
