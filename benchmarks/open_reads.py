"""What proving the server costs cached reads: sealed entries from the read ports against plaintext reads.

Two local 3-master Redis Clusters, started and stopped here: one plaintext (as deployments were before client
TLS), one as ``bagua-lightning up`` deploys it now (clients over TLS only, the deployment's CA pinned, a client
certificate and a password; each node also has its plaintext read port for the password-less reader). The
same CIFAR-sized samples (3x32x32 float32 and a label) are cached by four readers:

  (c)  plaintext cluster, no cache key (xxh3 checksums)
  (k)  plaintext cluster, the cache key: entries authenticated (gmac-aes256), what `up` deployed before TLS
  (t)  TLS cluster, the cache key, gmac entries read through the TLS client port (the previous release)
  (s)  TLS cluster, the cache key, sealed entries (aes256-gcm) read from the read ports: no secret sent

Every round reads each batch with every reader in a shuffled order (../shared/MEASURING.md), so drift falls
on all alike; a ratio is median batch time of the baseline / that of the variant (> 1: the variant reads
faster), with a 95 % bootstrap interval over the rounds (paired). The issue's goal (34): s/k >= 0.9, where
k is the plaintext reads of a deployment with a cache key (``up``'s default).

    python benchmarks/open_reads.py [--samples 4096] [--batch-size 64] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bagua_lightning.client import CachedDataset
from bagua_lightning.services.redis_cluster import ClusterSpec, running_cluster
from bagua_lightning.services.redis_tls import client_tls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_throughput import Source  # a sibling module of the benchmarks
from interleaved import bootstrap_ratio

PASSWORD = "benchmark password"
CACHE_KEY = b"benchmark cache key"
OFFSETS = (0, 10000, 20000)  # a node's port, its bus port, its read port


def free_block(n: int) -> int:
    """First of ``n`` ports free with their bus and read ports."""
    for base in range(21000, 45000 - n, 97):
        try:
            for port in [base + i + off for i in range(n) for off in OFFSETS]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")


def warmed(source: Any, batches: list[list[int]], name: str, seal: bool | None = None, **kwargs: Any
           ) -> CachedDataset:
    ds = CachedDataset(source, dataset_name=name, writer_buffer_size=len(batches[0]), **kwargs)
    if seal is not None:
        ds.cache_loader.seal = seal
    for batch in batches:
        ds.__getitems__(batch)
    ds.flush()
    ds.cache_loader.reset_stats()
    return ds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10, help="reads of every batch by every reader")
    args = ap.parse_args()
    n, bs = args.samples, args.batch_size
    order = list(range(n))
    random.Random(0).shuffle(order)
    batches = [order[i:i + bs] for i in range(0, n, bs)]
    source = Source(n, 0.0)
    times: dict[str, list[float]] = {"c": [], "k": [], "t": [], "s": []}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        plain = stack.enter_context(running_cluster(nodes=3, port=free_block(3), state_root=Path(tmp) / "plain"))
        tls_info = stack.enter_context(running_cluster(ClusterSpec(
            nodes=3, port=free_block(3), state_root=Path(tmp) / "tls", bus_tls=True, client_tls=True,
            password=PASSWORD, read_port_offset=OFFSETS[2])))
        tls = client_tls(Path(str(tls_info.tls_dir)))
        assert tls is not None
        secure: dict[str, Any] = {"hosts": tls_info.hosts, "password": PASSWORD, "tls_ca": tls.ca, "tls_cert": tls.cert,
                  "tls_key": tls.key, "cache_key": CACHE_KEY}
        readers = {
            "c": warmed(source, batches, "bench-c", hosts=plain.hosts, cache_key=b""),
            "k": warmed(source, batches, "bench-k", seal=False, hosts=plain.hosts, cache_key=CACHE_KEY),
            "t": warmed(source, batches, "bench-t", seal=False, **secure),
            "s": warmed(source, batches, "bench-s", read_port_offset=OFFSETS[2], **secure),
        }
        try:
            pick = random.Random(1)
            names = list(readers)
            for _ in range(args.rounds):
                for batch in batches:
                    for name in pick.sample(names, len(names)):
                        t = time.perf_counter()
                        readers[name].__getitems__(batch)
                        times[name].append(time.perf_counter() - t)
            for name, ds in readers.items():
                assert ds.stats.misses == 0 and ds.stats.corrupt == 0, (name, ds.stats)
            opened = readers["s"].cache_loader.store.nodes.reads.clients()  # type: ignore[attr-defined]
            assert len(opened) == 3, "(s) did not read from the three read ports"
        finally:
            for ds in readers.values():
                ds.cache_loader.cleanup()
    entry = 3 * 32 * 32 * 4
    print(f"{n} samples of {entry} bytes, batch {bs}, {args.rounds} rounds; {os.cpu_count()} cores; "
          f"python {sys.version.split()[0]}")
    for name in times:
        mid = sorted(times[name])[len(times[name]) // 2]
        print(f"({name}) median batch {1e6 * mid:7.0f} us = {bs / mid:8.0f} samples/s = {bs * entry / mid / 1e9:.2f} GB/s")
    for variant, base in (("s", "k"), ("s", "c"), ("t", "k"), ("s", "t"), ("k", "c")):
        mid, low, high = bootstrap_ratio(times[base], times[variant], paired=True)
        print(f"{variant}/{base} = {mid:.3f} [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
