"""Rank programs for the ``with_bagua`` tests: ``python module_workers.py CASE OUT_DIR [ARGS]``, one per rank.

Each case checks what one rank can check itself (assertions exit non-zero) and writes
``OUT_DIR/CASE-rankN.json`` for the cross-rank comparisons the test makes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bagua_lightning.torch_api as bagua
from bagua_lightning.torch_api.algorithms import AlgorithmImpl
from bagua_lightning.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua_lightning.torch_api.algorithms.base import Algorithm
from bagua_lightning.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua_lightning.torch_api.algorithms.decentralized import (
    DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
)
from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_lightning.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from bagua_lightning.torch_api.bucket import BaguaBucket
from bagua_lightning.torch_api.data_parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, hidden: int = 50) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, hidden, bias=True)
        self.fc3 = nn.Linear(hidden, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def make_algorithm(name: str, model: nn.Module, hierarchical: bool = False) -> tuple[Algorithm, torch.optim.Optimizer]:
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    algos: dict[str, Callable[[], Algorithm]] = {
        "gradient_allreduce": lambda: GradientAllReduceAlgorithm(hierarchical=hierarchical),
        "bytegrad": lambda: ByteGradAlgorithm(hierarchical=hierarchical),
        "decentralized": lambda: DecentralizedAlgorithm(hierarchical=hierarchical),
        "low_precision_decentralized": lambda: LowPrecisionDecentralizedAlgorithm(hierarchical=hierarchical),
        "async": lambda: AsyncModelAverageAlgorithm(sync_interval_ms=20),
    }
    if name == "qadam":
        opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=5)
        return QAdamAlgorithm(opt, hierarchical=hierarchical), opt
    return algos[name](), opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        data, target = torch.randn(4, 2, generator=gen), torch.randn(4, 4, generator=gen)
        opt.zero_grad()
        loss = F.mse_loss(model(data), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def case_switch(out: Path, rank: int) -> dict[str, Any]:
    """Bagua's model-switch sequence on one model; gradient_allreduce keeps replicas identical."""
    torch.manual_seed(rank)
    model = Net()
    result: dict[str, Any] = {}
    for name in ["bytegrad", "decentralized", "gradient_allreduce", "qadam", "async", "low_precision_decentralized"]:
        algo, opt = make_algorithm(name, model)
        model = model.with_bagua([opt], algo)
        assert model.bagua_algorithm is not algo and model.bagua_optimizers == [opt]
        if name == "async":
            model.bagua_algorithm.resume(model)
        train(model, opt, 12, seed=100 + rank)
        if name == "async":
            model.bagua_algorithm.abort(model)
        result[name] = flat(model).tolist()
    result["buckets"] = [len(b.tensors) for b in model.bagua_buckets]
    model._bagua_teardown()
    return result


def case_broadcast(out: Path, rank: int) -> dict[str, Any]:
    """Ranks start from different weights and momentum; after wrapping both equal rank 0's."""
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    train(model, opt, 5, seed=rank)
    model = model.with_bagua([opt], DecentralizedAlgorithm())
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    model._bagua_teardown()
    return {"params": flat(model).tolist(), "momentum": momentum.tolist()}


def case_shared(out: Path, rank: int) -> dict[str, Any]:
    """One GradientAllReduceAlgorithm object for two models (Bagua's multi-model example) vs torch's DDP."""
    res: dict[str, Any] = {}
    for kind in ("torch", "bagua"):
        torch.manual_seed(rank)
        m1, m2 = Net(), Net(hidden=30)
        o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
        if kind == "torch":
            w1, w2 = nn.parallel.DistributedDataParallel(m1), nn.parallel.DistributedDataParallel(m2)
        else:
            algorithm = GradientAllReduceAlgorithm()
            w1 = DDP(m1, optimizers=[o1], algorithm=algorithm)
            w2 = DDP(m2, optimizers=[o2], algorithm=algorithm)
            assert w1.bagua_algorithm is not w2.bagua_algorithm
        train(w1, o1, 6, seed=10 + rank)
        train(w2, o2, 6, seed=20 + rank)
        res[kind] = [flat(m1).tolist(), flat(m2).tolist()]
        if kind == "bagua":
            m1._bagua_teardown()
            m2._bagua_teardown()
    return res


class MeanImpl(AlgorithmImpl):
    """A user's algorithm: a python op that records the bucket and the engine's centralized average."""

    def __init__(self, process_group: Any, hierarchical: bool) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.seen: list[str] = []

    def init_operations(self, bagua_module: nn.Module, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_python_op(self.seen.append)
        bucket.append_centralized_synchronous_op(hierarchical=self.hierarchical, average=True)


class Mean(Algorithm):
    def __init__(self, hierarchical: bool = False) -> None:
        self.hierarchical = hierarchical

    def reify(self, process_group: Any) -> MeanImpl:
        return MeanImpl(process_group, self.hierarchical)


def case_custom(out: Path, rank: int) -> dict[str, Any]:
    """A user's AlgorithmImpl runs: its gradients are the mean of every rank's."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([opt], Mean())
    gen = torch.Generator().manual_seed(rank)
    data, target = torch.randn(4, 2, generator=gen), torch.randn(4, 4, generator=gen)
    F.mse_loss(model(data), target).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    local = Net()
    local.load_state_dict(model.state_dict())
    F.mse_loss(local(data), target).backward()
    mean = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    assert torch.allclose(grads, mean, atol=1e-7), (grads - mean).abs().max()
    assert model.bagua_algorithm.seen == [b.name for b in model.bagua_buckets], model.bagua_algorithm.seen
    model._bagua_teardown()
    return {"grads": grads.tolist()}


def case_hierarchical(out: Path, rank: int) -> dict[str, Any]:
    """Bagua's hierarchical meaning: results per algorithm for the test to compare across layouts."""
    res: dict[str, Any] = {}
    for name, hierarchical in [("gradient_allreduce", False), ("bytegrad", True),
                               ("low_precision_decentralized", True), ("decentralized", True)]:
        torch.manual_seed(0)
        model = Net()
        algo, opt = make_algorithm(name, model, hierarchical=hierarchical)
        model = model.with_bagua([opt], algo)
        train(model, opt, 8, seed=50 + rank)
        res[name] = flat(model).tolist()
        model._bagua_teardown()
    return res


def case_partial(out: Path, rank: int) -> dict[str, Any]:
    """Bagua's async test: a group without the last rank; that rank trains locally."""
    group = bagua.communication.new_group(ranks=list(range(bagua.get_world_size() - 1)))
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=20, warmup_steps=3), process_group=group)
    for _ in range(2):
        model.bagua_algorithm.resume(model)
        model.bagua_algorithm.resume(model)
        train(model, opt, 8, seed=rank)
        model.bagua_algorithm.abort(model)
        model.bagua_algorithm.abort(model)
    model._bagua_teardown()
    return {}


CASES: dict[str, Callable[[Path, int], dict[str, Any]]] = {
    "switch": case_switch,
    "broadcast": case_broadcast,
    "shared": case_shared,
    "custom": case_custom,
    "hierarchical": case_hierarchical,
    "partial": case_partial,
}

if __name__ == "__main__":
    case, out = sys.argv[1], Path(sys.argv[2])
    bagua.init_process_group()
    rank = bagua.get_rank()
    result = CASES[case](out, rank)
    (out / f"{case}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
