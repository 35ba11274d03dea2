"""Jobs run as fresh processes by test_cache_reporting.py: what the cache prints while training and at exit.

Each logs to stderr at INFO level (as a training script would) and prints nothing but its own lines.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from tests.client.cache_datasets import Source


def _epochs(ds: object, epochs: int, start_method: str) -> None:
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=start_method,  # type: ignore[arg-type]
                        persistent_workers=False)  # new workers every epoch, as by default
    for _ in range(epochs):
        n = sum(len(labels) for _images, labels, _extra in loader)
        assert n == len(ds), n  # type: ignore[arg-type]


def outages(port: int, state: str, start_method: str, phases: int = 3) -> None:
    """Two epochs with the server down, two with it up, two down again (the first ``phases`` of these): each
    outage reported once, and its end."""
    from bagua_lightning.client import CachedDataset
    from bagua_lightning.client.cache import OutagePolicy
    from bagua_lightning.services.redis_cluster import ClusterSpec, start_cluster, stop_cluster

    fast = OutagePolicy(retry_initial_s=0.05, retry_max_s=0.2)
    ds = CachedDataset(Source(32), dataset_name=f"reported-{start_method}", hosts=[f"127.0.0.1:{port}"],
                       outage_policy=fast, retries=0, connect_timeout_s=0.5, writer_buffer_size=1)
    spec = ClusterSpec(nodes=1, cluster=False, port=port, state_root=Path(state))
    try:
        print("phase: down", file=sys.stderr, flush=True)
        _epochs(ds, 2, start_method)
        if phases == 1:
            return
        start_cluster(spec)
        # Back for a while before the next epoch: its new workers, which never met the outage, end it once no
        # process has failed for twice the longest back-off.
        time.sleep(2 * fast.retry_max_s + 0.1)
        print("phase: up", file=sys.stderr, flush=True)
        _epochs(ds, 2, start_method)
        stop_cluster(port, Path(state))
        print("phase: down again", file=sys.stderr, flush=True)
        _epochs(ds, 2, start_method)
    finally:
        stop_cluster(port, Path(state))


def exit_after_outage(hosts: str) -> None:
    """Entries wait in the write buffer when the process exits with its Redis gone: the exit flush is quiet."""
    from bagua_lightning.client import CachedDataset

    ds = CachedDataset(Source(8), dataset_name="exit-quiet", writer_buffer_size=10_000, hosts=hosts.split(","),
                       retries=0, connect_timeout_s=0.5)
    ds._len = 10**9  # no "full pass" flush: the entries stay buffered until exit
    for i in range(8):
        ds[i]
    assert len(ds.cache_loader._buffer) == 8
    print("buffered", flush=True)
    sys.stdin.readline()  # the test stops the server, then lets this process exit


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    fn = {"outages": outages, "exit_after_outage": exit_after_outage}[sys.argv[1]]
    fn(*[int(a) if a.isdigit() else a for a in sys.argv[2:]])  # type: ignore[operator]
