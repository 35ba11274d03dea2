"""Per-step overhead of ``with_bagua`` on a tiny model, against plain torch DDP.

Bagua's own test model (``Linear 2->10->50->4``, batch 4): compute and communication are next to nothing,
so the step time is the framework's own work per step (hooks, Python per parameter, synchronisations).
Bagua's implementation took ~1-2 ms per step there on GPUs.

    python benchmarks/step_overhead.py                       # 2 Gloo ranks on CPU, every algorithm
    python benchmarks/step_overhead.py --variants ddp,gradient_allreduce --rounds 500
    python benchmarks/step_overhead.py --profile bytegrad    # cProfile of rank 0's steps of one variant

Every variant owns its copy of the same model (same initial weights, same batches) in one process per
rank; each round runs one step of every variant in an order shuffled per round, the same on every rank
(``benchmarks/interleaved.py``). Reported: median ms per step and the speed against DDP with its 95 %
bootstrap interval. ``--profile NAME`` instead runs ``--rounds`` steps of that variant alone under
cProfile on rank 0 and prints the top functions by internal and cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved import interleave, slowest_rank, speeds

ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam", "async")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=True)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


def _algorithm(name: str, model: nn.Module) -> tuple[Any, torch.optim.Optimizer]:
    from bagua_lightning.torch_api.algorithms import (
        async_model_average,
        bytegrad,
        decentralized,
        gradient_allreduce,
    )
    from bagua_lightning.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if name == "qadam":
        opt = QAdamOptimizer(model.parameters(), warmup_steps=10)
        return QAdamAlgorithm(opt, hierarchical=False), opt
    make = {
        "gradient_allreduce": lambda: gradient_allreduce.GradientAllReduceAlgorithm(),
        "bytegrad": lambda: bytegrad.ByteGradAlgorithm(hierarchical=False),
        "decentralized": lambda: decentralized.DecentralizedAlgorithm(hierarchical=False),
        "low_precision_decentralized": lambda: decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False),
        "async": lambda: async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=20),
    }
    if name not in make:
        raise ValueError(f"unknown variant {name!r}; choose ddp or one of {', '.join(ALGORITHMS)}")
    return make[name](), opt


class Variant:
    """One variant's model, optimizer and batches; :meth:`step` runs one training step."""

    def __init__(self, name: str, device: torch.device, seed: int) -> None:
        torch.manual_seed(0)
        model = Net().to(device)
        self.name = name
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device
        if name == "ddp":
            self.model: nn.Module = nn.parallel.DistributedDataParallel(model)
            self.opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        else:
            algorithm, self.opt = _algorithm(name, model)
            self.model = model.with_bagua([self.opt], algorithm)  # type: ignore[operator]
            if name == "async":
                self._bagua().bagua_algorithm.resume(self.model)

    def step(self) -> None:
        data = torch.randn(4, 2, generator=self.gen).to(self.device)
        target = torch.randn(4, 4, generator=self.gen).to(self.device)
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(data), target)
        loss.backward()
        self.opt.step()

    def _bagua(self) -> Any:
        """The module ``with_bagua`` wrapped, with Bagua's attributes (``bagua_algorithm``, ...)."""
        return self.model

    def close(self) -> None:
        if self.name == "async":
            self._bagua().bagua_algorithm.abort(self.model)
        if self.name != "ddp":
            self._bagua()._bagua_teardown()


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import bagua_lightning.torch_api as bagua

    bagua.init_process_group()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = [args.profile] if args.profile else args.variants.split(",")
    variants = {n: Variant(n, device, seed=rank) for n in names}
    for v in variants.values():
        for _ in range(args.warmup):
            v.step()
    result: dict[str, Any]
    if args.profile:
        v = variants[args.profile]
        prof = cProfile.Profile()
        sync()
        prof.enable()
        for _ in range(args.rounds):
            v.step()
        sync()
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        result = {"profile": out.getvalue()}
    else:
        times = slowest_rank(interleave({n: v.step for n, v in variants.items()}, args.rounds, sync=sync),
                             device if cuda else None)
        result = {"speeds": [s.to_json() | {"variant": s.variant, "row": s.row()}
                             for s in speeds(times, names[0])]}
    for v in variants.values():
        v.close()
    dist.barrier()
    if rank == 0:
        if args.profile:
            print(result["profile"])
        else:
            print(f"{world} ranks, {'cuda' if cuda else 'cpu'}, {args.rounds} interleaved rounds, "
                  f"baseline {names[0]}")
            for s in result["speeds"]:
                print(s["row"])
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    os._exit(0)  # the engine's daemon threads are done; skip interpreter teardown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--variants", default="ddp," + ",".join(ALGORITHMS), help="first one is the baseline")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--profile", default="", help="profile this one variant on rank 0 instead")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default="")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(args.ranks, _free_port(), args), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
