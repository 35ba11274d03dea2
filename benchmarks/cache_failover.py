"""What a dead Redis node costs the sample cache: hit rate during the outage, recovery after failover, and the
epoch time of a full outage. Starts (and always stops) its own local Redis Clusters.

Scenario 1, per replica count (--replicas, default "1,0"): a 3-master cluster with that many replicas per
master; a CachedDataset is read until every sample hits; then one master is killed with SIGKILL and the dataset
is read in epochs (shuffled batches) for --outage-s seconds. Reported: the hit rate per second and per epoch, the
time from the kill until the cluster reports the replica promoted, and the time until a second (and a whole
epoch) is back to >= 90 % hits.

Scenario 2, full outage: three variants read the same shuffled batches, one epoch each per round, in an order
shuffled every round (drift hits every variant alike): the source itself (no cache), a CachedDataset whose
cluster is up (all hits), and a CachedDataset whose cluster has been killed (every server, SIGKILL). Reported:
median epoch times and the ratios with 95 % bootstrap intervals.

    python benchmarks/cache_failover.py [--samples 3000] [--batch-size 64] [--transform-ms 1]
        [--node-timeout-ms 2000] [--outage-s 20] [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import torch
from torch.utils.data import Dataset

from bagua_lightning.client import CachedDataset
from bagua_lightning.client.cache import OutagePolicy
from bagua_lightning.services.redis_cluster import ClusterInfo, ClusterSpec, running_cluster

STORE: dict[str, Any] = {"retries": 0, "connect_timeout_s": 0.5, "socket_timeout_s": 2.0, "outage_policy": OutagePolicy()}


class Source(Dataset[Any]):
    """CIFAR-sized samples (a 3x32x32 float32 image and a label) with a per-sample cost of ``transform_ms``."""

    def __init__(self, n: int, transform_ms: float) -> None:
        self.images = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        self.transform_s = transform_ms / 1000.0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Any:
        if self.transform_s:
            time.sleep(self.transform_s)  # stands for decoding + augmentation
        return self.images[i].clone(), i


def free_block(n: int) -> int:
    """First of ``n`` consecutive free ports whose cluster bus ports (+10000) are free too."""
    for _ in range(500):
        base = random.randrange(20000, 55000 - n)
        ok = True
        for p in [base + i for i in range(n)] + [base + i + 10000 for i in range(n)]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


@contextlib.contextmanager
def cluster(root: Path, replicas: int, node_timeout_ms: int) -> Iterator[ClusterInfo]:
    spec = ClusterSpec(nodes=3, replicas=replicas, port=free_block(3 * (1 + replicas)), state_root=root,
                       node_timeout_ms=node_timeout_ms, password="bench-failover")
    with running_cluster(spec) as info:
        yield info


def epoch_batches(n: int, size: int, rng: random.Random) -> list[list[int]]:
    order = list(range(n))
    rng.shuffle(order)
    return [order[s:s + size] for s in range(0, n, size)]


def check(batch: list[int], values: list[Any], source: Source) -> None:
    for i, (image, label) in zip(batch, values, strict=True):
        if label != i or not torch.equal(image, source.images[i]):
            raise AssertionError(f"wrong sample for index {i}")


def promoted(info: ClusterInfo, dead_port: int) -> bool:
    """Whether every live node reports cluster_state ok and a replica serves slots as a master."""
    replicas = {n.port for n in info.nodes if n.role == "replica"}
    for node in info.nodes:
        if node.port == dead_port:
            continue
        try:
            with redis.Redis(host=node.host, port=node.port, password="bench-failover", socket_timeout=1) as c:
                state = c.execute_command("CLUSTER INFO")
                if not isinstance(state, dict) or str(state.get("cluster_state")) != "ok":
                    return False
                nodes = c.execute_command("CLUSTER NODES")
        except (redis.RedisError, OSError):
            return False
    return any(int(a.rsplit(":", 1)[1]) in replicas and "master" in v["flags"] and v["slots"]
               for a, v in nodes.items())


def one_master(args: argparse.Namespace, replicas: int, root: Path) -> None:
    rng = random.Random(0)
    source = Source(args.samples, args.transform_ms)
    with cluster(root, replicas, args.node_timeout_ms) as info:
        ds = CachedDataset(source, dataset_name=f"failover-{replicas}", writer_buffer_size=256, hosts=info.hosts,
                           password="bench-failover", **STORE)
        for _ in range(2):
            for b in epoch_batches(args.samples, args.batch_size, rng):
                ds.__getitems__(b)
            ds.flush()
        for node in info.masters:  # the replicas hold every entry before the kill
            with redis.Redis(host=node.host, port=node.port, password="bench-failover") as c:
                c.execute_command("WAIT", replicas, 5000)
        victim = info.masters[1]
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        seconds: dict[int, list[int]] = {}
        epochs: list[tuple[float, float, float]] = []  # (start, end, hit rate)
        promoted_at = None
        while time.monotonic() - t0 < args.outage_s:
            start, hits0, misses0 = time.monotonic() - t0, ds.stats.hits, ds.stats.misses
            for b in epoch_batches(args.samples, args.batch_size, rng):
                h = ds.stats.hits
                check(b, ds.__getitems__(b), source)
                bin_ = seconds.setdefault(int(time.monotonic() - t0), [0, 0])
                bin_[0] += ds.stats.hits - h
                bin_[1] += len(b)
            hits, misses = ds.stats.hits - hits0, ds.stats.misses - misses0
            epochs.append((start, time.monotonic() - t0, hits / (hits + misses)))
            if replicas and promoted_at is None and promoted(info, victim.port):
                promoted_at = time.monotonic() - t0
        ds.cache_loader.store.shutdown()
    print(f"\n== one master of 3 killed (SIGKILL), {replicas} replica(s) per master, "
          f"cluster-node-timeout {args.node_timeout_ms} ms ==")
    print("hit rate per second after the kill: " + " ".join(
        f"{s}s:{h / max(t, 1):.0%}" for s, (h, t) in sorted(seconds.items())))
    print("epochs (start-end s: hit rate): " + ", ".join(f"{a:.1f}-{b:.1f}: {r:.0%}" for a, b, r in epochs))
    back = next((s for s, (h, t) in sorted(seconds.items()) if t and h / t >= 0.9), None)
    back_epoch = next((b for a, b, r in epochs if r >= 0.9), None)
    if replicas:
        print(f"replica promoted (seen by the benchmark, polled once per epoch) by {promoted_at} s")
        print(f"first second with >= 90 % hits: {back} s after the kill; first whole epoch >= 90 %: ended "
              f"{back_epoch if back_epoch is None else round(back_epoch, 1)} s after the kill")
    else:
        rates = [r for _, _, r in epochs]
        print(f"hit rate per epoch during the outage: median {statistics.median(rates):.1%} "
              f"(min {min(rates):.1%}, max {max(rates):.1%})")


def bootstrap(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float, float]:
    """median(a)/median(b) and its 95 % bootstrap interval."""
    rng = random.Random(1)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                    for _ in range(n))
    return statistics.median(a) / statistics.median(b), ratios[n // 40], ratios[n - n // 40 - 1]


def full_outage(args: argparse.Namespace, root: Path) -> None:
    rng = random.Random(2)
    source = Source(args.samples, args.transform_ms)
    with cluster(root / "up", 0, args.node_timeout_ms) as up, cluster(root / "down", 0, args.node_timeout_ms) as dn:
        hit = CachedDataset(source, dataset_name="hit", writer_buffer_size=256, hosts=up.hosts,
                            password="bench-failover", **STORE)
        out = CachedDataset(source, dataset_name="out", writer_buffer_size=256, hosts=dn.hosts,
                            password="bench-failover", **STORE)
        for ds in (hit, out):
            for b in epoch_batches(args.samples, args.batch_size, rng):
                ds.__getitems__(b)
            ds.flush()
        for node in dn.nodes:
            os.kill(node.pid, signal.SIGKILL)
        variants: dict[str, Any] = {
            "no cache (source)": lambda b: [source[i] for i in b],
            "all hits": hit.__getitems__,
            "full outage": out.__getitems__,
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds + 1):  # the first round warms up every variant
            order = list(variants)
            rng.shuffle(order)
            batches = epoch_batches(args.samples, args.batch_size, rng)
            for name in order:
                t = time.perf_counter()
                for batch in batches:
                    check(batch, variants[name](batch), source)
                times[name].append(time.perf_counter() - t)
        hits_out = out.stats.hits
        for ds in (hit, out):
            ds.cache_loader.store.shutdown()
    print(f"\n== every server killed: epoch of {args.samples} samples, batch {args.batch_size}, "
          f"source {args.transform_ms} ms/sample, {args.rounds} interleaved rounds ==")
    for name, ts in times.items():
        print(f"{name:20s}: median epoch {statistics.median(ts[1:]):.3f} s")
    for x, y in (("full outage", "no cache (source)"), ("full outage", "all hits"),
                 ("no cache (source)", "all hits")):
        r, lo, hi = bootstrap(times[x][1:], times[y][1:])
        print(f"{x} / {y}: {r:.3f}x [{lo:.3f}, {hi:.3f}]")
    print(f"hits of the dead cluster's dataset while it was down: {hits_out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--transform-ms", type=float, default=1.0)
    ap.add_argument("--node-timeout-ms", type=int, default=2000)
    ap.add_argument("--outage-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replicas", default="1,0", help="replica counts of scenario 1, comma-separated")
    ap.add_argument("--skip-full-outage", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stdout)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, redis-py {redis.__version__}, "
          f"{os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        for r in (int(x) for x in args.replicas.split(",") if x):
            one_master(args, r, Path(tmp) / f"r{r}")
        if not args.skip_full_outage:
            full_outage(args, Path(tmp))


if __name__ == "__main__":
    main()
