"""Fault-tolerant training across nodes: run once per node under torchrun; kill a node, start it again.

    bagua-lightning lighthouse --port 29510 &                     # the coordinator, once per job
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    BAGUA_LIGHTNING_NODE_ID=node0 torchrun --nproc-per-node 2 --master-port 29620 \\
        -m bagua_lightning.examples.elastic_train --out /tmp/ft &
    BAGUA_LIGHTNING_NODE_ID=node1 torchrun --nproc-per-node 2 --master-port 29621 \\
        -m bagua_lightning.examples.elastic_train --out /tmp/ft &

Each rank appends one JSON line per committed step to ``OUT/<node>-<rank>.jsonl`` (the step, the nodes
of its quorum, the sample indices it trained on and those of the whole step) and writes its final weights to
``OUT/<node>-<rank>.final.pt`` (tensors only). The tests and ``benchmarks/failover_training.py`` run it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..engine.algorithms.base import get_algorithm_class
from ..engine.elastic import ElasticTraining
from ..engine.fault_tolerance import ElasticSampler, FaultTolerance, Membership


def _data(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    return x, x @ w / dim**0.5 + 0.1 * torch.randn(n, 1, generator=g)


def _check_ranks(model: nn.Module, node: str, step: int) -> None:
    """Raise on every rank whose weights differ from its node's local rank 0's (a collective of the node)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    first = mine.clone()
    dist.broadcast(first, src=0)
    differs = torch.tensor([0 if torch.equal(mine, first) else 1])
    dist.all_reduce(differs)
    if int(differs):
        raise RuntimeError(f"{node}: {int(differs)} rank(s) hold weights that differ from local rank 0's after "
                           f"step {step} (this rank {dist.get_rank()}: max difference "
                           f"{float((mine - first).abs().max()):.3g})")


def node_arguments(description: str, *, hidden: int) -> argparse.ArgumentParser:
    """The options every elastic example's node takes (each example adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--samples", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds of simulated compute per step")
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=hidden)
    return p


def main(argv: list[str] | None = None) -> int:
    p = node_arguments(__doc__.splitlines()[0], hidden=64)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--algorithm", default="gradient_allreduce")
    p.add_argument("--check-ranks", action="store_true",
                   help="after every committed step, fail loudly unless the node's ranks hold equal weights")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bagua_lightning").setLevel(logging.INFO)  # membership changes, healing

    if "MASTER_PORT" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    node = os.environ.get("BAGUA_LIGHTNING_NODE_ID", "node0")
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / f"{node}-{rank}.jsonl"

    torch.manual_seed(args.seed + rank + 1000 * int(node[-1]))  # different on purpose: healing makes them equal
    x, y = _data(args.samples, 16, args.seed)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    algorithm = get_algorithm_class(args.algorithm)()
    sampler = ElasticSampler(args.samples, args.batch_size, seed=args.seed)
    losses: list[float] = []

    def committed(indices: list[int], m: Membership) -> None:
        if args.check_ranks:
            _check_ranks(model, node, m.step)
        with record.open("a") as f:
            f.write(json.dumps({"step": m.step, "count": m.count, "nodes": list(m.nodes), "indices": indices,
                                "step_indices": sampler.step_indices(m, world),
                                "loss": losses[-1] if losses else None, "t": time.time()}) + "\n")

    config = FaultTolerance(min_nodes=args.min_nodes, timeout_s=args.timeout, quorum_timeout_s=args.quorum_timeout)
    training = ElasticTraining(model, optimizer, algorithm, sampler, config, on_commit=committed)
    loss_fn = nn.MSELoss()
    try:
        while sampler.epoch < args.epochs:
            for indices in training.epoch():
                loss = loss_fn(training.model(x[indices]), y[indices])
                loss.backward()
                losses.append(float(loss))
                time.sleep(args.step_sleep)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   args.out / f"{node}-{rank}.final.pt")
        if hasattr(algorithm, "peer_weights"):  # a weight algorithm: the last committed step's average
            torch.save([t.detach().clone() for t in algorithm.peer_weights], args.out / f"{node}-{rank}.peer.pt")
        print(f"{node}/{rank}: done at step {training.model.driver.step}, redone {training.steps_redone}", flush=True)
    finally:
        training.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
