"""Rank program for the ``AutoAlgorithm`` tests: ``python auto_workers.py OUT_DIR CANDIDATES [--busy-loop]``,
one per rank.

Wraps a small model with ``with_bagua`` and an ``AutoAlgorithm`` over the comma-separated candidates, trains
past the choice and writes ``OUT_DIR/auto-rankN.json``: the choice, the measured step times, the log line,
the algorithm the driver calls after the choice and the parameters after training on the chosen algorithm.

The candidate ``slow_allreduce`` is registered here, in this file only (an algorithm's own file is all
``auto`` needs): gradient_allreduce whose backward takes SLOW_S longer. With ``--busy-loop`` the training
loop itself sleeps BUSY_S after every step of gradient_allreduce (data loading, validation, logging...):
work outside the step, which ``auto`` must not count.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bagua_lightning.torch_api as bagua
from bagua_lightning.engine.algorithms.base import register_algorithm
from bagua_lightning.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_lightning.engine.autotune.selection import MAX_RUNOFFS, AutoSettings
from bagua_lightning.torch_api.algorithms import AutoAlgorithm

WARMUP, TRIALS = 1, 3
SLOW_S, BUSY_S = 0.3, 1.0


@register_algorithm(name="slow_allreduce", bagua_name="SlowAllReduceAlgorithm",
                    description="gradient_allreduce with a slower backward (a test candidate)")
class SlowAllReduce(GradientAllReduceAlgorithm):
    def on_backward_end(self, step: int) -> None:
        super().on_backward_end(step)
        time.sleep(SLOW_S)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(out: Path, candidates: list[str], busy_loop: bool) -> None:
    bagua.init_process_group()
    rank = bagua.get_rank()
    lines = _Lines()
    selection_log = logging.getLogger("bagua_lightning.engine.autotune.selection")
    selection_log.addHandler(lines)
    selection_log.setLevel(logging.INFO)
    torch.manual_seed(rank)  # different initial weights: with_bagua broadcasts rank 0's
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = AutoAlgorithm(candidates=candidates, warmup_steps=WARMUP, trial_steps=TRIALS)
    model = model.with_bagua([opt], algorithm)
    decide_at = AutoSettings(candidates=tuple(candidates), warmup_steps=WARMUP, trial_steps=TRIALS).steps_to_decide
    most = decide_at + MAX_RUNOFFS * 2 * (WARMUP + TRIALS)  # every runoff held, of two candidates
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    used: list[str] = []
    while len(used) < most + 6:  # every rank decides at the same step, so every rank stops at the same one
        if algorithm.selection.decided_at is not None and len(used) >= algorithm.selection.decided_at + 6:
            break
        data, target = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        loss = F.mse_loss(model(data), target)
        used.append(model.bagua_algorithm.engine.current_name)  # a forward may have switched it
        loss.backward()
        opt.step()
        if busy_loop and used[-1] == "gradient_allreduce":
            time.sleep(BUSY_S)  # the loop's own work, between two steps
    selection = algorithm.selection
    assert selection is model.bagua_algorithm.selection  # the factory reads its model's
    result = {
        "chosen": selection.chosen, "step_ms": selection.step_ms, "decided_at": selection.decided_at,
        "reason": selection.reason(), "used": used, "log": lines.lines, "decide_at": decide_at,
        "runoffs": selection.runoffs, "runoff_steps": 2 * (WARMUP + TRIALS),
        "driven": type(model._bagua_driver.algorithm).__name__,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
    }
    (out / f"auto-rank{rank}.json").write_text(json.dumps(result))
    model._bagua_teardown()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","), "--busy-loop" in sys.argv[3:])
