"""Sample-cache read throughput over a local 3-master Redis Cluster (started and stopped by this script).

Variants, all on the same samples (a 3x32x32 float32 image and an int label, as in CIFAR):
  (a) source: the dataset itself, with a per-sample transform of --transform-ms (sleep)
  (b) Bagua-style reader: one GET + pickle.loads per sample (RedisCluster.get)
  (c) ours: CachedDataset.__getitems__ on shuffled batches (pipelined, grouped by node, checksummed decode)
  (d) raw ceiling: RedisCluster.mget_nonatomic of the same entries, no decoding (redis-py alone)
  (d') transport floor: hand-written per-node GET pipelines of the same entries through redis-py, no decoding
  (h) hiredis ceiling: the same pipelines on raw sockets, replies parsed by hiredis in bulk, no decoding
  (k) ours with a cache key: (c) with entries sealed with it (aes256-gcm, as `bagua-lightning up` configures;
      benchmarks/open_reads.py compares them read from the read ports with the earlier gmac entries)
  (t) ours over TLS: (c) against a second 3-master cluster that serves clients over TLS only, with a client
      certificate and a password, the server verified against its CA (as `bagua-lightning up` deploys it);
      each node's replies of a batch decrypted on its own thread (the store's opt-in
      ``decrypt_threads``; --decrypt-threads auto: as the store reads by default, the same as (t1))
  (t1) (t) with the reading thread decrypting every node's replies itself (the same dataset and connections)
Prints samples/s and the ratios c/b, c/d, c/d', c/h, c/a, k/c, and which parser redis-py uses. With (c) and (k)
both run, k/c is also measured batch by batch (../shared/MEASURING.md): every round reads each batch with both,
in a shuffled order, and k/c = median batch time of (c) / that of (k), with a 95 % bootstrap interval; the same
again with the reading thread's CPU time instead of the clock ("client CPU"): what the reader itself spends,
which a loaded machine does not blur with waits for the redis-servers to be scheduled, and the bound on k/c
where the reader is the bottleneck (redis-servers on other cores). The same for t/c with (t) run, and then
also (t)'s limit: each batch's reply bytes decrypted from memory by an SSLObject (tls_floor.py), timed in the
same shuffled rounds; a batch decrypted on one thread costs at least (c) plus that, so t1/c can be at most
median(c) / median(c + floor), and median(c + floor) / median(t) says how far (t), decrypting on as many
threads as there are nodes, passes it (> 1: beyond the one-thread limit). With (t1) run too: t/t1 per batch.

    python benchmarks/cache_throughput.py [--samples 4096] [--batch-size 64] [--transform-ms 2] [--variants c,k]

The cost of the cache key in one line (what docs/benchmarks.md reports):

    python benchmarks/cache_throughput.py --variants c,k --repeats 15

The cost of TLS on the client ports (goal >= 0.9x), and what decrypting on a thread per node gains:

    python benchmarks/cache_throughput.py --variants c,t,t1 --repeats 15
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import random
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from redis.cluster import RedisCluster
from redis.crc import key_slot
from torch.utils.data import Dataset

from bagua_lightning.client import CachedDataset, RedisStore
from bagua_lightning.client.cache import batch_sealed, codec, digests, native_gcm
from bagua_lightning.client.cache.resp import pack_gets
from bagua_lightning.services.redis_cluster import ClusterSpec, running_cluster
from bagua_lightning.services.redis_tls import client_tls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved import bootstrap_ratio  # a sibling module of the benchmarks
from tls_floor import DecryptFloor

hiredis: Any
try:
    import hiredis
except ImportError:
    hiredis = None


class Source(Dataset[Any]):
    def __init__(self, n: int, transform_ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, 32, 32, generator=g)
        self.transform_s = transform_ms / 1000.0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.transform_s)  # stands for decoding + augmentation
        return self.images[i].clone(), i


class OneThread:
    """(t1): the TLS dataset of (t) read with the reading thread decrypting every node's replies itself."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitems__(self, batch: list[int]) -> Any:
        held = self.dataset.cache_loader.store.nodes.held
        threads, held.decrypt_threads = held.decrypt_threads, False
        try:
            return self.dataset.__getitems__(batch)
        finally:
            held.decrypt_threads = threads


def free_block(n: int) -> int:
    for base in range(30000, 55000 - n, 97):
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


def rate(fn: Callable[[], int], repeats: int) -> float:
    """Best samples/s over ``repeats`` runs of ``fn`` (which returns how many samples it read)."""
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        n = fn()
        best = max(best, n / (time.perf_counter() - t))
    return best


def profile_reads(readers: list[tuple[str, Any]], batches: list[list[int]], passes: int) -> dict[str, str]:
    """Where the reading thread's time goes: ``passes`` passes over every batch of each reader under cProfile,
    the functions of most own time (tottime) per sample, for (c) and (k) (``--profile``)."""
    import cProfile
    import io
    import pstats

    out: dict[str, str] = {}
    samples = passes * sum(map(len, batches))
    for name, reader in readers:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(passes):
            for batch in batches:
                reader.__getitems__(batch)
        prof.disable()
        stats: Any = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])  # (file, line, name) -> (cc, nc, tt, ct)
        total = sum(v[2] for _, v in rows)
        text = io.StringIO()
        text.write(f"== ({name}) cProfile, {passes} passes, {samples} samples: {1e6 * total / samples:.2f} us of "
                   "own time per sample in all; the largest (us per sample, calls per sample):\n")
        for (file, line_no, func), (_, calls, tottime, *_) in rows[:14]:
            where = func if file == "~" else f"{Path(file).name}:{line_no}({func})"
            text.write(f"  {1e6 * tottime / samples:6.2f}  {calls / samples:5.2f}  {where}\n")
        out[name] = text.getvalue().rstrip()
    return out


class PerEntry:
    """A sealed dataset read with the native loop turned off: cryptography's call per entry (variant kp)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitems__(self, indices: list[int]) -> Any:
        batch_sealed.row_opener = lambda key: None
        try:
            return self.dataset.__getitems__(indices)
        finally:
            batch_sealed.row_opener = native_gcm.row_opener


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--transform-ms", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--profile", type=int, default=0, metavar="PASSES",
                    help="then cProfile (c) and (k) over PASSES passes each: where the reading thread's time goes")
    ap.add_argument("--decrypt-threads", choices=("auto", "on"), default="on",
                    help="(t): with a decrypting thread per node (on, the default), or as the store reads by "
                         "default (auto: one thread decrypts, as (t1))")
    ap.add_argument("--variants", default="a,b,c,k,d,dp,h",
                    help="comma-separated subset of a,b,c,k,kp,t,t1,d,dp,h to run (c,k: the cost of the cache "
                         "key; kp: (k) with cryptography's call per entry in place of the native loop; c,t,t1: "
                         "the cost of TLS)")
    args = ap.parse_args()
    run = set(args.variants.split(","))
    unknown = run - {"a", "b", "c", "k", "kp", "t", "t1", "d", "dp", "h"}
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; choose among a,b,c,k,kp,t,t1,d,dp,h")
    tls_run = run & {"t", "t1"}
    n, bs = args.samples, args.batch_size
    order = list(range(n))
    random.Random(0).shuffle(order)
    batches = [order[i:i + bs] for i in range(0, n, bs)]

    with tempfile.TemporaryDirectory() as tmp, \
            running_cluster(nodes=3, port=free_block(3), state_root=Path(tmp)) as info, \
            contextlib.ExitStack() as more:
        print(f"3-master Redis Cluster on {info.hosts_string}; {n} samples, batch {bs}")
        tls_info = None
        if tls_run:  # a second cluster, as `up` deploys it: TLS only on the client ports, certificate, password
            tls_info = more.enter_context(running_cluster(ClusterSpec(
                nodes=3, port=free_block(3), state_root=Path(tmp) / "tls", bus_tls=True, client_tls=True,
                password="benchmark password")))
            print(f"3-master Redis Cluster over TLS on {tls_info.hosts_string}")
        source = Source(n, args.transform_ms)
        rc = RedisCluster(host=info.nodes[0].host, port=info.nodes[0].port)

        # (a) the source with its transform (a slice: it is slow)
        part = order[: max(bs, n // 16)]
        r_a = rate(lambda: len([source[i] for i in part]), 1) if "a" in run else 0.0

        # (b) Bagua-style: pickled samples, one GET per sample
        if "b" in run:
            for batch in batches:
                rc.mset_nonatomic({f"bagua_{i}": pickle.dumps(source.images[i].clone(), protocol=4) for i in batch})

        def bagua() -> int:
            for i in order:
                pickle.loads(rc.get(f"bagua_{i}"))  # type: ignore[arg-type]  # the insecure baseline
            return n

        # (c) ours, cache warmed by a first pass
        source.transform_s = 0.0
        ds = CachedDataset(source, dataset_name="bench", hosts=info.hosts, writer_buffer_size=bs)
        for batch in batches:
            ds.__getitems__(batch)
        ds.flush()
        ds.cache_loader.reset_stats()

        def ours() -> int:
            for batch in batches:
                ds.__getitems__(batch)
            return n

        keyed = CachedDataset(source, dataset_name="bench-keyed", hosts=info.hosts, writer_buffer_size=bs,
                              cache_key=b"benchmark cache key")
        for batch in batches:
            keyed.__getitems__(batch)
        keyed.flush()

        def ours_keyed() -> int:
            for batch in batches:
                keyed.__getitems__(batch)
            return n

        # (t) ours over TLS: the deployment's CA pinned, a client certificate, the password sent after the proof
        tls_ds: Any = None
        if tls_info is not None:
            tls = client_tls(Path(str(tls_info.tls_dir)))
            assert tls is not None
            tls_ds = CachedDataset(source, dataset_name="bench-tls", hosts=tls_info.hosts, writer_buffer_size=bs,
                                   password="benchmark password", tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key)
            for batch in batches:
                tls_ds.__getitems__(batch)
            tls_ds.flush()
            tls_ds.cache_loader.reset_stats()
            held = tls_ds.cache_loader.store.nodes.held
            if args.decrypt_threads == "on":
                held.decrypt_threads = True
            print(f"(t) decrypts with a thread per node: {held.decrypt_threads} ({os.cpu_count()} cores, "
                  f"--decrypt-threads {args.decrypt_threads})")

        def ours_tls() -> int:
            for batch in batches:
                tls_ds.__getitems__(batch)
            return n

        one_thread = OneThread(tls_ds)

        def ours_tls_one_thread() -> int:
            for batch in batches:
                one_thread.__getitems__(batch)
            return n

        # (d) redis-py alone: pipelined multi-gets of the same entries
        key_batches = [[ds.cache_loader.redis_key(i) for i in b] for b in batches]

        def raw_mget() -> int:
            for keys in key_batches:
                rc.mget_nonatomic(keys)
            return n

        # (d') hand-written per-node pipelines: the transport floor
        def raw_pipelines() -> int:
            for keys in key_batches:
                by_node: dict[str, tuple[Any, list[str]]] = {}
                for k in keys:
                    node = rc.nodes_manager.get_node_from_slot(key_slot(k.encode()))
                    by_node.setdefault(node.name, (node, []))[1].append(k)
                sent = []
                for node, ks in by_node.values():
                    conn = node.redis_connection.connection_pool.get_connection()
                    conn.send_packed_command(conn.pack_commands([("GET", k) for k in ks]))
                    sent.append((node, conn, ks))
                for node, conn, ks in sent:
                    for _ in ks:
                        conn.read_response()
                    node.redis_connection.connection_pool.release(conn)
            return n

        # (h) raw sockets + hiredis: what any client must at least spend (send, receive, parse)
        socks: dict[str, tuple[socket.socket, Any]] = {}
        for node in rc.get_primaries():
            sock = socket.create_connection((node.host, node.port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[node.name] = (sock, hiredis.Reader() if hiredis is not None else None)
        slot_node = [rc.nodes_manager.get_node_from_slot(s).name for s in range(16384)]
        buf = bytearray(1 << 20)

        def raw_hiredis() -> int:
            for keys in key_batches:
                grouped: dict[str, list[bytes]] = {}
                for k in keys:
                    raw = k.encode()
                    grouped.setdefault(slot_node[key_slot(raw)], []).append(raw)
                for name, ks in grouped.items():
                    socks[name][0].sendall(pack_gets(ks))
                for name, ks in grouped.items():
                    sock, reader = socks[name]
                    got = 0
                    while got < len(ks):
                        r = reader.gets()
                        if r is False:
                            m = sock.recv_into(buf)
                            reader.feed(buf, 0, m)
                        else:
                            got += 1
            return n

        # Interleaved rounds, best of each: other load on the machine hits every variant alike.
        best = {"b": 0.0, "c": 0.0, "k": 0.0, "t": 0.0, "t1": 0.0, "d": 0.0, "dp": 0.0, "h": 0.0}
        variants: list[tuple[str, Callable[[], int]]] = [
            ("b", bagua), ("c", ours), ("k", ours_keyed), ("t", ours_tls), ("t1", ours_tls_one_thread),
            ("d", raw_mget), ("dp", raw_pipelines)]
        if hiredis is not None:
            variants.append(("h", raw_hiredis))
        variants = [(name, fn) for name, fn in variants if name in run]
        k_over_c, t_over_c = [], []  # per round: rounds are seconds apart, so each sees one state of the machine
        for _ in range(args.repeats):
            round_rate = {}
            for name, fn in random.sample(variants, len(variants)):
                round_rate[name] = rate(fn, 1)
                best[name] = max(best[name], round_rate[name])
            if "c" in round_rate and "k" in round_rate:
                k_over_c.append(round_rate["k"] / round_rate["c"])
            if "c" in round_rate and "t" in round_rate:
                t_over_c.append(round_rate["t"] / round_rate["c"])
        batch_times: dict[str, list[float]] = {"c": [], "k": [], "kp": [], "t": [], "t1": [], "x": []}
        batch_cpu: dict[str, list[float]] = {"c": [], "k": [], "kp": [], "t": [], "t1": [], "x": []}
        # the process's, every thread (the native loop opens large batches in runs on other threads)
        batch_all_cpu: dict[str, list[float]] = {"c": [], "k": [], "kp": [], "t": [], "t1": []}
        readers: list[tuple[str, Any]] = [(name, reader) for name, reader in (
            ("c", ds), ("k", keyed), ("kp", PerEntry(keyed)), ("t", tls_ds), ("t1", one_thread)) if name in run]
        # The limit of (t): (c) plus decrypting the batch's reply bytes from memory (tls_floor.py), timed beside.
        floor = DecryptFloor() if tls_run and "c" in run else None
        store = ds.cache_loader.store
        batch_bytes = [sum(len(v) + len(b"$%d\r\n\r\n" % len(v)) for v in store.mget(keys) if v is not None)
                       for keys in key_batches] if floor is not None else []
        if floor is not None:
            readers.append(("x", None))
        if "c" in run and len(readers) > 1:  # k/c and t/c batch by batch, the variants of a batch moments apart
            pick = random.Random(0)
            for _ in range(args.repeats):
                for j, batch in enumerate(batches):
                    for name, reader in pick.sample(readers, len(readers)):
                        if reader is None:  # the decrypt floor of this batch's bytes
                            clock, spent = floor.time(batch_bytes[j])  # type: ignore[union-attr]
                            batch_times[name].append(clock)
                            batch_cpu[name].append(spent)
                            continue
                        t, cpu, all_cpu = time.perf_counter(), time.thread_time(), time.process_time()
                        reader.__getitems__(batch)
                        batch_times[name].append(time.perf_counter() - t)
                        batch_cpu[name].append(time.thread_time() - cpu)
                        if name in batch_all_cpu:
                            batch_all_cpu[name].append(time.process_time() - all_cpu)
        profiles = profile_reads([(name, reader) for name, reader in readers if name in ("c", "k")], batches,
                                 args.profile) if args.profile else {}
        r_b, r_c, r_k, r_d, r_dp, r_h = best["b"], best["c"], best["k"], best["d"], best["dp"], best["h"]
        stats = ds.stats
        paired = 1 + bool(run & {"k", "t", "t1"})
        profiled = n * args.profile * ("c" in profiles)  # the profiled passes' reads
        assert stats.misses == 0 and stats.hits == n * args.repeats * ("c" in run) * paired + profiled, stats
        assert keyed.stats.corrupt == 0, keyed.stats
        for name in profiles:
            print(profiles[name])
        tls_cipher = "-"
        if tls_ds is not None:
            held = tls_ds.cache_loader.store.nodes.held._local.held.conns.values()
            tls_cipher = ", ".join(sorted({f"{type(conn._sock).__name__} {conn._sock.cipher()[0]}" for _, conn in held}))
            assert tls_ds.stats.misses == 0 and tls_ds.stats.hits == n * args.repeats * paired * len(tls_run), \
                tls_ds.stats
            tls_ds.cache_loader.cleanup()
        for sock, _ in socks.values():
            sock.close()
        rc.close()
        RedisStore(hosts=info.hosts).shutdown()

    keyed_kind = codec.DIGEST_NAMES[digests.keyed_digest_kind()]

    def line(label: str, r: float) -> None:
        print(f"{label:31s}: {r:10.0f} samples/s" if r else f"{label:31s}: (not run)")

    line(f"(a) source, {args.transform_ms:g} ms transform", r_a)
    line("(b) Bagua-style GET+unpickle", r_b)
    line("(c) CachedDataset batches", r_c)
    line("(k) CachedDataset, cache key", r_k)
    line("(t) CachedDataset over TLS", best["t"])
    line("(t1) (t), one decrypting thread", best["t1"])
    line("(d) redis-py mget_nonatomic", r_d)
    line("(d') per-node GET pipelines", r_dp)
    line("(h) raw sockets + hiredis" if hiredis is not None else "(h) hiredis not installed", r_h)
    parser = "hiredis" if hiredis is not None else "pure Python (install hiredis)"
    digest = codec.DIGEST_NAMES[codec.default_digest_kind()]
    print(f"redis-py parser: {parser}; unkeyed digest: {digest}; keyed digest: {keyed_kind}; "
          f"python {sys.version.split()[0]}; {os.cpu_count()} cores")

    def ratio(a: float, b: float, digits: int = 2, unit: str = "") -> str:
        return f"{a / b:.{digits}f}{unit}" if a and b else "-"

    print(f"c/b = {ratio(r_c, r_b, 1, 'x')} (goal >= 10x)   c/d' = {ratio(r_c, r_dp, 2)} (goal >= 0.85)   "
          f"c/d = {ratio(r_c, r_d, 2)}   c/a = {ratio(r_c, r_a, 1, 'x')}   c/h = {ratio(r_c, r_h, 2)}")
    if k_over_c:
        k_over_c.sort()
        print(f"k/c = {ratio(r_k, r_c, 2)} (best of each; goal >= 0.85)   per round: median "
              f"{k_over_c[len(k_over_c) // 2]:.2f}, range {k_over_c[0]:.2f}-{k_over_c[-1]:.2f} "
              f"({len(k_over_c)} rounds)")
    if t_over_c:
        t_over_c.sort()
        print(f"t/c = {ratio(best['t'], r_c, 2)} (best of each; goal >= 0.9)   per round: median "
              f"{t_over_c[len(t_over_c) // 2]:.2f}, range {t_over_c[0]:.2f}-{t_over_c[-1]:.2f} ({len(t_over_c)} rounds)")

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    for name in ("t", "t1"):
        if not batch_times[name] or not batch_times["c"]:
            continue
        mid, low, high = bootstrap_ratio(batch_times["c"], batch_times[name])
        print(f"{name}/c per batch = {mid:.3f} [{low:.3f}, {high:.3f}] (95 % interval; median batch time (c) "
              f"{1e6 * median(batch_times['c']):.0f} us, ({name}) {1e6 * median(batch_times[name]):.0f} us; "
              f"{len(batch_times[name])} batches each; goal >= 0.9)")
        mid, low, high = bootstrap_ratio(batch_cpu["c"], batch_cpu[name])
        print(f"{name}/c per batch, reading thread's CPU = {mid:.3f} [{low:.3f}, {high:.3f}] (median CPU per sample "
              f"(c) {1e6 * median(batch_cpu['c']) / bs:.2f} us, ({name}) {1e6 * median(batch_cpu[name]) / bs:.2f} us; "
              f"all threads ({name}) {1e6 * median(batch_all_cpu[name]) / bs:.2f} us)")
    if batch_times["t"] and batch_times["t1"]:
        mid, low, high = bootstrap_ratio(batch_times["t1"], batch_times["t"])
        print(f"t/t1 per batch = {mid:.3f} [{low:.3f}, {high:.3f}] (what a decrypting thread per node gains; "
              f"{os.cpu_count()} cores)")
    if batch_times["x"]:
        limit = [c + x for c, x in zip(batch_times["c"], batch_times["x"], strict=True)]
        limit_cpu = [c + x for c, x in zip(batch_cpu["c"], batch_cpu["x"], strict=True)]
        x_mid = median(batch_times["x"])
        print(f"decrypt floor ({floor.cipher if floor else '?'} from memory): median {1e6 * x_mid:.0f} us per batch of "
              f"{sum(batch_bytes) / len(batch_bytes) / 1e3:.0f} KB ({sum(batch_bytes) / len(batch_bytes) / x_mid / 1e9:.2f}"
              f" GB/s); decrypting on one thread, t/c can be at most "
              f"{bootstrap_ratio(batch_times['c'], limit)[0]:.3f} (clock), "
              f"{bootstrap_ratio(batch_cpu['c'], limit_cpu)[0]:.3f} (client CPU); reads over TLS: {tls_cipher}")
        for name in ("t", "t1"):
            if batch_times[name]:
                mid, low, high = bootstrap_ratio(limit, batch_times[name])
                print(f"{name} against that limit, median(c + floor) / median({name}) = {mid:.3f} [{low:.3f}, "
                      f"{high:.3f}] (clock; 1: at the one-thread limit, > 1: beyond it)")
    if batch_times["k"]:
        mid, low, high = bootstrap_ratio(batch_times["c"], batch_times["k"])
        print(f"k/c per batch = {mid:.3f} [{low:.3f}, {high:.3f}] (95 % interval; median batch time (c) "
              f"{1e6 * sorted(batch_times['c'])[len(batch_times['c']) // 2]:.0f} us, (k) "
              f"{1e6 * sorted(batch_times['k'])[len(batch_times['k']) // 2]:.0f} us; "
              f"{len(batch_times['k'])} batches each; goal >= 0.85)")
        mid, low, high = bootstrap_ratio(batch_cpu["c"], batch_cpu["k"])
        print(f"k/c per batch, client CPU = {mid:.3f} [{low:.3f}, {high:.3f}] (median CPU per sample (c) "
              f"{1e6 * sorted(batch_cpu['c'])[len(batch_cpu['c']) // 2] / bs:.2f} us, (k) "
              f"{1e6 * sorted(batch_cpu['k'])[len(batch_cpu['k']) // 2] / bs:.2f} us)")
    if batch_times["kp"] and batch_times["k"]:
        mid, low, high = bootstrap_ratio(batch_times["c"], batch_times["kp"])
        print(f"kp/c per batch = {mid:.3f} [{low:.3f}, {high:.3f}] (sealed, cryptography's call per entry; median "
              f"(kp) {1e6 * median(batch_times['kp']):.0f} us)")
        mid, low, high = bootstrap_ratio(batch_times["kp"], batch_times["k"])
        taken = "taken" if native_gcm.available() and native_gcm.worth_it(12_400) else "not taken"
        print(f"k over kp per batch = {mid:.3f} [{low:.3f}, {high:.3f}] (the native loop's gain, clock; "
              f"{taken} for CIFAR samples here)")
        for name in ("c", "k", "kp"):
            print(f"all threads' CPU per sample ({name}): {1e6 * median(batch_all_cpu[name]) / bs:.2f} us")


if __name__ == "__main__":
    main()
