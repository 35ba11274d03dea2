"""One rank of a 2-rank Lightning job against docker-compose.yml's services (tests/integration/test_compose_up.py).

``BaguaStrategy(autotune=True)`` with the service at ``$BAGUA_LIGHTNING_AUTOTUNE_SERVICE`` and a
``CachedDataset`` on the cluster at ``$BAGUA_LIGHTNING_REDIS_HOSTS``, both with the secrets of the
environment, both over TLS with the files named by ``BAGUA_LIGHTNING_TLS_CA``/``_CERT``/``_KEY``. With
``--explicit-tls`` those files are also passed as arguments (for a client that does not read the variables).
Every sample the step sees is checked against its source. ``--pause-after N``: after step N, write
``paused-rank<r>`` in ``--out`` and wait (up to 240 s) for a file ``resume`` there. Writes
``rank<r>.json``: the cache's counters, the steps trained, the autotune summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bagua_lightning.client.cache import CachedDataset
from bagua_lightning.strategy import BaguaStrategy

SAMPLES = 256


class Source(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, 32, generator=g)
        self.y = self.x[:, :4].sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(i), self.x[i], self.y[i]


class Net(L.LightningModule):
    def __init__(self, data: CachedDataset, out: Path, pause_after: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.data, self.source, self.out, self.pause_after = data, Source(), out, pause_after
        self.steps = 0
        self.wrong = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.wrong += int((~torch.isclose(x, self.source.x[index]).all(dim=1)).sum())
        self.steps += 1
        if self.steps == self.pause_after:
            rank = self.trainer.global_rank
            (self.out / f"paused-rank{rank}").write_text("")
            deadline = time.monotonic() + 240
            while not (self.out / "resume").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=16)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--pause-after", type=int, default=0)
    parser.add_argument("--explicit-tls", action="store_true")
    args = parser.parse_args()
    tls = {"ca": os.environ["BAGUA_LIGHTNING_TLS_CA"], "cert": os.environ["BAGUA_LIGHTNING_TLS_CERT"],
           "key": os.environ["BAGUA_LIGHTNING_TLS_KEY"]}
    cache_tls: dict[str, Any] = {}
    strategy_tls: dict[str, Any] = {}
    if args.explicit_tls:
        cache_tls = {"ssl": True, "ssl_ca_certs": tls["ca"], "ssl_certfile": tls["cert"], "ssl_keyfile": tls["key"]}
        strategy_tls = {"autotune_tls": tls["ca"]}
    data = CachedDataset(Source(), dataset_name=args.dataset, writer_buffer_size=16, **cache_tls)
    strategy = BaguaStrategy(autotune=True, autotune_interval=2, autotune_model_name=f"compose-{args.dataset}",
                             **strategy_tls)
    model = Net(data, args.out, args.pause_after)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    stats = data.stats
    summary = strategy.autotune_summary
    report = {"hits": stats.hits, "misses": stats.misses, "corrupt": stats.corrupt, "errors": stats.errors,
              "writes": stats.writes, "write_errors": stats.write_errors, "steps": model.steps, "wrong": model.wrong,
              "registered": bool(summary and summary.registered), "summary": summary.line() if summary else ""}
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
