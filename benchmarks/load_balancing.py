"""Per-step straggling with variable-length samples: load-balancing samplers against ``DistributedSampler``.

A dataset of sequences with log-normal lengths (long tail) is read by ``--world`` Gloo ranks, ``--batch``
samples per rank and step, through (a) ``DistributedSampler`` and (b) ``LoadBalancingDistributedSampler`` +
``LoadBalancingDistributedBatchSampler``. Reported for both, in the same run:

- per step, the slowest rank's work / the mean rank's work (work = tokens, or tokens**--power), averaged
  over the epoch's steps and its 95th percentile: 1.0 means no rank waits;
- the epoch time of a length-proportional model on real ranks: every step a rank computes for
  ``work * --us-per-token`` microseconds (``--compute sleep``, immune to other load on the machine; or
  ``matmul``: a real ``Linear`` over ``tokens`` rows) and then all-reduces a gradient-sized tensor, so the
  step ends when the slowest rank is done, as in data-parallel training::

    python benchmarks/load_balancing.py                      # 4 ranks, 8192 samples
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data.distributed import DistributedSampler

from bagua_lightning.engine.contrib.load_balancing import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)


def lengths(args: argparse.Namespace) -> list[int]:
    g = torch.Generator().manual_seed(args.seed)
    ln = torch.exp(torch.randn(args.samples, generator=g) * args.sigma + args.mu)
    return [max(1, int(v)) for v in ln.round().tolist()]


def batches(kind: str, rank: int, args: argparse.Namespace, lens: list[int]) -> list[list[int]]:
    """Rank ``rank``'s batches for epoch ``args.epoch``."""
    if kind == "distributed":
        s: DistributedSampler[int] = DistributedSampler(range(len(lens)), num_replicas=args.world,  # type: ignore[arg-type]
                                                        rank=rank, seed=args.seed)
        s.set_epoch(args.epoch)
        idx = list(s)
        return [idx[i : i + args.batch] for i in range(0, len(idx) - args.batch + 1, args.batch)]
    lb = LoadBalancingDistributedSampler(lens, complexity_fn=float, num_replicas=args.world, rank=rank,  # type: ignore[arg-type]
                                         seed=args.seed, random_level=args.random_level)
    bs = LoadBalancingDistributedBatchSampler(
        lb, batch_fn=lambda ids: [ids[i : i + args.batch] for i in range(0, len(ids) - args.batch + 1, args.batch)])
    bs.set_epoch(args.epoch)
    return list(bs)


def work(batch: list[int], lens: list[int], power: float) -> float:
    return float(sum(lens[i] ** power for i in batch))


def imbalance(kind: str, args: argparse.Namespace, lens: list[int]) -> tuple[float, float, int]:
    per_rank = [batches(kind, r, args, lens) for r in range(args.world)]
    steps = min(len(b) for b in per_rank)
    ratios = []
    for k in range(steps):
        w = [work(per_rank[r][k], lens, args.power) for r in range(args.world)]
        ratios.append(max(w) / (sum(w) / len(w)))
    ratios.sort()
    return statistics.mean(ratios), ratios[int(0.95 * (len(ratios) - 1))], steps


def rank_main(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    lens = lengths(args)
    layer = torch.nn.Linear(64, 64)
    grad = torch.zeros(1 << 16)
    for kind in ("distributed", "load_balancing"):
        mine = batches(kind, rank, args, lens)
        steps = torch.tensor([len(mine)])
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        dist.barrier()
        t0 = time.perf_counter()
        for batch in mine[: int(steps)]:
            w = work(batch, lens, args.power)
            if args.compute == "sleep":
                time.sleep(w * args.us_per_token * 1e-6)
            else:
                with torch.no_grad():
                    layer(torch.ones(int(w), 64))
            dist.all_reduce(grad)
        elapsed = time.perf_counter() - t0
        if rank == 0:
            out.put((kind, elapsed, int(steps)))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--mu", type=float, default=4.0, help="log-normal location (median length e**mu)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal scale (tail weight)")
    parser.add_argument("--power", type=float, default=1.0, help="work per sample = length**power")
    parser.add_argument("--random-level", type=float, default=0.0)
    parser.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--us-per-token", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=1)
    args = parser.parse_args()
    lens = lengths(args)
    print(f"{args.samples} samples, lengths log-normal(mu={args.mu}, sigma={args.sigma}): median "
          f"{statistics.median(lens):.0f}, mean {statistics.mean(lens):.0f}, max {max(lens)}; {args.world} ranks x "
          f"{args.batch} samples per step; work = length**{args.power}; random_level {args.random_level}")
    stats = {kind: imbalance(kind, args, lens) for kind in ("distributed", "load_balancing")}
    for kind, (mean, p95, steps) in stats.items():
        print(f"  {kind:15s} slowest/mean rank work per step: mean {mean:.3f}, p95 {p95:.3f} ({steps} steps)")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(args, free_port(), queue), nprocs=args.world, start_method="spawn")
    times = {}
    while not queue.empty():
        kind, elapsed, steps = queue.get()
        times[kind] = elapsed
        print(f"  {kind:15s} epoch on {args.world} Gloo ranks ({args.compute}): {elapsed:.2f} s, {steps} steps")
    print(f"max/mean: load_balancing {stats['load_balancing'][0]:.3f} vs DistributedSampler "
          f"{stats['distributed'][0]:.3f}; epoch time DistributedSampler / load_balancing "
          f"{times['distributed'] / times['load_balancing']:.2f}x")


if __name__ == "__main__":
    main()
