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
    res: dict[str, Any] = {"params": flat(model).tolist(), "momentum": momentum.tolist()}
    # Bagua's test_broadcast_state: Adam and Rprop state through data_parallel's wrapper.
    for cls in (torch.optim.Adam, torch.optim.Rprop):
        torch.manual_seed(rank)
        model = Net()
        opt = cls(model.parameters(), lr=0.2)
        train(model, opt, 3 + rank, seed=rank)  # different step counts too
        ddp = DDP(model, optimizers=[opt], algorithm=DecentralizedAlgorithm())
        state = opt.state_dict()["state"]
        res[cls.__name__] = {
            "model": [v.reshape(-1).tolist() for _, v in sorted(ddp.state_dict().items())],
            "state": [[k, v.reshape(-1).tolist() if torch.is_tensor(v) else v] for i in sorted(state)
                      for k, v in sorted(state[i].items())],
        }
        model._bagua_teardown()
    return res


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

    def __init__(self, process_group: Any, hierarchical: bool, compression: str | None) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.compression = compression
        self.seen: list[str] = []
        self.inputs: list[int] = []
        self.steps = 0

    def init_operations(self, bagua_module: nn.Module, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_python_op(self.seen.append)
        bucket.append_centralized_synchronous_op(hierarchical=self.hierarchical, average=True,
                                                 scattergather=self.compression is not None,
                                                 compression=self.compression)

    def init_forward_pre_hook(self, bagua_module: nn.Module) -> Callable[[Any], None]:
        return lambda input: self.inputs.append(len(input))

    def init_post_optimizer_step_hook(self, bagua_module: nn.Module) -> Callable[[torch.optim.Optimizer], None]:
        def hook(optimizer: torch.optim.Optimizer) -> None:
            self.steps += 1

        return hook


class Mean(Algorithm):
    def __init__(self, hierarchical: bool = False, compression: str | None = None) -> None:
        self.hierarchical = hierarchical
        self.compression = compression

    def reify(self, process_group: Any) -> MeanImpl:
        return MeanImpl(process_group, self.hierarchical, self.compression)


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
    opt.step()
    assert model.bagua_algorithm.inputs == [1] and model.bagua_algorithm.steps == 1
    model._bagua_teardown()
    # The same with ByteGrad's compressed exchange as the bucket's operation: the mean within quantisation.
    model = model.with_bagua([opt], Mean(compression="MinMaxUInt8"))
    opt.zero_grad()
    F.mse_loss(model(data), target).backward()
    compressed = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    local = Net()
    local.load_state_dict(model.state_dict())
    F.mse_loss(local(data), target).backward()
    mean = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    assert (compressed - mean).abs().max() < 0.02 * mean.abs().max(), (compressed - mean).abs().max()
    model._bagua_teardown()
    return {"grads": grads.tolist(), "compressed": compressed.tolist()}


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
    # The same training without Bagua, from the weights the wrapped model starts with.
    ref = Net()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(2):
        model.bagua_algorithm.resume(model)
        model.bagua_algorithm.resume(model)  # twice: a no-op while running
        train(model, opt, 8, seed=rank)
        model.bagua_algorithm.abort(model)
        model.bagua_algorithm.abort(model)  # twice: a no-op once stopped
        train(ref, ref_opt, 8, seed=rank)
    model._bagua_teardown()
    # Members averaged (gradients in warm-up, then weights); the rank outside the group trained alone.
    return {"in_group": rank in group.ranks, "as_local_training": bool(torch.equal(flat(model), flat(ref)))}


def case_bucket_state(out: Path, rank: int) -> dict[str, Any]:
    """Bagua's bucket state names: decentralized ``_peer_weight``, low precision's ring replicas."""
    res: dict[str, Any] = {}
    for mode in ("all", "shift_one"):
        torch.manual_seed(rank)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model = model.with_bagua([opt], DecentralizedAlgorithm(hierarchical=False, peer_selection_mode=mode))
        # The torch reference of Bagua's test: average flat(reversed parameters) before each step.
        ref = Net()
        ref.load_state_dict(model.state_dict())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        for step in range(6):
            data, target = torch.randn(4, 2, generator=gen), torch.randn(4, 4, generator=gen)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                loss = F.mse_loss(m(data), target)
                if m is ref:
                    params = list(ref.parameters())[::-1]
                    weight = torch.cat([p.detach().reshape(-1) for p in params])
                    if mode == "all":
                        dist.all_reduce(weight)
                        weight /= dist.get_world_size()
                    else:
                        n = dist.get_world_size()
                        peer = (n // 2 + (rank + step) % (n // 2)) if rank < n // 2 else (rank - n // 2 - step) % (n // 2)
                        got, mine = torch.empty_like(weight), weight.clone()
                        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                                            dist.P2POp(dist.irecv, got, peer)]):
                            work.wait()
                        weight = (got + weight) / 2
                loss.backward()
                if m is ref:
                    with torch.no_grad():
                        offset = 0
                        for p in params:
                            p.copy_(weight[offset:offset + p.numel()].view_as(p))
                            offset += p.numel()
                o.step()
        peer_weight = model.bagua_buckets[0]._peer_weight
        assert torch.allclose(peer_weight, weight, atol=1e-6), (peer_weight - weight).abs().max()
        assert torch.allclose(flat(model), flat(ref), atol=1e-6)
        res[mode] = peer_weight.tolist()
        model._bagua_teardown()
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([opt], LowPrecisionDecentralizedAlgorithm(hierarchical=False))
    bucket = model.bagua_buckets[0]
    train(model, opt, 6, seed=rank)
    res["low_precision"] = {k: float(getattr(bucket, k).norm()) for k in ("_weight", "_left_peer_weight",
                                                                           "_right_peer_weight")}
    model._bagua_teardown()
    return res


def case_unused(out: Path, rank: int) -> dict[str, Any]:
    """Bagua's data_parallel find_unused_parameters check: only the graph's parameters are communicated."""
    from bagua_lightning.torch_api.data_parallel.distributed import DistributedDataParallel_V1_9_0

    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(2, 10, bias=False)
            self.fc2 = nn.Linear(10, 4, bias=False)
            self.fc3 = nn.Linear(4, 4, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Module]:
            return F.softmax(F.relu(self.fc2(F.relu(self.fc1(x)))), dim=1), self.fc3

    res: dict[str, Any] = {}
    torch.manual_seed(rank)
    for find in (True, False):
        ddp = DistributedDataParallel_V1_9_0(Partial(), process_group=dist.group.WORLD, find_unused_parameters=find)
        out_, _ = ddp(torch.rand(4, 2))
        F.cross_entropy(out_, torch.tensor([0, 1, 2, 3])).backward()
        res[str(find)] = sorted(n for n, _ in ddp.inner.bagua_build_params())
        res[f"grad{find}"] = ddp.module.fc1.weight.grad.reshape(-1).tolist()
        ddp.module._bagua_teardown()
    return res


def case_acceptance(out: Path, rank: int) -> dict[str, Any]:
    """A Bagua-style script: an MLP on an in-code dataset with each algorithm, and torch's DDP on the same seed."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=gen)
    y = (x @ torch.randn(8, 1, generator=gen)).tanh() + 0.05 * torch.randn(512, 1, generator=gen)
    shard = slice(rank * 256 // dist.get_world_size() * 2, (rank + 1) * 256 // dist.get_world_size() * 2)
    xs, ys = x[shard], y[shard]

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def run(wrap: Callable[[nn.Module, torch.optim.Optimizer], nn.Module], adam: bool = False) -> float:
        model = mlp()
        opt: torch.optim.Optimizer = (QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=20) if adam
                                      else torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9))
        wrapped = wrap(model, opt)
        for _ in range(4):
            for i in range(0, xs.shape[0], 16):
                opt.zero_grad()
                F.mse_loss(wrapped(xs[i:i + 16]), ys[i:i + 16]).backward()
                opt.step()
        with torch.no_grad():
            loss = F.mse_loss(model(x), y)
        dist.all_reduce(loss)
        if hasattr(model, "_bagua_teardown"):
            model._bagua_teardown()
        return float(loss) / dist.get_world_size()

    res = {"ddp": run(lambda m, o: nn.parallel.DistributedDataParallel(m))}
    algorithms: dict[str, Callable[[torch.optim.Optimizer], Algorithm]] = {
        "gradient_allreduce": lambda o: GradientAllReduceAlgorithm(),
        "bytegrad": lambda o: ByteGradAlgorithm(),
        "decentralized": lambda o: DecentralizedAlgorithm(),
        "low_precision_decentralized": lambda o: LowPrecisionDecentralizedAlgorithm(),
        "async": lambda o: AsyncModelAverageAlgorithm(sync_interval_ms=5),
        "bytegrad_flat": lambda o: ByteGradAlgorithm(hierarchical=False),
        "decentralized_flat": lambda o: DecentralizedAlgorithm(hierarchical=False),
        "low_precision_decentralized_flat": lambda o: LowPrecisionDecentralizedAlgorithm(hierarchical=False),
    }
    for name, make in algorithms.items():
        res[name] = run(lambda m, o, make=make: m.with_bagua([o], make(o)))  # type: ignore[misc]
    res["ddp_adam"] = run(lambda m, o: nn.parallel.DistributedDataParallel(m), adam=True)
    res["qadam"] = run(lambda m, o: m.with_bagua([o], QAdamAlgorithm(o)), adam=True)  # type: ignore[arg-type]
    res["qadam_flat"] = run(lambda m, o: m.with_bagua([o], QAdamAlgorithm(o, hierarchical=False)),  # type: ignore[arg-type]
                            adam=True)
    return res


def case_nccl_one_gpu(out: Path, rank: int) -> dict[str, Any]:
    """Every algorithm (flat and hierarchical) and a user's AlgorithmImpl through with_bagua on CUDA tensors."""
    device = torch.device("cuda", torch.cuda.current_device())
    res: dict[str, Any] = {"backend": dist.get_backend()}
    names = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam", "async"]
    for name in names:
        for hierarchical in (False, True):
            torch.manual_seed(0)
            model = Net().to(device)
            algo, opt = make_algorithm(name, model, hierarchical=hierarchical)
            model = model.with_bagua([opt], algo)
            gen = torch.Generator(device=device).manual_seed(1)
            for _ in range(12):
                data = torch.randn(4, 2, generator=gen, device=device)
                target = torch.randn(4, 4, generator=gen, device=device)
                opt.zero_grad()
                F.mse_loss(model(data), target).backward()
                opt.step()
            if name == "async":
                model.bagua_algorithm.abort(model)
            weights = flat(model)
            assert weights.is_cuda and torch.isfinite(weights).all(), name
            res[f"{name}/{hierarchical}"] = weights.cpu().tolist()
            model._bagua_teardown()
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([opt], Mean(hierarchical=True))
    F.mse_loss(model(torch.randn(4, 2, device=device)), torch.randn(4, 4, device=device)).backward()
    assert model.bagua_algorithm.seen == [b.name for b in model.bagua_buckets]
    model._bagua_teardown()
    torch.cuda.synchronize()
    return res


class WithExpert(nn.Module):
    """A shared layer and an "expert" layer whose weight is this rank's own (``weight.expert = True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(2, 8)
        self.expert = nn.Linear(8, 4, bias=False)
        self.expert.weight.expert = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(F.relu(self.shared(x)))


def case_experts(out: Path, rank: int) -> dict[str, Any]:
    """Expert parameters are neither broadcast nor communicated, in every algorithm."""
    res: dict[str, Any] = {}
    for name in ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam", "async"]:
        torch.manual_seed(rank)  # different shared and expert weights per rank before wrapping
        model = WithExpert()
        before = model.expert.weight.detach().clone()
        algo, opt = make_algorithm(name, model)
        model = model.with_bagua([opt], algo)
        assert torch.equal(model.expert.weight, before), name  # not broadcast
        train(model, opt, 8, seed=rank)
        if name == "async":
            model.bagua_algorithm.abort(model)
        res[name] = {"expert": model.expert.weight.reshape(-1).tolist(),
                     "shared": torch.cat([p.detach().reshape(-1) for p in model.shared.parameters()]).tolist()}
        model._bagua_teardown()
    return res


class _MeanGradient(torch.autograd.Function):
    """Identity forward; backward averages the gradient over the default group (as SyncBatchNorm's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class Synced(nn.Module):
    """Linear layers with a main-thread collective in each layer's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _MeanGradient.apply(torch.tanh(layer(x)))
        return x


def case_backward_collectives(out: Path, rank: int) -> dict[str, Any]:
    """Collectives of the main thread during backward next to the engine's communication thread (Gloo)."""
    os.environ["BAGUA_DEFAULT_BUCKET_SIZE"] = str(16 * 17 * 4)  # one bucket per layer: the thread is busy
    res: dict[str, Any] = {}
    for name in ("gradient_allreduce", "bytegrad"):
        torch.manual_seed(0)
        model, ref = Synced(), Synced()
        ref.load_state_dict(model.state_dict())
        algo = GradientAllReduceAlgorithm() if name == "gradient_allreduce" else ByteGradAlgorithm(hierarchical=False)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        model = model.with_bagua([opt], algo)
        assert len(model.bagua_buckets) == 6
        gen = torch.Generator().manual_seed(rank)
        for _ in range(12):
            data, target = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                F.mse_loss(m(data), target).backward()
                if m is ref:
                    for p in ref.parameters():
                        dist.all_reduce(p.grad)  # type: ignore[arg-type]
                        p.grad /= dist.get_world_size()  # type: ignore[operator]
                o.step()
        diff = float((flat(model) - flat(ref)).abs().max())
        assert diff < (1e-5 if name == "gradient_allreduce" else 0.05), (name, diff)
        res[name] = diff
        model._bagua_teardown()
    return res


CASES: dict[str, Callable[[Path, int], dict[str, Any]]] = {
    "backward_collectives": case_backward_collectives,
    "experts": case_experts,
    "nccl_one_gpu": case_nccl_one_gpu,
    "bucket_state": case_bucket_state,
    "unused": case_unused,
    "acceptance": case_acceptance,
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
