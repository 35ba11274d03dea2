"""QAdam under ``with_bagua``, stepped plainly and through ``fuse_optimizer`` (run by tests.ranks.run_function)."""

from __future__ import annotations

import torch
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1), nn.Sigmoid())


def qadam_params(fused: bool, steps: int = 41, warmup_steps: int = 1) -> list[torch.Tensor]:
    """The parameters after ``steps`` steps of QAdam with_bagua (fused: every other step a ``fuse_step``)."""
    import bagua_lightning.torch_api as bagua
    from bagua_lightning.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    bagua.init_process_group()
    model = _model()
    optimizer = QAdamOptimizer(model.parameters(), warmup_steps=warmup_steps)
    model = model.with_bagua([optimizer], QAdamAlgorithm(optimizer, hierarchical=False), do_flatten=False)
    if fused:
        optimizer = bagua.contrib.fuse_optimizer(optimizer, do_flatten=True)
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2) / 10 + bagua.get_rank()
    for step in range(steps):
        optimizer.zero_grad()
        model(x).sum().backward()
        if fused and step % 2 == 0:
            optimizer.fuse_step()
        else:
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def qadam_plain_and_fused() -> list[list[torch.Tensor]]:
    """:func:`qadam_params` plain and fused, one after the other in one job (one start of the ranks)."""
    return [qadam_params(False), qadam_params(True)]
