"""What fault tolerance costs per step when nothing fails: interleaved against the same algorithm without it.

    python benchmarks/ft_step_cost.py                      # 2 nodes x 1 rank on CPU (Gloo), 200 rounds
    python benchmarks/ft_step_cost.py --hidden 1024 --rounds 300 --json out.json

Both variants live in the same processes (one per node, each its own torchrun) and train copies of the
same model on the same batches with gradient_allreduce:

* ``ft``: :class:`~bagua_lightning.engine.elastic.ElasticTraining`: per step a quorum from the Lighthouse,
  the cross-node allreduce through torchft's manager, the commit;
* ``plain``: the same bucket steps with the cross-node allreduce issued straight on the same torchft
  process group (no quorum, no commit, no managed work): the algorithm without fault tolerance over the
  same transport.

Each round runs one step of each in an order shuffled per round (the same on both nodes), rank 0 of node0
times them, and the result is ``median(plain) / median(ft)`` with its 95 % bootstrap interval
(benchmarks/interleaved.py; ../shared/MEASURING.md).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from failover_training import _env, _free_port, _Proc, _wait_for
from interleaved import speeds


class _PlainCross:
    """The cross-node stage without fault tolerance: a SUM allreduce on the same process group, averaged."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def allreduce(self, tensor: torch.Tensor) -> Any:
        manager = self.session.manager
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        tensor.div_(manager.num_participants())
        return manager._pg.allreduce([tensor], opts)


def worker(args: argparse.Namespace) -> None:
    from bagua_lightning.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua_lightning.engine.comm import CommContext
    from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
    from bagua_lightning.engine.elastic import ElasticTraining
    from bagua_lightning.engine.fault_tolerance import ElasticSampler, FaultTolerance

    torch.manual_seed(0)
    dim = 16
    x = torch.randn(args.batch_size * 64, dim)
    y = torch.randn(args.batch_size * 64, 1)
    model = nn.Sequential(nn.Linear(dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 1))
    twin = copy.deepcopy(model)
    opt_ft = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_plain = torch.optim.SGD(twin.parameters(), lr=1e-3)
    sampler = ElasticSampler(10**9, args.batch_size, shuffle=False)
    training = ElasticTraining(model, opt_ft, GradientAllReduceAlgorithm(), sampler, FaultTolerance(min_nodes=2, timeout_s=30))  # both nodes in every step
    plain_algo = GradientAllReduceAlgorithm()
    plain_algo.cross_node = _PlainCross(training.session)  # type: ignore[assignment]
    plain = BaguaDistributedDataParallel(twin, plain_algo, CommContext(rank=0, world_size=1, local_rank=0,
                                                                       local_size=1), optimizers=[opt_plain])
    loss_fn = nn.MSELoss()
    steps = training.epoch()

    def ft_step() -> None:
        indices = next(steps)  # commits the previous step, starts this one's quorum
        i = [j % len(x) for j in indices]
        loss_fn(training.model(x[i]), y[i]).backward()

    def plain_step() -> None:
        i = list(range(args.batch_size))
        loss_fn(plain(x[i]), y[i]).backward()
        opt_plain.step()
        opt_plain.zero_grad(set_to_none=False)

    variants = {"plain": plain_step, "ft": ft_step}
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = random.Random(1)
    for r in range(args.warmup + args.rounds):
        names = list(variants)
        order.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            variants[name]()
            if r >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1000.0)
    if os.environ.get("BAGUA_LIGHTNING_NODE_ID") == "node0":
        Path(args.out).write_text(json.dumps(times))
    steps.close()
    training.close()
    plain.teardown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="ft-step-cost-") as tmp:
        work = Path(tmp)
        port = _free_port()
        procs = [_Proc([sys.executable, "-m", "bagua_lightning.cli", "lighthouse", "--port", str(port), "--min-nodes", "2"], _env({}),
                       work / "lighthouse.log")]
        try:
            _wait_for(lambda: b"listening" in (work / "lighthouse.log").read_bytes(), 60, "the lighthouse")
            for i in range(2):
                env = _env({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "BAGUA_LIGHTNING_NODE_ID": f"node{i}"})
                procs.append(_Proc([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                    "--master-port", str(_free_port()), "--max-restarts", "0", __file__, "--worker",
                                    "--out", str(work / "times.json"), "--hidden", str(args.hidden),
                                    "--batch-size", str(args.batch_size), "--rounds", str(args.rounds),
                                    "--warmup", str(args.warmup)], env, work / f"node{i}.log"))
            codes = [proc.wait(1800) for proc in procs[1:]]
            if codes != [0, 0]:
                logs = "\n".join((work / f"node{i}.log").read_text()[-3000:] for i in range(2))
                raise subprocess.SubprocessError(f"exit codes {codes}\n{logs}")
            times = json.loads((work / "times.json").read_text())
        finally:
            for proc in reversed(procs):
                proc.kill()
    result = speeds(times, baseline="plain")
    params = 16 * args.hidden + args.hidden * args.hidden + 2 * args.hidden + args.hidden + 1
    print(f"2 nodes x 1 rank, cpu, gloo, {params / 1e6:.2f} M parameters, {args.rounds} interleaved rounds")
    for s in result:
        print(f"{s.variant:>8}: {s.median_ms:8.2f} ms/step  {s.ratio:.3f}x [{s.low:.3f}, {s.high:.3f}]  {s.verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(s) for s in result]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
