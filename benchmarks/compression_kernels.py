"""MinMax uint8 compression on one GPU: the fused Triton kernels against the torch-op path and a copy.

::

    python benchmarks/compression_kernels.py                     # buckets of 1/25/100/420 MiB, 2/4/8 chunks
    python benchmarks/compression_kernels.py --model 100m        # + per-step overhead on the 110M model

For each fp32 bucket size and chunk count it times, with CUDA events (warm-up, then
the median of ``--repeats`` runs):

* ``copy``: a device-to-device copy of the bucket (the bandwidth reference);
* ``compress``: ours (``kernels.compress``) and the torch-op path (extrema, header, scale, cast);
* ``decompress``: ours (``kernels.decompress``) and the torch-op path;
* ``owner``: bytegrad's owner step with as many ranks as chunks (decompress every
  received chunk, sum, recompress): ours (``kernels.reduce_compressed``) and torch ops.

"of copy" is the bandwidth a pass achieves over the copy's: a compression moves
``4 + 4 + 1`` bytes per value (values read twice, a level written), a decompression
``1 + 4``, the owner step ``2 * chunks + 1`` bytes per value of its chunk (every received
level read twice, a level written), the copy ``4 + 4``. ``x torch`` is the torch-op path's
time over ours. "host" is the host time of one call (a tiny input, no GPU wait): when it
exceeds the GPU's time, calls queued back to back run at the host's pace.

``--model``: one GPU trains the Transformer of ``allreduce_vs_ddp.py`` (AdamW) with its
gradients in flat buckets, and each step runs bytegrad's compressed exchange on every bucket
over a 1-rank NCCL group (compress, all-to-all, owner step, all-gather, decompress: all the
compression work of a step, no network), with the kernels and with the torch-op path; the
overhead per step is the difference to the same step without the exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bagua_lightning.engine import compressed_comm as comm_module
from bagua_lightning.engine import kernels
from bagua_lightning.engine.chunk_format import HEADER_BYTES
from bagua_lightning.engine.compression import ChunkRanges, dequantise_into, read_header

MIB = 1 << 20


def timed(fn: Callable[[], Any], warmup: int, repeats: int, batch: int = 1) -> float:
    """Median milliseconds per call of ``fn``: ``repeats`` times, ``batch`` calls between two CUDA events.

    ``batch=1`` is the latency of one call, the host's launch work included (the GPU
    waits for it). A larger batch queues calls back to back, so the host's launch work
    of a call overlaps the GPU work of the previous one: the GPU's own time per call,
    what a pass costs when it is queued behind other work (as in a backward pass).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def host_us(fn: Callable[[], Any], calls: int = 200, rounds: int = 5) -> float:
    """Microseconds of host time per call: the median of ``rounds`` rounds of ``calls`` calls.

    Launch work only (a tiny input, synchronised once per round); the median of several
    rounds, as the host's speed wanders between rounds (other processes, clocks).
    """
    fn()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_round.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_round)


def torch_compress(x: torch.Tensor, chunks: int, out: torch.Tensor) -> None:
    """The torch-op path of ``compress_chunks`` on CUDA (what ran there before the kernels)."""
    rows = x.view(chunks, -1)
    ranges = ChunkRanges.of(rows)
    ranges.write_header(out[:, :HEADER_BYTES])
    ranges.quantise_into(rows, out[:, HEADER_BYTES:])


def torch_decompress(packed: torch.Tensor, out: torch.Tensor) -> None:
    mins, maxs = read_header(packed)
    dequantise_into(packed[:, HEADER_BYTES:], mins, maxs, out.view(packed.shape[0], -1))


def torch_owner(received: torch.Tensor, scale: float, mine: torch.Tensor, scratch: torch.Tensor,
                out: torch.Tensor) -> None:
    mins, maxs = read_header(received)
    comm_module._sum_levels(received[:, HEADER_BYTES:], mins, maxs, scale, mine, scratch)
    own = ChunkRanges.of(mine.view(1, -1))
    own.write_header(out[:, :HEADER_BYTES])
    own.quantise_into(mine.view(1, -1), out[:, HEADER_BYTES:], overwrite_input=True)


def micro(sizes_mib: list[float], chunk_counts: list[int], warmup: int, repeats: int,
          batch: int) -> list[dict[str, Any]]:
    rows = []
    for mib in sizes_mib:
        numel = int(mib * MIB) // 4 // 64 * 64  # divisible by every chunk count
        x = torch.randn(numel, device="cuda") * torch.linspace(0.1, 10, numel, device="cuda")
        dst = torch.empty_like(x)
        t_copy = timed(lambda: dst.copy_(x), warmup, repeats, batch)  # noqa: B023
        copy_bw = 8 * numel / t_copy
        for chunks in chunk_counts:
            n = numel // chunks
            packed = torch.empty(chunks, HEADER_BYTES + n, dtype=torch.uint8, device="cuda")
            ref = torch.empty_like(packed)
            out = torch.empty_like(x)
            received = torch.stack([kernels.compress(x[i * n:(i + 1) * n], 1, packed[i:i + 1].clone())[0]
                                    for i in range(chunks)])
            own = torch.empty(1, HEADER_BYTES + n, dtype=torch.uint8, device="cuda")
            mine, scratch = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
            passes: dict[str, Callable[[], Any]] = {
                "compress": lambda: kernels.compress(x, chunks, packed),  # noqa: B023
                "compress_torch": lambda: torch_compress(x, chunks, ref),  # noqa: B023
                "decompress": lambda: kernels.decompress(packed, out),  # noqa: B023
                "decompress_torch": lambda: torch_decompress(packed, dst),  # noqa: B023
                # Owner step: ``chunks`` ranks each sent one n-element chunk of the range it reduces.
                "owner": lambda: kernels.reduce_compressed(received, 1.0 / chunks, own),  # noqa: B023
                "owner_torch": lambda: torch_owner(received, 1.0 / chunks, mine, scratch, own),  # noqa: B023
            }
            row: dict[str, Any] = {"MiB": mib, "chunks": chunks, "copy_ms": t_copy}
            for name, fn in passes.items():
                row[f"{name}_ms"] = timed(fn, warmup, repeats, batch)
                row[f"{name}_latency_ms"] = timed(fn, warmup, repeats, 1)
            moved = {"compress": 9 * numel, "decompress": 5 * numel, "owner": (2 * chunks + 1) * n}
            for name, nbytes in moved.items():
                row[f"{name}_of_copy"] = nbytes / row[f"{name}_ms"] / copy_bw
                row[f"{name}_torch_of_copy"] = nbytes / row[f"{name}_torch_ms"] / copy_bw
            rows.append(row)
            print(f"{mib:>6} MiB x{chunks}: copy {t_copy:.3f} ms | " + " | ".join(
                f"{name} {row[name + '_ms']:.3f} ms ({row[name + '_of_copy']:.2f} of copy; "
                f"torch {row[name + '_torch_ms']:.3f} ms, {row[name + '_torch_ms'] / row[name + '_ms']:.1f}x; "
                f"latency {row[name + '_latency_ms']:.3f} vs {row[name + '_torch_latency_ms']:.3f} ms)"
                for name in ("compress", "decompress", "owner")), flush=True)
        torch.cuda.empty_cache()
    small = torch.randn(1024, device="cuda")
    small_copy = torch.empty_like(small)
    packed = torch.empty(4, HEADER_BYTES + 256, dtype=torch.uint8, device="cuda")
    ref = torch.empty_like(packed)
    own = torch.empty(1, HEADER_BYTES + 256, dtype=torch.uint8, device="cuda")
    kernels.compress(small, 4, packed)
    overhead = {"copy": host_us(lambda: small_copy.copy_(small)),  # one torch launch, for reference
                "compress": host_us(lambda: kernels.compress(small, 4, packed)),
                "compress_torch": host_us(lambda: torch_compress(small, 4, ref)),
                "decompress": host_us(lambda: kernels.decompress(packed, small_copy)),
                "decompress_torch": host_us(lambda: torch_decompress(packed, small_copy)),
                "owner": host_us(lambda: kernels.reduce_compressed(packed, 0.25, own)),
                # decompress's one kernel launched through Triton's JIT (what every launch cost before the
                # launchers called the compiled kernels directly), against "decompress": the whole launcher
                "decompress_jit_launch": host_us(lambda: kernels._k()._decompress_kernel[(1, 4)](
                    packed.view(torch.int32), small_copy, 256, (HEADER_BYTES + 256) // 4, BLOCK=kernels.BLOCK,
                    PACK=4, num_warps=kernels.NUM_WARPS, enable_fp_fusion=False))}
    print("host time per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items()), flush=True)
    rows.append({"host_us_per_call": overhead})
    return rows


def sweep(configs: list[tuple[int, int, int]], warmup: int, repeats: int,
          sizes_mib: tuple[int, ...] = (100, 420)) -> tuple[int, int, int]:
    """Time compress + decompress of each size in 4 chunks per (block, warps, programs per SM); the best."""
    best, best_t = configs[0], float("inf")
    for block, warps, per_sm in configs:
        kernels.BLOCK, kernels.NUM_WARPS, kernels.PROGRAMS_PER_SM = block, warps, per_sm
        total = 0.0
        for mib in sizes_mib:
            numel = mib * MIB // 4
            x = torch.randn(numel, device="cuda")
            packed = torch.empty(4, HEADER_BYTES + numel // 4, dtype=torch.uint8, device="cuda")
            t_c = timed(lambda: kernels.compress(x, 4, packed), warmup, repeats, 10)  # noqa: B023
            t_d = timed(lambda: kernels.decompress(packed, x), warmup, repeats, 10)  # noqa: B023
            total += t_c + t_d
            print(f"  block {block} warps {warps} programs/SM {per_sm}: {mib} MiB compress {t_c:.3f} ms "
                  f"decompress {t_d:.3f} ms", flush=True)
        if total < best_t:
            best, best_t = (block, warps, per_sm), total
    kernels.BLOCK, kernels.NUM_WARPS, kernels.PROGRAMS_PER_SM = best
    print(f"sweep: best block {best[0]}, warps {best[1]}, programs/SM {best[2]}", flush=True)
    return best


def model_overhead(size: str, bucket_mib: int, steps: int, batch: int, seq_len: int) -> dict[str, Any]:
    """Per-step time of the 110M model without and with the compressed exchange (kernels, torch ops)."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from allreduce_vs_ddp import SIZES, Transformer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    vocab, width, layers, heads = SIZES[size]
    torch.manual_seed(0)
    model = Transformer(vocab, width, layers, heads, seq_len).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    # Gradients as views of flat buckets of about bucket_mib (what the bucket engine does).
    flats, bucket, size_b = [], [], 0
    for p in params:
        bucket.append(p)
        size_b += p.numel() * 4
        if size_b >= bucket_mib * MIB or p is params[-1]:
            flat = torch.zeros(sum(q.numel() for q in bucket), device="cuda")
            off = 0
            for q in bucket:
                q.grad = flat[off:off + q.numel()].view_as(q)
                off += q.numel()
            flats.append(flat)
            bucket, size_b = [], 0
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    buffers = [comm_module.ExchangeBuffers() for _ in flats]
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def step(exchange: bool) -> None:
        opt.zero_grad(set_to_none=False)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), tokens.view(-1))
        loss.backward()
        if exchange:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for flat, buf in zip(flats, buffers, strict=True):
                comm_module.compressed_exchange_(flat, None, 1, scale=1.0, buffers=buf)
            end.record()
            events.append((start, end))  # read after the timed steps: no host sync inside a step
        opt.step()

    real_kernels_for = comm_module._kernels_for
    result: dict[str, Any] = {"params": sum(p.numel() for p in params), "buckets": len(flats)}
    for name, exchange, use_kernels in [("none", False, True), ("kernels", True, True), ("torch ops", True, False),
                                        ("none again", False, True)]:
        comm_module._kernels_for = real_kernels_for if use_kernels else (lambda device: False)
        events.clear()
        result[f"{name}_step_ms"] = timed(lambda: step(exchange), 3, 3, steps // 3)  # noqa: B023
        if exchange:
            torch.cuda.synchronize()
            result[f"{name}_exchange_ms"] = statistics.median(s.elapsed_time(e) for s, e in events[3:])
    comm_module._kernels_for = real_kernels_for
    base = min(result["none_step_ms"], result["none again_step_ms"])
    for name in ("kernels", "torch ops"):
        result[f"{name}_overhead_ms"] = result[f"{name}_step_ms"] - base
    print(f"model {size}: {result['params'] / 1e6:.1f}M parameters in {len(flats)} buckets of ~{bucket_mib} MiB; "
          f"step {base:.2f} ms without exchange; with the exchange: kernels +{result['kernels_overhead_ms']:.2f} ms "
          f"(exchange {result['kernels_exchange_ms']:.2f} ms), torch ops +{result['torch ops_overhead_ms']:.2f} ms "
          f"(exchange {result['torch ops_exchange_ms']:.2f} ms)", flush=True)
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,25,100,420", help="bucket sizes in MiB (fp32)")
    parser.add_argument("--chunks", default="2,4,8", help="chunk counts (ranks of an exchange)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10, help="calls queued back to back per timing")
    parser.add_argument("--model", choices=["100m", "tiny"], default=None, help="also time the model's steps")
    parser.add_argument("--bucket-mib", type=int, default=25)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sweep", default=None,
                        help="BLOCK:WARPS:PROGRAMS_PER_SM,... to try first; the best one is used for the rest")
    parser.add_argument("--sweep-sizes", default="100,420", help="bucket sizes (MiB) the sweep times")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compression_kernels.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    if args.sweep:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.sweep.split(",")]
        results["config"] = sweep(configs, args.warmup, args.repeats,  # type: ignore[arg-type]
                                  tuple(int(s) for s in args.sweep_sizes.split(",")))
    results["kernel_config"] = {"block": kernels.BLOCK, "warps": kernels.NUM_WARPS,
                                "programs_per_sm": kernels.PROGRAMS_PER_SM}
    sizes, chunks = [float(s) for s in args.sizes.split(",")], [int(c) for c in args.chunks.split(",")]
    results["micro"] = micro(sizes, chunks, args.warmup, args.repeats, args.batch)
    if args.model:
        results["model"] = model_overhead(args.model, args.bucket_mib, args.steps, batch=8, seq_len=512)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
