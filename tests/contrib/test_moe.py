"""MoE with experts sharded over real Gloo ranks equals one process holding every expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bagua_lightning.engine.contrib.moe import MoE, TopKGate, is_moe_param, top1gating
from tests.ranks import run_ranks

WORKER = str(Path(__file__).with_name("workers.py"))


@pytest.mark.parametrize(("world", "k"), [(2, 1), (2, 2), (4, 1)])
def test_sharded_experts_match_one_process(tmp_path: Path, world: int, k: int) -> None:
    out = run_ranks(WORKER, ["moe", "--backend", "gloo", "--k", str(k)], world_size=world, log_dir=tmp_path,
                    timeout_s=120)
    assert out.count("moe ok") == world


def test_single_process_layer_marks_experts_and_balances() -> None:
    torch.manual_seed(0)
    layer = MoE(4, torch.nn.Linear(4, 4), num_local_experts=3, k=2)
    x = torch.randn(5, 6, 4)
    out, l_aux, counts = layer(x)
    assert out.shape == x.shape and counts.tolist() and int(counts.sum()) == 30
    assert l_aux.item() > 0
    experts = [p for p in layer.parameters() if is_moe_param(p)]
    assert len(experts) == 6 and all(getattr(p, "allreduce", True) is False for p in experts)


def test_top1_capacity_and_mask() -> None:
    logits = torch.zeros(8, 2)
    logits[:, 0] = 5.0  # every token wants expert 0
    _, _, dispatch, counts = top1gating(logits, capacity_factor=0.5, min_capacity=3)
    assert counts.tolist() == [8, 0]
    assert int(dispatch.sum()) == 3  # capacity max(ceil(8 / 2 * 0.5), 3) = 3
    used = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])
    _, _, dispatch, counts = top1gating(logits, 1.0, 3, used_token=used)
    assert counts.tolist() == [2, 0] and int(dispatch.sum()) == 2


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="k=3"):
        TopKGate(4, 2, k=3)
    with pytest.raises(ValueError, match="Gumbel"):
        MoE(4, torch.nn.Linear(4, 4), noisy_gate_policy="Gumbel")
    with pytest.raises(ValueError, match="min_capacity"):
        MoE(4, torch.nn.Linear(4, 4))(torch.randn(2, 4))
