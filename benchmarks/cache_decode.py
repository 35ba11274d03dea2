"""What decoding costs a cached batch, without the network: sealed (aes256-gcm) against unkeyed (xxh3) entries.

A batch of CIFAR-sized samples (3x32x32 float32 and a label), encoded both ways, lies evenly in one writable
receive buffer as a fetch leaves it (``resp.Replies`` with its run); every round copies each batch back into
its buffer (a sealed batch is decrypted in place) and times ``codec.decode_many`` of both, in a shuffled
order (../shared/MEASURING.md). Prints the median per sample of each and k/c = median(c) / median(k) with a
95 % bootstrap interval over the rounds (paired), then with ``--profile`` where the time goes (cProfile,
tottime per sample). The read path's other half (send, receive, parse) costs keyed and unkeyed reads alike:
``benchmarks/cache_throughput.py --variants c,k`` measures the whole.

With the native loop available (client/cache/native_gcm.py), a third variant (kp) opens the same sealed batch
through cryptography's call per entry, so the loop's gain is measured in the same rounds.

    python benchmarks/cache_decode.py [--batch-size 64] [--rounds 400] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bagua_lightning.client.cache import batch_sealed, codec, native_gcm
from bagua_lightning.client.cache.resp import Replies

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved import bootstrap_ratio  # a sibling module of the benchmarks

SECRET = b"benchmark cache key"


def batch(n: int, secret: bytes | None, shape: tuple[int, ...] = (3, 32, 32)) -> tuple[
        list[bytes], bytearray, int, int, int]:
    """Keys, the replies of ``n`` entries as received (bulk headers, 16-byte aligned), where the first value
    starts, the stride and the entry's size."""
    keys = [b"bench:n4096:%d" % (1000 + i) for i in range(n)]
    entries = [bytes(codec.encode((torch.rand(*shape), i % 10), k, secret=secret)) for i, k in enumerate(keys)]
    size = len(entries[0])
    head = b"$%d\r\n" % size
    pad = -len(head) % 16
    stride = len(head) + size + 2
    received = bytearray(pad + stride * n)
    at = pad
    for e in entries:
        received[at:at + stride] = head + e + b"\r\n"
        at += stride
    return keys, received, pad + len(head), stride, size


class Reader:
    """One variant: its batch as received, and a receive buffer it is copied into before each decode; with
    ``per_entry``, sealed entries open through cryptography's call per entry (the native loop turned off)."""

    def __init__(self, n: int, secret: bytes | None, per_entry: bool = False,
                 shape: tuple[int, ...] = (3, 32, 32)) -> None:
        self.secret, self.per_entry = secret, per_entry
        self.keys, self.received, self.first, self.stride, self.size = batch(n, secret, shape)
        self.buf = bytearray(len(self.received))

    def decode(self) -> float:
        self.buf[:] = self.received
        mv = memoryview(self.buf)
        at = [self.first + r * self.stride for r in range(len(self.keys))]
        values = Replies([mv[a:a + self.size] for a in at], (self.buf, self.first, self.stride, list(range(len(at)))))
        if self.per_entry:
            batch_sealed.row_opener = _no_native
        try:
            t = time.perf_counter()
            out = codec.decode_many(values, self.keys, False, self.secret)
            dt = time.perf_counter() - t
        finally:
            batch_sealed.row_opener = native_gcm.row_opener
        assert type(out[0]) is tuple and not any(type(o) is codec.Bad for o in out), out[0]
        return dt


def _no_native(key: bytes) -> None:
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--profile", action="store_true", help="then cProfile each variant over the same rounds")
    ap.add_argument("--shape", default="3,32,32",
                    help="each sample's float32 tensor (default 3,32,32: CIFAR, 12 KB; 256 gives a 1 KB entry)")
    args = ap.parse_args()
    n = args.batch_size
    shape = tuple(int(d) for d in args.shape.split(","))
    readers = {"c": Reader(n, None, shape=shape), "k": Reader(n, SECRET, shape=shape)}
    if native_gcm.available():  # the native loop against cryptography's call per entry, interleaved
        readers["kp"] = Reader(n, SECRET, per_entry=True, shape=shape)
        taken = native_gcm.worth_it(readers["k"].size)
        print(f"the native loop is {'taken' if taken else 'not taken (entries too large)'} for (k) here")
    else:
        print("the native loop is not available here (client/cache/native_gcm.py): sealed runs open per entry")
    for r in readers.values():  # warm: decoders compiled, buffers touched
        for _ in range(20):
            r.decode()
    times: dict[str, list[float]] = {name: [] for name in readers}
    pick = random.Random(0)
    for _ in range(args.rounds):
        for name in pick.sample(list(readers), len(readers)):
            times[name].append(readers[name].decode())
    print(f"decode_many of {n} entries of {readers['c'].size} / {readers['k'].size} bytes, {args.rounds} rounds; "
          f"{os.cpu_count()} cores; python {sys.version.split()[0]}")
    for name, ts in times.items():
        print(f"({name}) median {1e6 * sorted(ts)[len(ts) // 2] / n:.2f} us per sample")
    mid, low, high = bootstrap_ratio(times["c"], times["k"], paired=True)
    print(f"k/c = {mid:.3f} [{low:.3f}, {high:.3f}] (decode only)")
    if "kp" in times:
        mid, low, high = bootstrap_ratio(times["c"], times["kp"], paired=True)
        print(f"kp/c = {mid:.3f} [{low:.3f}, {high:.3f}] (sealed, one cryptography call per entry)")
        mid, low, high = bootstrap_ratio(times["kp"], times["k"], paired=True)
        print(f"speed of k over kp = {mid:.3f} [{low:.3f}, {high:.3f}] (the native loop's gain)")
    if args.profile:
        for name, r in readers.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.rounds):
                r.decode()
            prof.disable()
            out = io.StringIO()
            stats: Any = pstats.Stats(prof, stream=out)
            stats.sort_stats("tottime").print_stats(10)
            print(f"== ({name}) cProfile over {args.rounds} decodes ({args.rounds * n} samples)")
            print(out.getvalue().split("\n\n", 1)[-1].strip())


if __name__ == "__main__":
    main()
