"""The code-built models of the speed benchmarks (benchmarks/allreduce_vs_ddp.py) and switch_diagnose's counts."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from allreduce_vs_ddp import MLPS, SIZES, make_batches, make_model
from switch_diagnose import subnormals


def first_loss(model_name: str) -> tuple[float, float]:
    """(cross-entropy of the first batch at initialisation, ln(classes))."""
    args = argparse.Namespace(model=model_name, seq_len=32, batch_size=4)
    torch.manual_seed(0)
    model = make_model(args)
    x, y = make_batches(args, torch.device("cpu"), torch.Generator().manual_seed(1))[0]
    with torch.no_grad():
        logits = model(x)
    classes = logits.shape[-1]
    return float(nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())), math.log(classes)


@pytest.mark.parametrize("model_name", ["tiny", "wide", "mlp"])
def test_models_start_at_chance(model_name: str) -> None:
    # Logits far from chance (the tied N(0, 1) embedding gave a first loss of ~235 for 'wide') make the
    # softmax underflow into subnormal floats within a few dozen steps: CPU steps then time the
    # denormal penalty of the machine instead of the algorithm.
    loss, chance = first_loss(model_name)
    assert 0.9 * chance < loss < 1.1 * chance, (model_name, loss, chance)


def test_mlp_is_communication_heavy_and_batches_fit() -> None:
    args = argparse.Namespace(model="mlp", seq_len=32, batch_size=4)
    model = make_model(args)
    width = MLPS["mlp"][0]
    assert sum(p.numel() for p in model.parameters()) == 6 * (width * width + width)
    batches = make_batches(args, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert len(batches) == 4
    x, y = batches[0]
    assert x.shape == (4, width) and y.shape == (4,) and int(y.max()) < width
    assert "mlp" not in SIZES


def test_subnormal_count() -> None:
    tiny = torch.finfo(torch.float32).tiny
    t = torch.tensor([0.0, 1e-40, -1e-45, tiny, -tiny / 2, 1.0, float("inf")])
    assert subnormals(t) == 3
    assert subnormals(t.double()) == 0  # 1e-40 is a normal float64
    assert subnormals(torch.arange(3)) == 0  # integers have none
