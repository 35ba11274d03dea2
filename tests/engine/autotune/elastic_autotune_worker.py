"""One rank of a fault-tolerant job with autotuning (``ElasticTraining(..., autotune=...)``), under torchrun.

    python -m torch.distributed.run --nproc-per-node 2 elastic_autotune_worker.py --out DIR --address HOST:PORT

Each rank appends one JSON line per committed step to ``DIR/<node>-<rank>.jsonl``: the step, the quorum's
nodes and the plan in use (version and layout fingerprint), so the test can compare nodes step by step.
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

from bagua_lightning.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_lightning.engine.autotune import AutotuneSettings
from bagua_lightning.engine.elastic import ElasticTraining
from bagua_lightning.engine.fault_tolerance import ElasticSampler, FaultTolerance, Membership

MODEL = "elastic-autotune-net"
JOB = "ft-autotune-job"


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--address", required=True)
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.1)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bagua_lightning").setLevel(logging.INFO)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = os.environ["BAGUA_LIGHTNING_NODE_ID"]
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / f"{node}-{rank}.jsonl"
    torch.manual_seed(rank + 1000 * int(node[-1]))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=g)
    y = x.sum(1, keepdim=True) / 4
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = ElasticSampler(args.samples, 4)
    holder: list[ElasticTraining] = []

    def committed(indices: list[int], m: Membership) -> None:
        plan = holder[0].model.driver.bucket_plan
        version = holder[0].autotune.version if holder[0].autotune is not None else -1
        with record.open("a") as f:
            f.write(json.dumps({"step": m.step, "count": m.count, "nodes": list(m.nodes), "version": version,
                                "plan": plan.fingerprint() if plan else "", "t": time.time()}) + "\n")

    settings = AutotuneSettings(address=args.address, interval=args.interval, rpc_timeout_s=2.0, model_name=MODEL,
                                job_id=JOB)
    training = ElasticTraining(model, optimizer, GradientAllReduceAlgorithm(), sampler,
                               FaultTolerance(timeout_s=5, quorum_timeout_s=30), on_commit=committed,
                               autotune=settings)
    holder.append(training)
    try:
        for indices in training.epoch():
            nn.functional.mse_loss(training.model(x[indices]), y[indices]).backward()
            time.sleep(args.step_sleep)
        print(f"{node}/{rank}: done at step {training.model.driver.step}", flush=True)
    finally:
        training.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
