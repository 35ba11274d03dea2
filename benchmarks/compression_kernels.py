"""MinMax uint8 compression on one GPU: the fused Triton kernels against the torch-op path and a copy.

::

    python benchmarks/compression_kernels.py                     # buckets of 1/25/100/420 MiB, 2/4/8 chunks
    python benchmarks/compression_kernels.py --model 100m        # + per-step overhead on the 110M model

For each fp32 bucket size and chunk count it times, with CUDA events, every pass below once
per round in an order shuffled each round (``interleaved.round_order``), ``--repeats`` rounds
after a warm-up; each pass's figure is its median, and its fraction of copy bandwidth comes
with a 95 % bootstrap interval (``interleaved.bootstrap_ratio`` against the copy's timings of
the same rounds):

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

``--sweep``: launch parameters (``kernels.Tuning``) timed against each other and a copy, interleaved,
before the rest; ``;`` between variants, ``,`` between fields, e.g. ``--sweep
"per_sm=8,reverse=0;per_sm=4;decompress_block=4096,decompress_warps=8"`` (an empty variant is the defaults). Each variant's
bytes and values are checked against the defaults'. The sweep rotates among ``--sweep-rotate``
input sets (a 100 MiB bucket reused call after call is partly still in L2 at the next call), and also
times the passes on their own, a Triton copy, and a decompression with a multiply in place of the
correctly rounded division (wrong values: a measure of what the division costs). The best
variant (least compress + decompress time) is then used for the rest of the run.
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

try:
    import triton
    import triton.language as tl

    from bagua_lightning.engine.kernels import _minmax as _mm
except ImportError:  # the benchmark needs a GPU, and with it Triton; this keeps --help working without
    triton = None

sys.path.insert(0, str(Path(__file__).parent))
from interleaved import bootstrap_ratio, round_order

MIB = 1 << 20
#: where the buffers live (a smoke test of the script sets "cpu", with Triton's interpreter)
DEVICE = "cuda"


def tuning() -> Any:
    """The kernels' launch parameters (None for a version of the kernels without ``Tuning``)."""
    return getattr(kernels, "TUNING", None)


def events_ms(fn: Callable[[], Any], batch: int) -> float:
    """Milliseconds per call of ``batch`` calls of ``fn`` queued back to back between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(batch):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / batch


def interleaved_ms(passes: dict[str, Callable[[], Any]], warmup: int, rounds: int, batch: int,
                   seed: int = 0) -> dict[str, list[float]]:
    """``rounds`` timings of every pass (``batch`` calls each), one per round, in an order shuffled per round."""
    for fn in passes.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in passes}
    for r in range(rounds):
        for name in round_order(list(passes), r, seed):
            times[name].append(events_ms(passes[name], batch))
    return times


def of_copy(copy_ms: list[float], ms: list[float], nbytes: int, copy_nbytes: int) -> tuple[float, float, float]:
    """Fraction of the copy's bandwidth, with its 95 % bootstrap interval: ``(ratio, low, high)``."""
    r, lo, hi = bootstrap_ratio(copy_ms, ms)
    f = nbytes / copy_nbytes
    return r * f, lo * f, hi * f


def fmt(ratio: tuple[float, float, float]) -> str:
    return f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]"


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
    table = []
    for mib in sizes_mib:
        numel = int(mib * MIB) // 4 // 64 * 64  # divisible by every chunk count
        x = torch.randn(numel, device=DEVICE) * torch.linspace(0.1, 10, numel, device=DEVICE)
        dst = torch.empty_like(x)
        for chunks in chunk_counts:
            n = numel // chunks
            packed = torch.empty(chunks, HEADER_BYTES + n, dtype=torch.uint8, device=DEVICE)
            ref = torch.empty_like(packed)
            out = torch.empty_like(x)
            received = torch.stack([kernels.compress(x[i * n:(i + 1) * n], 1, packed[i:i + 1].clone())[0]
                                    for i in range(chunks)])
            own = torch.empty(1, HEADER_BYTES + n, dtype=torch.uint8, device=DEVICE)
            mine, scratch = torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE)
            kernels.compress(x, chunks, packed)
            passes: dict[str, Callable[[], Any]] = {
                "copy": lambda: dst.copy_(x),  # noqa: B023
                "compress": lambda: kernels.compress(x, chunks, packed),  # noqa: B023
                "compress_torch": lambda: torch_compress(x, chunks, ref),  # noqa: B023
                "decompress": lambda: kernels.decompress(packed, out),  # noqa: B023
                "decompress_torch": lambda: torch_decompress(packed, dst),  # noqa: B023
                # Owner step: ``chunks`` ranks each sent one n-element chunk of the range it reduces.
                "owner": lambda: kernels.reduce_compressed(received, 1.0 / chunks, own),  # noqa: B023
                "owner_torch": lambda: torch_owner(received, 1.0 / chunks, mine, scratch, own),  # noqa: B023
            }
            queued = interleaved_ms(passes, warmup, repeats, batch)
            single = interleaved_ms(passes, 1, repeats, 1, seed=1)
            t_copy = statistics.median(queued["copy"])
            row: dict[str, Any] = {"MiB": mib, "chunks": chunks, "copy_ms": t_copy, "rounds": repeats}
            for name in passes:
                row[f"{name}_ms"] = statistics.median(queued[name])
                row[f"{name}_latency_ms"] = statistics.median(single[name])
                row[f"{name}_times_ms"] = queued[name]
            moved = {"compress": 9 * numel, "decompress": 5 * numel, "owner": (2 * chunks + 1) * n}
            for name, nbytes in moved.items():
                for variant in (name, f"{name}_torch"):
                    ratio = of_copy(queued["copy"], queued[variant], nbytes, 8 * numel)
                    row[f"{variant}_of_copy"], row[f"{variant}_of_copy_ci95"] = ratio[0], list(ratio[1:])
            rows.append(row)
            table.append(f"| {mib:g} | {chunks} | {t_copy:.3f} | " + " | ".join(
                f"{row[name + '_ms']:.3f} | {fmt((row[name + '_of_copy'], *row[name + '_of_copy_ci95']))} | "
                f"{row[name + '_torch_ms'] / row[name + '_ms']:.1f}x" for name in ("compress", "decompress", "owner"))
                + " |")
            print(f"{mib:>6} MiB x{chunks}: copy {t_copy:.3f} ms | " + " | ".join(
                f"{name} {row[name + '_ms']:.3f} ms ({fmt((row[name + '_of_copy'], *row[name + '_of_copy_ci95']))}"
                f" of copy; torch {row[name + '_torch_ms']:.3f} ms, {row[name + '_torch_ms'] / row[name + '_ms']:.1f}x;"
                f" latency {row[name + '_latency_ms']:.3f} vs {row[name + '_torch_latency_ms']:.3f} ms)"
                for name in ("compress", "decompress", "owner")), flush=True)
        torch.cuda.empty_cache()
    print("| MiB | chunks | copy ms | compress ms | of copy [95 %] | vs torch | decompress ms | of copy [95 %] "
          "| vs torch | owner ms | of copy [95 %] | vs torch |")
    print("| ---: " * 12 + "|")
    print("\n".join(table), flush=True)
    small = torch.randn(1024, device=DEVICE)
    small_copy = torch.empty_like(small)
    packed = torch.empty(4, HEADER_BYTES + 256, dtype=torch.uint8, device=DEVICE)
    ref = torch.empty_like(packed)
    own = torch.empty(1, HEADER_BYTES + 256, dtype=torch.uint8, device=DEVICE)
    kernels.compress(small, 4, packed)
    overhead = {"copy": host_us(lambda: small_copy.copy_(small)),  # one torch launch, for reference
                "compress": host_us(lambda: kernels.compress(small, 4, packed)),
                "compress_torch": host_us(lambda: torch_compress(small, 4, ref)),
                "decompress": host_us(lambda: kernels.decompress(packed, small_copy)),
                "decompress_torch": host_us(lambda: torch_decompress(packed, small_copy)),
                "owner": host_us(lambda: kernels.reduce_compressed(packed, 0.25, own)),
                # decompress's one kernel launched through Triton's JIT (what every launch cost before the
                # launchers called the compiled kernels directly), against "decompress": the whole launcher
                "decompress_jit_launch": host_us(jit_decompress(packed, small_copy))}
    print("host time per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items()), flush=True)
    rows.append({"host_us_per_call": overhead})
    return rows


def jit_decompress(packed: torch.Tensor, out: torch.Tensor) -> Callable[[], Any]:
    """One launch of decompress's kernel through Triton's JIT (what every launch cost before direct launches)."""
    rows, n = packed.shape[0], packed.shape[1] - HEADER_BYTES
    words, stride = packed.view(torch.int32), (HEADER_BYTES + n) // 4
    t = tuning()
    block, warps = (t.decompress_block, t.decompress_warps) if t is not None else (
        kernels.BLOCK, kernels.NUM_WARPS)  # type: ignore[attr-defined]  # the kernels before Tuning
    stream = {"STREAM": t.decompress_stream} if hasattr(t, "decompress_stream") else {}
    return lambda: kernels._k()._decompress_kernel[(-(-n // block), rows)](
        words, out, n, stride, BLOCK=block, PACK=4, **stream, num_warps=warps, enable_fp_fusion=False)


COMPRESS_FIELDS = ("block", "warps", "per_sm", "reverse", "stream")


def parse_tuning(spec: str) -> Any:
    """``"per_sm=8,reverse=0"`` -> ``kernels.Tuning`` (the defaults for the fields not named)."""
    fields: dict[str, Any] = {}
    defaults = kernels.Tuning._field_defaults
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise SystemExit(f"--sweep: unknown field {key!r}; the fields are {', '.join(defaults)}")
        fields[key] = bool(int(value)) if isinstance(defaults[key], bool) else int(value)
    return kernels.Tuning(**fields)


if triton is not None:
    @triton.jit
    def _triton_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = idx < n
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=m), mask=m)

    @triton.jit
    def _decompress_by_multiply_kernel(packed_ptr, out_ptr, n, row_stride, BLOCK: tl.constexpr, PACK: tl.constexpr):
        """decompress's kernel, one block per program, with ``* (1 / scale)`` for ``div_rn``: wrong values."""
        b = tl.program_id(0)
        c = tl.program_id(1).to(tl.int64)
        row = c * row_stride
        lo, hi = _mm._load_header(packed_ptr, row, PACK)
        scale, lower = _mm._level_parameters(lo, hi)
        idx, units = _mm._tile_at(b * (BLOCK // PACK), BLOCK, PACK)
        v = (_mm._load_levels(packed_ptr, row, units, n, PACK).to(tl.float32) + lower) * (1.0 / scale)
        tl.store(out_ptr + c * n + idx, v, mask=idx < n)


def rotating(fn: Callable[[int], Any], sets: int) -> Callable[[], Any]:
    """A call of ``fn(i)`` on input set ``i = 0, 1, ..., sets - 1, 0, ...`` in turn."""
    state = [0]

    def call() -> Any:
        i = state[0]
        state[0] = (i + 1) % sets
        return fn(i)
    return call


def with_tuning(t: Any, fn: Callable[[], Any]) -> Any:
    kernels.TUNING = t
    return fn()


def sweep(specs: list[str], sizes_mib: list[float], chunks: int, rotations: list[int], warmup: int, rounds: int,
          batch: int) -> tuple[Any, list[dict[str, Any]]]:
    """Time every variant's compress and decompress interleaved with a copy; the best of each, combined."""
    variants = {spec or "defaults": parse_tuning(spec) for spec in specs}
    report: list[dict[str, Any]] = []
    totals = {name: [0.0, 0.0] for name in variants}
    for mib in sizes_mib:
        _sweep_size(variants, mib, chunks, rotations, warmup, rounds, batch, report, totals)
        torch.cuda.empty_cache()
    ok = [name for name in variants if all(r.get("same_bytes", True) for r in report
                                           if r["pass"].endswith(" " + name))]
    best_c = min(ok, key=lambda v: totals[v][0])
    best_d = min(ok, key=lambda v: totals[v][1])
    fields = {f: getattr(variants[best_c], f) for f in COMPRESS_FIELDS}
    best = variants[best_d]._replace(**fields)
    print(f"sweep: best compress {best_c!r}, best decompress {best_d!r}: {best}", flush=True)
    return best, report


def variant_passes(t: Any, plan: Any, xs: list[torch.Tensor], packs: list[torch.Tensor], outs: list[torch.Tensor],
                   chunks: int) -> dict[str, Callable[[int], Any]]:
    """A variant's compress and decompress on input set ``i``, and compression's two passes alone."""
    partials = torch.empty(plan.partials, device=DEVICE)

    def compress(i: int) -> Any:
        return with_tuning(t, lambda: kernels.compress(xs[i], chunks, packs[i]))

    def decompress(i: int) -> Any:
        return with_tuning(t, lambda: kernels.decompress(packs[i], outs[i]))

    def extrema(i: int) -> None:
        plan.extrema(xs[i], xs[i], xs[i], xs[i], partials, *plan.extrema_ints, 0.0, 0.0, 0.0, *plan.consts)

    def quantise(i: int) -> None:
        plan.quantise(xs[i], partials, packs[i], *plan.quantise_args)

    extrema(0)  # the quantise pass alone reads these partial extrema
    return {"compress": compress, "decompress": decompress, "  extrema pass": extrema, "  quantise pass": quantise}


def _sweep_size(variants: dict[str, Any], mib: float, chunks: int, rotations: list[int], warmup: int, rounds: int,
                batch: int, report: list[dict[str, Any]], totals: dict[str, list[float]]) -> None:
    """One bucket size of :func:`sweep`: its rows go to ``report``, the variants' medians into ``totals``."""
    defaults = kernels.Tuning()
    sets = max(rotations)
    numel = int(mib * MIB) // 4 // 64 * 64
    n = numel // chunks
    xs = [torch.randn(numel, device=DEVICE) * torch.linspace(0.1, 10, numel, device=DEVICE) for _ in range(sets)]
    dsts = [torch.empty_like(x) for x in xs]
    packs = [torch.empty(chunks, HEADER_BYTES + n, dtype=torch.uint8, device=DEVICE) for _ in range(sets)]
    outs = [torch.empty_like(x) for x in xs]
    # The defaults' bytes and values; every variant must give the same.
    kernels.TUNING = defaults
    ref = kernels.compress(xs[0], chunks, torch.empty_like(packs[0]))
    ref_values = kernels.decompress(ref, torch.empty_like(xs[0]))
    same: dict[str, bool] = {}
    for name, t in variants.items():
        kernels.TUNING = t
        got = kernels.compress(xs[0], chunks, torch.empty_like(packs[0]))
        values = kernels.decompress(ref, torch.empty_like(xs[0]))
        same[name] = bool(torch.equal(got, ref) and torch.equal(values, ref_values))
    for rot in rotations:
        passes: dict[str, Callable[[], Any]] = {
            "copy": rotating(lambda i: dsts[i].copy_(xs[i]), rot),
            "triton copy": rotating(lambda i: _triton_copy_kernel[(-(-numel // 2048),)](
                xs[i], dsts[i], numel, BLOCK=2048, num_warps=4), rot),
            "multiply-decode (wrong values)": rotating(lambda i: _decompress_by_multiply_kernel[
                (-(-n // 2048), chunks)](packs[i].view(torch.int32), outs[i], n,
                                         (HEADER_BYTES + n) // 4, BLOCK=2048, PACK=4, num_warps=4,
                                         enable_fp_fusion=False), rot),
        }
        # A fill writes decompression's 4 bytes per value and reads nothing: the write side's own ceiling.
        passes["fill (writes only)"] = rotating(lambda i: outs[i].fill_(1.0), rot)
        nbytes = {"copy": 8 * numel, "triton copy": 8 * numel, "multiply-decode (wrong values)": 5 * numel,
                  "fill (writes only)": 4 * numel}
        for name, t in variants.items():
            kernels.TUNING = t
            plan = kernels._CompressRows(xs[0], chunks, packs[0], None, False, False, kernels._current(xs[0]))
            for kind, call in variant_passes(t, plan, xs, packs, outs, chunks).items():
                passes[f"{kind} {name}"] = rotating(call, rot)
            nbytes[f"compress {name}"], nbytes[f"decompress {name}"] = 9 * numel, 5 * numel
            nbytes[f"  extrema pass {name}"], nbytes[f"  quantise pass {name}"] = 4 * numel, 5 * numel
        times = interleaved_ms(passes, warmup, rounds, batch)
        kernels.TUNING = defaults
        print(f"sweep: {mib:g} MiB in {chunks} chunks, {rot} input set(s) in turn, {rounds} rounds of {batch} "
              f"calls; copy {statistics.median(times['copy']):.4f} ms")
        for name, series in times.items():
            ratio = of_copy(times["copy"], series, nbytes[name], 8 * numel)
            variant = name.split(" ", 1)[1] if name.startswith(("compress ", "decompress ")) else None
            check = "" if variant is None else "  bytes ok" if same[variant] else "  BYTES DIFFER"
            print(f"  {name:<60} {statistics.median(series):.4f} ms  {fmt(ratio)} of copy{check}")
            report.append({"MiB": mib, "chunks": chunks, "sets": rot, "pass": name,
                           "median_ms": statistics.median(series), "of_copy": ratio[0],
                           "of_copy_ci95": list(ratio[1:]), "times_ms": series,
                           **({"same_bytes": same[variant]} if variant is not None else {})})
            if variant is not None and rot == max(rotations):
                totals[variant][0 if name.startswith("compress") else 1] += statistics.median(series)


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
            flat = torch.zeros(sum(q.numel() for q in bucket), device=DEVICE)
            off = 0
            for q in bucket:
                q.grad = flat[off:off + q.numel()].view_as(q)
                off += q.numel()
            flats.append(flat)
            bucket, size_b = [], 0
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (batch, seq_len), device=DEVICE)
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
                        help="kernels.Tuning variants to time first, ';' between variants, ',' between fields "
                             "(e.g. 'reverse=0;decompress_block=4096,decompress_warps=8'); the best is used for the rest")
    parser.add_argument("--tuning", default=None,
                        help="kernels.Tuning fields for the run, as one --sweep variant (e.g. 'decompress_stream=0'); "
                             "the defaults for the fields not named; --sweep's best replaces it")
    parser.add_argument("--sweep-sizes", default="25,100,420", help="bucket sizes (MiB) the sweep times")
    parser.add_argument("--sweep-chunks", type=int, default=4, help="chunks of the sweep's buckets")
    parser.add_argument("--sweep-rotate", default="1,3",
                        help="input sets the sweep's calls take in turn (1: one bucket, as the rest of the run)")
    parser.add_argument("--no-micro", action="store_true", help="only the sweep (and --model)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compression_kernels.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    if args.tuning is not None:
        kernels.TUNING = parse_tuning(args.tuning)
    if args.sweep is not None:
        best, results["sweep"] = sweep(args.sweep.split(";"), [float(s) for s in args.sweep_sizes.split(",")],
                                       args.sweep_chunks, [int(r) for r in args.sweep_rotate.split(",")],
                                       args.warmup, args.repeats, args.batch)
        kernels.TUNING = best
    t = tuning()
    results["kernel_config"] = t._asdict() if t is not None else {
        "block": getattr(kernels, "BLOCK", None), "warps": getattr(kernels, "NUM_WARPS", None),
        "programs_per_sm": getattr(kernels, "PROGRAMS_PER_SM", None)}
    print(f"kernel launch parameters: {results['kernel_config']}", flush=True)
    if not args.no_micro:
        sizes, chunks = [float(s) for s in args.sizes.split(",")], [int(c) for c in args.chunks.split(",")]
        results["micro"] = micro(sizes, chunks, args.warmup, args.repeats, args.batch)
    if args.model:
        results["model"] = model_overhead(args.model, args.bucket_mib, args.steps, batch=8, seq_len=512)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
