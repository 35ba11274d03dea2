"""One rank of the two-node cache test (tests/integration/test_cache_two_nodes.py), run inside its node's
network namespace: ``python -m tests.integration.cache_two_nodes JOB``.

Environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` and the
node's own ``XDG_STATE_HOME``. Prints one ``RESULT {json}`` line: which samples this rank's source had to
compute (the misses) and where the job's servers are.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from bagua_lightning.client.cache.dataset import CachedDataset
from bagua_lightning.client.cache.local_server import job_servers

SAMPLES = 16


class Counting(Dataset[Any]):
    """Sample i is ``arange(4) + i``; every computation is recorded."""

    def __init__(self) -> None:
        self.computed: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        self.computed.append(int(i))
        return torch.arange(4) + i


def main(job: int) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))
    try:
        servers = job_servers(64 * 1024 * 1024, timeout_s=60)  # what hosts=None does: reported below
        source = Counting()
        ds = CachedDataset(source, dataset_name="two-nodes", hosts=None, capacity_per_node=64 * 1024 * 1024,
                           writer_buffer_size=1)
        store = ds.cache_loader.store
        if store.hosts != [(h["host"], h["port"]) for h in servers.hosts]:
            raise SystemExit(f"hosts=None gave {store.hosts}, job_servers {servers.hosts}")
        # Job 0: node 0's rank computes every sample first; job 1: node 1's rank reads first.
        first = 0 if job == 0 else 1
        for turn in (first, 1 - first):
            if rank == turn:
                values = [ds[i] for i in range(SAMPLES)]
                ds.flush()
                ok = all(torch.equal(v, torch.arange(4) + i) for i, v in enumerate(values))
            dist.barrier()
        print("RESULT " + json.dumps({"rank": rank, "computed": source.computed, "values_ok": ok,
                                      "hosts": servers.hosts, "started_here": servers.started_here}), flush=True)
        ds.cache_loader.store.shutdown()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
