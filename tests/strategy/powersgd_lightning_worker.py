"""Worker for tests/strategy/test_powersgd_lightning.py: powersgd and half_allreduce inside real Lightning jobs.

``--mode torchrun`` (2 processes under torchrun): the strategy tests' seeded task (``lightning_workers``'
``Model`` and data) trained by Lightning's DDP, by ``Trainer(strategy="bagua_powersgd")``,
``"bagua_half_allreduce"``, ``algorithm="auto"`` over candidates that include them, and a checkpoint resumed
mid-run. ``--mode nodes`` (Lightning's launcher, 2 nodes x 2 devices): the hierarchical paths.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L

from bagua_lightning.strategy import BaguaStrategy
from tests.strategy.lightning_workers import SMALL_BUCKET, Model, flat_params, spread, trainer, worker_main

STEPS = 30


class SaveAtEpochEnd(L.Callback):
    """Saves a checkpoint at the end of each training epoch, while the algorithm still holds its state (as
    ``ModelCheckpoint`` does; after ``fit`` returns, the strategy has handed the model back)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _losses(m: Model) -> dict[str, Any]:
    return {"loss_first": sum(m.losses[:3]) / 3, "loss_last": sum(m.losses[-3:]) / 3,
            "spread": spread(list(m.parameters()))}


def torchrun_mode(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, strategy in (
        ("ddp", "ddp"),
        ("powersgd", "bagua_powersgd"),
        ("powersgd_rank2", BaguaStrategy("powersgd", matrix_approximation_rank=2, start_powerSGD_iter=2,
                                         bucket_size=SMALL_BUCKET)),
        ("bf16", "bagua_half_allreduce"),
        ("fp16", BaguaStrategy("half_allreduce", dtype="float16", bucket_size=SMALL_BUCKET)),
    ):
        m = Model()
        t = trainer(strategy, out, max_steps=STEPS)
        t.fit(m)
        res[name] = {**_losses(m), "algorithm": getattr(t.strategy, "algorithm_name", "ddp")}
    # auto over candidates that include both: it trains, chooses one of them, and logs the ratio.
    m = Model()
    auto = BaguaStrategy(algorithm="auto", auto_candidates=["gradient_allreduce", "half_allreduce", "powersgd"],
                         auto_warmup_steps=1, auto_trial_steps=3, auto_max_runoffs=0)
    t = trainer(auto, out, max_steps=STEPS)
    t.fit(m)
    selection = auto.selection
    res["auto"] = {**_losses(m), "chosen": selection.chosen if selection else None,
                   "reason": selection.reason() if selection else ""}
    # A checkpoint after the first epoch (8 steps, past start_powerSGD_iter) resumes bit-identically.
    def strategy() -> BaguaStrategy:
        return BaguaStrategy("powersgd", start_powerSGD_iter=3, bucket_size=SMALL_BUCKET)

    straight = Model()
    trainer(strategy(), out, max_steps=-1, max_epochs=2).fit(straight)
    first = Model()
    ckpt = out / "powersgd.ckpt"
    trainer(strategy(), out, max_steps=-1, max_epochs=1, callbacks=[SaveAtEpochEnd(ckpt)]).fit(first)
    resumed = Model()
    trainer(strategy(), out, max_steps=-1, max_epochs=2).fit(resumed, ckpt_path=ckpt)
    res["resume"] = {"diff": float((flat_params(resumed) - flat_params(straight)).abs().max()),
                     "moved": float((flat_params(resumed) - flat_params(first)).abs().max()),
                     "spread": spread(list(resumed.parameters()))}
    return res


def nodes_mode(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    kw: dict[str, Any] = dict(num_nodes=2, max_steps=24)
    ddp = Model()
    trainer("ddp", out, **kw).fit(ddp)
    res["ddp"] = _losses(ddp)
    for name, algorithm, extra in (("powersgd", "powersgd", {"start_powerSGD_iter": 2}),
                                   ("half", "half_allreduce", {})):
        m = Model()
        trainer(BaguaStrategy(algorithm, hierarchical=True, bucket_size=SMALL_BUCKET, **extra), out, **kw).fit(m)
        res[name] = _losses(m)
    return res


if __name__ == "__main__":
    sys.exit(worker_main(torchrun_mode, nodes_mode))
