"""One rank costs nothing: no wrapper, no communication, no measurement; ``auto`` decides at step 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from bagua_lightning.engine.algorithms.auto import AutoAlgorithm
from bagua_lightning.engine.autotune.selection import ONE_RANK, Selection
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import AlgorithmDriver
from tests.ranks import REPO, job_env

WORKER = str(Path(__file__).with_name("one_rank_worker.py"))


def test_one_rank_trains_as_lightning_single_device(tmp_path: Path) -> None:
    out = tmp_path / "one_rank.json"
    proc = subprocess.run([sys.executable, WORKER, str(out)], env=job_env({"CUDA_VISIBLE_DEVICES": ""}), cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("gradient_allreduce", "bytegrad", "auto"):
        run = result[name]
        # Nothing communicated, nothing compressed: the weights are the single-device fit's, bit for bit.
        assert run["weights"] == result["single"], name
        assert run["seen"]["wrapped"] is False, name
    auto = result["auto"]
    assert auto["seen"]["algorithm_name"] == "gradient_allreduce"
    assert auto["seen"]["selection"] == {"chosen": "gradient_allreduce", "decided_at": 0, "reason": ONE_RANK,
                                         "step_ms": {}}
    assert auto["lines"] == [f"algorithm='auto' chose gradient_allreduce at step 0: {ONE_RANK}",
                             "autotune: one rank: nothing to communicate, nothing to tune"], auto["lines"]
    assert result["bytegrad"]["seen"]["selection"] is None  # a fixed algorithm has no selection


def test_auto_with_one_rank_hands_over_at_once() -> None:
    """Both front doors' engine: ``auto`` on a one-rank group chooses in setup and leaves the step path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    auto = AutoAlgorithm(candidates=["bytegrad", "gradient_allreduce"])
    driver = AlgorithmDriver(model, auto, CommContext(rank=0, world_size=1, local_rank=0, local_size=1),
                             optimizers=[opt])
    assert driver.algorithm is not auto and driver.algorithm.name == "bytegrad"
    assert auto.selection == Selection.alone(["bytegrad", "gradient_allreduce"])
    assert auto.selection.line() == f"algorithm='auto' chose bytegrad at step 0: {ONE_RANK}"
    assert auto.selection.metrics() == {}
    for _ in range(3):
        opt.zero_grad()
        driver.before_forward()
        out = model(torch.randn(5, 4))
        driver.after_forward(out)
        out.square().mean().backward()
        opt.step()
    assert driver.step == 3 and auto.selection.decided_at == 0
    driver.teardown()
