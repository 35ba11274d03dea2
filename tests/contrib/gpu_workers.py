"""One-GPU NCCL rank program: Bagua's fused-optimizer-with-wrapper check, all its optimizer settings."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.optim as optim

import bagua_lightning.torch_api as bagua
from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

CASES: list[tuple[type[optim.Optimizer], dict[str, Any]]] = [
    (optim.Adam, dict(weight_decay=1.0, amsgrad=True)), (optim.Adam, dict(weight_decay=0.0)),
    (optim.AdamW, dict(weight_decay=1.0, amsgrad=True)), (optim.AdamW, dict(weight_decay=0.0)),
    (optim.SGD, dict(lr=0.2, momentum=1, dampening=0, weight_decay=1, nesterov=True)),
    (optim.SGD, dict(lr=0.2, momentum=1, dampening=0.5, weight_decay=1, nesterov=False)),
    (optim.RMSprop, dict(weight_decay=1, momentum=1, centered=True)),
    (optim.RMSprop, dict(weight_decay=0, momentum=1, centered=False)),
    (optim.Rprop, dict(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50))),
    (optim.ASGD, dict(weight_decay=1)), (optim.Adamax, dict(weight_decay=1)), (optim.Adadelta, dict(weight_decay=1)),
]


def run(cls: type[optim.Optimizer], kwargs: dict[str, Any], fused: bool, wrap: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                                torch.nn.Sigmoid()).cuda()
    opt = cls(model.parameters(), **kwargs)  # type: ignore[call-arg]
    if wrap:
        model.with_bagua([opt], GradientAllReduceAlgorithm(), do_flatten=True)
    if fused:
        bagua.contrib.fuse_optimizer(opt, do_flatten=True)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], device="cuda").reshape(3, 2)
    for _ in range(20):
        opt.zero_grad()
        model(x).sum().backward()
        opt.fuse_step() if fused else opt.step()  # type: ignore[attr-defined]
    return [p.detach().clone() for p in model.parameters()]


if __name__ == "__main__":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    bagua.init_process_group()
    assert dist.get_backend() == "nccl"
    for cls, kwargs in CASES:
        ref = run(cls, kwargs, fused=False, wrap=False)
        got = run(cls, kwargs, fused=True, wrap=True)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (cls.__name__, kwargs)
        print(f"fused {cls.__name__} {kwargs} ok", flush=True)
    dist.destroy_process_group()
