"""One rank under ``BaguaStrategy``: ``python one_rank_worker.py OUT.json`` (tests/strategy/test_one_rank.py).

Fits the same model on the same batches with Lightning's single-device strategy and with ``BaguaStrategy``
(``gradient_allreduce``, ``bytegrad``, ``auto`` with ``autotune=True`` pointed at a port nobody serves) on
one CPU device, and writes what the test asserts: the weights after each fit, whether the model was wrapped,
``auto``'s selection at the first step, and the strategy's info lines.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from bagua_lightning.strategy import BaguaStrategy


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.seen: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        strategy = self.trainer.strategy
        if batch_idx == 0 and isinstance(strategy, BaguaStrategy):
            selection = strategy.selection
            self.seen = {"wrapped": strategy.bagua_module is not None, "algorithm_name": strategy.algorithm_name,
                         "selection": None if selection is None else
                         {"chosen": selection.chosen, "decided_at": selection.decided_at,
                          "reason": selection.reason(), "step_ms": selection.step_ms}}
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(strategy: Any) -> tuple[list[float], dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    model = Net()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=8, logger=False,
                        use_distributed_sampler=False,  # the same batches in the same order for every strategy
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(), model.seen


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(out: str) -> None:
    lines = Lines()
    logging.getLogger("lightning.pytorch").addHandler(lines)
    single, _ = fit("auto")
    result: dict[str, Any] = {"single": single}
    for name, strategy in (("gradient_allreduce", BaguaStrategy()), ("bytegrad", BaguaStrategy("bytegrad")),
                           ("auto", BaguaStrategy("auto", autotune=True, autotune_service="127.0.0.1:1"))):
        lines.lines.clear()
        weights, seen = fit(strategy)
        ours = [ln for ln in lines.lines if ln.startswith(("algorithm='auto'", "autotune"))]
        result[name] = {"weights": weights, "seen": seen, "lines": ours}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
