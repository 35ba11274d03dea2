"""Worker for tests/strategy/test_auto_algorithm.py: ``algorithm="auto"`` and in-flight algorithm switches on
real Gloo ranks, one JSON per rank.

``--mode torchrun``: a Lightning fit with ``BaguaStrategy(algorithm="auto")`` over three candidates and a
CSVLogger; then an engine-level switch from decentralized (replicas drift) to gradient_allreduce.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.loggers.logger import Logger

import bagua_lightning  # noqa: F401  (registers "bagua")
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
from bagua_lightning.strategy import BaguaStrategy
from tests.strategy.lightning_workers import Model, flat_params, trainer, worker_main

CANDIDATES = ["gradient_allreduce", "bytegrad", "decentralized"]


class Recorder(Logger):
    """A Lightning logger that keeps what it was given (rank 0 logs; the other ranks' loggers stay empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.keys |= set(metrics)


class Record(Model):
    """Records which algorithm drove each step."""

    def __init__(self) -> None:
        super().__init__()
        self.algorithms: list[str] = []
        self.driven: list[str] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = self.trainer.strategy
        assert isinstance(strategy, BaguaStrategy)
        self.algorithms.append(strategy.algorithm_name)
        self.driven.append(type(strategy.algorithm).__name__)


def auto_fit(out: Path) -> dict[str, Any]:
    strategy = BaguaStrategy(algorithm="auto", auto_candidates=CANDIDATES, auto_warmup_steps=1, auto_trial_steps=3,
                             auto_max_runoffs=0)  # the choice at step 14 exactly (runoffs: test_auto_algorithm.py)
    model = Record()
    logger = Recorder()
    fit = trainer(strategy, out, max_steps=16, logger=logger, log_every_n_steps=1)
    fit.fit(model)
    selection = strategy.selection
    assert selection is not None
    logged = logger.keys
    return {"chosen": selection.chosen, "step_ms": selection.step_ms, "decided_at": selection.decided_at,
            "reason": selection.reason(), "algorithms": model.algorithms, "driven": model.driven, "algorithm_name": strategy.algorithm_name,
            "losses": model.losses, "params": flat_params(model).tolist(), "logged": sorted(logged)}


def engine_switch() -> dict[str, Any]:
    comm = CommContext.build(local_size=dist.get_world_size())
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    wrapped = BaguaDistributedDataParallel(net, get_algorithm_class("decentralized").from_kwargs(), comm,
                                           optimizers=[opt])
    g = torch.Generator().manual_seed(dist.get_rank())  # every rank its own data: replicas drift apart
    for _ in range(3):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        wrapped(x).pow(2).mean().backward()
        opt.step()
    before = flat_params(net)
    gathered = [torch.zeros_like(before) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, before)
    steps_before = wrapped.step
    wrapped.switch_algorithm(get_algorithm_class("gradient_allreduce").from_kwargs())
    after_switch = flat_params(net)
    x = torch.randn(8, 4, generator=g)
    opt.zero_grad()
    wrapped(x).pow(2).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in net.parameters()])
    opt.step()
    result = {"before": before.tolist(), "mean_before": torch.stack(gathered).mean(0).tolist(),
              "after_switch": after_switch.tolist(), "grads": grads.tolist(), "after_step": flat_params(net).tolist(),
              "steps": [steps_before, wrapped.step], "algorithm": type(wrapped.algorithm).__name__}
    wrapped.teardown()
    comm.destroy_groups()
    return result


def torchrun_mode(out: Path) -> dict[str, Any]:
    fit = auto_fit(out)
    return {"fit": fit, "switch": engine_switch()}


def nodes_mode(out: Path) -> dict[str, Any]:
    raise NotImplementedError("auto_workers runs under torchrun only")


if __name__ == "__main__":
    sys.exit(worker_main(torchrun_mode, nodes_mode))
