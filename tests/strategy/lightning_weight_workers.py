"""Worker for tests/strategy/test_decentralized_lightning.py: the weight-averaging algorithms inside real
Lightning jobs (``Trainer(strategy=BaguaStrategy(algorithm=...))``), one JSON per rank.

``--mode torchrun``: started by torchrun with 2 processes; several fits in one process
(decentralized all / shift_one, low precision decentralized, async with abort/resume,
checkpoint resume). ``--mode nodes``: started once per node with NODE_RANK set; Lightning's
launcher starts the second local rank (2 nodes x 2 devices) and the hierarchical paths run.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

import bagua_lightning  # noqa: F401  (registers "bagua")
import tests.strategy.lightning_workers as lw
from bagua_lightning.strategy import BaguaStrategy
from tests.strategy.lightning_workers import Model, Regression, flat_params, spread, trainer

SMALL_BUCKET = 2048


def eval_mse(model: nn.Module) -> float:
    data = Regression()
    device = next(model.parameters()).device
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(data.x.to(device)), data.y.to(device)))


def cpu_flat(model: nn.Module) -> torch.Tensor:
    """Flat parameters on the CPU (comparable with a checkpoint whatever the accelerator)."""
    return flat_params(model).cpu()


def async_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("bagua-async")]


def wait_for(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


class Probe(L.Callback):
    """Records, on every rank alike, how far replicas are apart right before each optimizer step."""

    def __init__(self, pause_s: float = 0.0, abort_at: int = -1, resume_at: int = -1) -> None:
        self.spreads: list[float] = []
        self.start: dict[str, Any] = {}
        self.end: dict[str, Any] = {}
        self.abort_state: dict[str, Any] = {}
        self.pause_s, self.abort_at, self.resume_at = pause_s, abort_at, resume_at

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        algo: Any = trainer.strategy.algorithm  # type: ignore[attr-defined]
        self.start = {"spread": spread(list(pl_module.parameters())), "weights": cpu_flat(pl_module),
                      "eval": eval_mse(pl_module),
                      "hierarchical": trainer.strategy.comm.is_hierarchical_possible}  # type: ignore[attr-defined]
        if hasattr(algo, "replicas"):
            weights = torch.cat([t.reshape(-1) for t in algo._buckets.flatten()])
            self.start["replicas_match"] = all(
                torch.equal(torch.cat([t.reshape(-1) for t in algo.replicas[k]]), weights)
                for k in ("weight", "left", "right"))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.spreads.append(spread(list(pl_module.parameters())))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        algo: Any = trainer.strategy.algorithm  # type: ignore[attr-defined]
        self.end.setdefault("rounds_by_batch", []).append(getattr(algo, "averaging_rounds", None))
        if self.pause_s:
            time.sleep(self.pause_s * (1 + dist.get_rank()))  # ranks at different paces
        if trainer.global_step == self.abort_at:
            wait_for(lambda: algo.averaging_rounds >= 1, "a first averaging round")
            algo.abort(trainer.model)
            self.abort_state["after_abort"] = {"averaging": algo.is_averaging, "threads": async_threads(),
                                               "rounds": algo.averaging_rounds}
        if trainer.global_step == self.resume_at:
            frozen = algo.averaging_rounds
            algo.resume(trainer.model)
            wait_for(lambda: algo.averaging_rounds > frozen, "a round after resume()")
            self.abort_state["after_resume"] = {"averaging": algo.is_averaging, "rounds_before": frozen}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        algo: Any = trainer.strategy.algorithm  # type: ignore[attr-defined]
        self.end["rounds"] = getattr(algo, "averaging_rounds", None)


def fit(algorithm: str, out: Path, probe: Probe, *, ckpt_path: Path | None = None, **kwargs: Any) -> Model:
    model = Model()
    trainer_kw = {k: kwargs.pop(k) for k in ("max_steps", "max_epochs", "num_nodes") if k in kwargs}
    t = trainer(BaguaStrategy(algorithm, bucket_size=SMALL_BUCKET, **kwargs), out, callbacks=[probe],
                **{"max_steps": 16, **trainer_kw})
    t.fit(model, ckpt_path=ckpt_path)
    return model


def summary(model: Model, probe: Probe, start_eval: float) -> dict[str, Any]:
    return {"eval_first": start_eval, "eval_last": eval_mse(model), "spreads": probe.spreads,
            "hierarchical": probe.start["hierarchical"],
            "final_spread": spread(list(model.parameters())), **probe.end}


def torchrun_mode(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    start_eval = eval_mse(Model())
    # 1. decentralized "all" every step; "shift_one" every second step (2 ranks: the one peer). Flat: with
    #    hierarchical=True on one node every rank would hold the node average.
    for name, kwargs in (("all", {"peer_selection_mode": "all", "hierarchical": False}),
                         ("shift_one", {"peer_selection_mode": "shift_one", "communication_interval": 2,
                                        "hierarchical": False})):
        probe = Probe()
        res[name] = summary(fit("decentralized", out, probe, **kwargs), probe, start_eval)
    # 2. low precision decentralized.
    probe = Probe()
    res["low_precision"] = summary(fit("low_precision_decentralized", out, probe, hierarchical=False), probe,
                                   start_eval)
    # 3. async: warm-up, background averaging, abort after step 6 and resume after step 10, clean stop.
    probe = Probe(pause_s=0.01, abort_at=6, resume_at=10)
    m = fit("async", out, probe, sync_interval_ms=10, warmup_steps=2, max_steps=24)
    res["async"] = {**summary(m, probe, start_eval), **probe.abort_state, "threads_after_fit": async_threads()}
    # 4. Checkpoint after one epoch (8 steps per rank), resume for a second one: every rank restarts from the
    #    checkpoint's weights (rank 0's), low precision replicas are rebuilt from them.
    for name, algorithm in (("resume_decentralized", "decentralized"),
                            ("resume_low_precision", "low_precision_decentralized")):
        first = Model()
        t1 = trainer(BaguaStrategy(algorithm, bucket_size=SMALL_BUCKET, hierarchical=False), out, max_steps=-1,
                     max_epochs=1)
        t1.fit(first)
        ckpt = out / f"{name}.ckpt"
        t1.save_checkpoint(ckpt)
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        saved_flat = torch.cat([saved["state_dict"][k].reshape(-1) for k in first.state_dict()])
        probe = Probe()
        resumed = fit(algorithm, out, probe, ckpt_path=ckpt, max_steps=-1, max_epochs=2, hierarchical=False)
        res[name] = {
            "start_spread": probe.start["spread"],
            "start_is_checkpoint": bool(torch.equal(probe.start["weights"], saved_flat)),
            "saved_is_mine": bool(torch.equal(saved_flat, cpu_flat(first))),
            "replicas_match": probe.start.get("replicas_match"),
            "steps_after_resume": len(probe.spreads),
            "eval_at_resume": probe.start["eval"], "eval_last": eval_mse(resumed),
        }
    res["teardown"] = {"async_threads": async_threads()}
    return res


def nodes_mode(out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    start_eval = eval_mse(Model())
    for name, algorithm, kwargs in (
        ("all", "decentralized", {"peer_selection_mode": "all"}),
        ("shift_one", "decentralized", {"peer_selection_mode": "shift_one"}),
        ("low_precision", "low_precision_decentralized", {}),
    ):
        probe = Probe()
        m = fit(algorithm, out, probe, hierarchical=True, num_nodes=2, max_steps=16, **kwargs)
        res[name] = summary(m, probe, start_eval)
    return res


def main() -> int:
    return lw.worker_main(torchrun_mode, nodes_mode)


if __name__ == "__main__":
    sys.exit(main())
