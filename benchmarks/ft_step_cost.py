"""What fault tolerance costs per step when nothing fails: ElasticTraining against the same algorithm without it.

    python benchmarks/ft_step_cost.py                      # 2 nodes x 1 rank on CPU, Gloo, 60 rounds
    python benchmarks/ft_step_cost.py --rounds 200 --hidden 2048 --json out.json

Both variants live in the same processes (../shared/MEASURING.md): every rank holds two copies of one model
(same initial weights, same batch shapes):

- **ft**: :class:`~bagua_lightning.engine.elastic.ElasticTraining` with ``gradient_allreduce``: each step asks
  the Lighthouse for its quorum, averages every bucket across the nodes through torchft's managed allreduce,
  and commits through torchft's vote;
- **plain**: ``gradient_allreduce`` wrapped by :class:`~bagua_lightning.engine.ddp.BaguaDistributedDataParallel`,
  whose cross-node stage is an ordinary Gloo allreduce on a process group of its own (one per local rank,
  across the nodes: with one rank per node, exactly gradient_allreduce over a world of the nodes' ranks, in
  autograd's thread as the engine runs it there); no quorum, no commit, no torchft.

Each node is its own ``torchrun`` (as in production); the quorum stays the same from step to step, so no
re-quorum happens between rounds. Each round runs one step of each variant in an order shuffled the same way
on every rank; a step is timed from its start to the end of its optimizer step (the ft step's commit and
optimizer step come at the start of its next step, so each round holds one of each). Reported: the median
step per variant and speed = median(plain) / median(ft), with a 95 % bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # sibling modules of the benchmarks
from failover_training import _env, _free_port  # noqa: E402  (the nodes' environment, a free loopback port)
from interleaved import bootstrap_ratio  # noqa: E402

# ---------------------------------------------------------------------------- the ranks


def _plain_algorithm(pg: Any, nodes: int, local_size: int) -> Any:
    """gradient_allreduce whose cross-node stage is a plain Gloo allreduce on ``pg`` (no fault tolerance)."""
    import torch.distributed as dist

    from bagua_lightning.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    class PlainAcrossNodes(GradientAllReduceAlgorithm):
        def one_collective(self) -> bool:
            return local_size == 1  # then the step is the one cross-node collective, as flat gradient_allreduce

        def bucket_step(self, bucket: Any) -> Any:
            return self._then_across(super().bucket_step(bucket) if local_size > 1 else None, bucket)

        def _then_across(self, inner: Iterator[Any] | None, bucket: Any) -> Iterator[Any]:
            if inner is not None:
                yield from inner
            bucket.flat.mul_(1.0 / nodes)  # as all_reduce_ averages on Gloo: scale, then SUM
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
            yield pg.allreduce([bucket.flat], opts)

    return PlainAcrossNodes()


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    from bagua_lightning.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua_lightning.engine.comm import CommContext
    from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
    from bagua_lightning.engine.elastic import ElasticTraining
    from bagua_lightning.engine.fault_tolerance import ElasticSampler, FaultTolerance

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, local_size = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["BAGUA_LIGHTNING_NODE_ID"][-1])
    # The plain variant's cross-node groups: one per local rank, across the nodes, on the driver's store.
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"plain/{rank}", store), node, args.nodes, timedelta(seconds=60))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                             nn.ReLU(), nn.Linear(args.hidden, 1))

    steps = args.warmup + args.rounds + 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * args.nodes * local_size * args.batch_size, args.dim, generator=g)
    y = torch.randn(x.shape[0], 1, generator=g)
    loss_fn = nn.MSELoss()

    ft_model = model()
    ft_opt = torch.optim.SGD(ft_model.parameters(), lr=0.001, momentum=0.9)
    ft = ElasticTraining(ft_model, ft_opt, GradientAllReduceAlgorithm(), ElasticSampler(x.shape[0], args.batch_size),
                         FaultTolerance(min_nodes=args.nodes, timeout_s=30, quorum_timeout_s=120))
    ft_steps = ft.epoch()
    parts: dict[str, list[float]] = {"quorum": [], "commit": []}
    if args.profile:  # where the ft step's time goes: the session's two calls per step, timed
        for name, method in (("quorum", "begin_step"), ("commit", "commit")):
            def timed(call: Any = getattr(ft.session, method), into: list[float] = parts[name]) -> Any:
                t0 = time.perf_counter()
                try:
                    return call()
                finally:
                    into.append(time.perf_counter() - t0)
            setattr(ft.session, method, timed)

    plain_model = model()
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.001, momentum=0.9)
    comm = CommContext.build(local_size=local_size)
    plain = BaguaDistributedDataParallel(plain_model, _plain_algorithm(pg, args.nodes, local_size), comm,
                                         optimizers=[plain_opt])
    plain_x, plain_y = x[: args.batch_size], y[: args.batch_size]

    def ft_step() -> None:
        indices = next(ft_steps)  # commits the previous step (optimizer step), then joins this one's quorum
        loss_fn(ft.model(x[indices]), y[indices]).backward()

    def plain_step() -> None:
        loss_fn(plain(plain_x), plain_y).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=False)

    variants = {"ft": ft_step, "plain": plain_step}
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = random.Random(args.seed)  # the same order on every rank of every node
    for i in range(args.warmup + args.rounds):
        names = list(variants)
        order.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            variants[name]()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(dt)
    if rank == 0 and node == 0:
        Path(args.out).write_text(json.dumps({**times, **{f"ft_{k}": v[args.warmup:] for k, v in parts.items()}}))
    ft.close()
    plain.driver.teardown()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------- the driver


def drive(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    work = Path(tempfile.mkdtemp(prefix="ft-step-cost-"))
    store_port, lighthouse_port = _free_port(), _free_port()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)  # lives until the end
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        log = (work / "lighthouse.log").open("wb")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "bagua_lightning.cli", "lighthouse", "--port",
                                       str(lighthouse_port), "--min-nodes", str(args.nodes)], env=_env({}),
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        while b"listening" not in (work / "lighthouse.log").read_bytes():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"the lighthouse did not start; see {work / 'lighthouse.log'}")
            time.sleep(0.1)
        out = work / "times.json"
        passed = ["--worker", "--store-port", str(store_port), "--out", str(out), "--nodes", str(args.nodes),
                  "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--dim", str(args.dim),
                  "--hidden", str(args.hidden), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
                  *(["--profile"] if args.profile else [])]
        for n in range(args.nodes):
            log = (work / f"node{n}.log").open("wb")
            logs.append(log)
            env = _env({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}",
                        "BAGUA_LIGHTNING_NODE_ID": f"node{n}"})
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks_per_node),
                 "--master-port", str(_free_port()), "--max-restarts", "0", __file__, *passed],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for n, p in enumerate(procs[1:]):
            if p.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"node{n} failed; see {work / f'node{n}.log'}")
        times = json.loads(out.read_text())
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for log in logs:
            log.close()
        del store
    ft_ms, plain_ms = (statistics.median(times[k]) * 1e3 for k in ("ft", "plain"))
    speed, low, high = bootstrap_ratio(times["plain"], times["ft"], seed=0)
    print(f"{args.nodes} nodes x {args.ranks_per_node} rank(s), MLP {args.dim}-{args.hidden}-{args.hidden}-1, "
          f"batch {args.batch_size} per rank, {args.rounds} rounds")
    print(f"plain gradient_allreduce: median {plain_ms:.2f} ms/step")
    print(f"fault tolerant:           median {ft_ms:.2f} ms/step (+{ft_ms - plain_ms:.2f} ms)")
    print(f"speed (plain / ft): {speed:.3f}x [{low:.3f}, {high:.3f}] (95 % bootstrap)")
    for name in ("quorum", "commit"):
        if times.get(f"ft_{name}"):
            print(f"  of which {name}: median {statistics.median(times[f'ft_{name}']) * 1e3:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"ft_ms": ft_ms, "plain_ms": plain_ms, "speed": speed,
                                               "interval": [low, high], "times": times}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds the whole run may take")
    p.add_argument("--json", default="")
    p.add_argument("--profile", action="store_true", help="also time the ft step's quorum and commit calls")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
