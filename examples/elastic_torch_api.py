"""Fault-tolerant training through Bagua's API (``torch_api``): run once per node under torchrun.

    bagua-lightning lighthouse --port 29510 &                     # the coordinator, once per job
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    BAGUA_LIGHTNING_NODE_ID=node0 torchrun --nproc-per-node 2 --master-port 29620 \\
        -m bagua_lightning.examples.elastic_torch_api --out /tmp/ft &
    BAGUA_LIGHTNING_NODE_ID=node1 torchrun --nproc-per-node 2 --master-port 29621 \\
        -m bagua_lightning.examples.elastic_torch_api --out /tmp/ft &

A Bagua script with two changes: ``with_bagua(..., fault_tolerance=FaultTolerance())`` and the loader's
``batch_sampler=model.bagua_batch_sampler(len(data), batch_size)``. Each rank appends one JSON line per
committed step to ``OUT/<node>-<rank>.jsonl`` (as ``examples/elastic_train.py`` does) and writes its final
weights to ``OUT/<node>-<rank>.final.pt``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bagua_lightning.torch_api as bagua

from ..torch_api.algorithms import gradient_allreduce
from ..torch_api.fault_tolerance import FaultTolerance
from .elastic_train import _data, node_arguments


def main(argv: list[str] | None = None) -> int:
    p = node_arguments(__doc__.splitlines()[0], hidden=32)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bagua_lightning").setLevel(logging.INFO)  # membership changes, healing

    bagua.init_process_group()  # Bagua's: Gloo on CPU
    rank = bagua.get_rank()
    node = os.environ.get("BAGUA_LIGHTNING_NODE_ID", "node0")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed + rank + 1000 * int(node[-1]))  # different on purpose: healing makes them equal
    x, y = _data(args.samples, 16, args.seed)
    data = TensorDataset(x, y)
    model: Any = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))  # with_bagua
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    config = FaultTolerance(min_nodes=args.min_nodes, timeout_s=args.timeout, quorum_timeout_s=args.quorum_timeout)
    model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm(), fault_tolerance=config)
    loader = DataLoader(data, batch_sampler=model.bagua_batch_sampler(len(data), args.batch_size, seed=args.seed))
    steps = model.bagua_fault_tolerance
    loss_fn = nn.MSELoss()
    try:
        for xb, yb in loader:
            loss = loss_fn(model(xb), yb)
            loss.backward()
            time.sleep(args.step_sleep)
            optimizer.step()  # steps only when every node finished this step; else the step is redone
            optimizer.zero_grad()
            commit = steps.last_commit
            if commit is not None:
                m = commit.membership
                with (args.out / f"{node}-{rank}.jsonl").open("a") as f:
                    f.write(json.dumps({"step": m.step, "count": m.count, "nodes": list(m.nodes),
                                        "indices": commit.indices, "step_indices": commit.step_indices,
                                        "loss": float(loss.detach()), "t": time.time()}) + "\n")
                steps.last_commit = None
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   args.out / f"{node}-{rank}.final.pt")
        print(f"{node}/{rank}: done, redone {steps.steps_redone}", flush=True)
    finally:
        model._bagua_teardown()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
