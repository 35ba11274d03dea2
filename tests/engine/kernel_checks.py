"""The Triton kernels of ``engine/kernels`` against the CPU torch path, one check per function.

Run by ``test_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1`` (CPU tensors
through Triton's interpreter, tiny shapes), and on a GPU machine as
``python tests/engine/kernel_checks.py --device cuda`` (the compiled kernels, real
block sizes). The reference is always the CPU torch path; results are compared
byte for byte and value for value. Prints one JSON object: check name -> "ok" or the failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable

import torch

from bagua_lightning.engine import kernels
from bagua_lightning.engine.algorithms.low_precision_decentralized import (
    FIVE_THIRDS,
    THIRD,
    _add_decompressed,
    weight_difference_,
)
from bagua_lightning.engine.chunk_format import HEADER_BYTES
from bagua_lightning.engine.compressed_comm import _sum_levels
from bagua_lightning.engine.compression import compress_chunks, decompress_chunks, read_header

CHECKS: dict[str, Callable[[torch.device, int | None], None]] = {}


def check(fn: Callable[[torch.device, int | None], None]) -> Callable[[torch.device, int | None], None]:
    CHECKS[fn.__name__] = fn
    return fn


def _inputs(n: int, chunks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * chunks, generator=g) * torch.logspace(-3, 2, n * chunks)
    return x.to(dtype)


# (elements per chunk, chunks): odd lengths (byte layout), multiples of 4 (word layout), one element
SHAPES = [(1, 1), (5, 3), (37, 2), (64, 4), (100, 1), (203, 2)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8) if a.dtype == torch.uint8
                                                                    else a, b):
        diff = (a.float() - b.float()).abs()
        raise AssertionError(f"{what}: differs at {int((diff > 0).sum())} of {a.numel()} (max {diff.max().item()})")


def _compress_both(x: torch.Tensor, chunks: int, device: torch.device, block: int | None) -> torch.Tensor:
    ref = compress_chunks(x, chunks)
    out = torch.empty(ref.shape, dtype=torch.uint8, device=device)
    kernels.compress(x.to(device), chunks, out, block=block)
    _same(out.cpu(), ref, f"compress {x.dtype} {tuple(ref.shape)}")
    return ref


@check
def compress_matches_cpu_bytes(device: torch.device, block: int | None) -> None:
    for seed, (n, chunks) in enumerate(SHAPES):
        for dtype in DTYPES:
            _compress_both(_inputs(n, chunks, dtype, seed), chunks, device, block)


@check
def decompress_matches_cpu_values(device: torch.device, block: int | None) -> None:
    for seed, (n, chunks) in enumerate(SHAPES):
        packed = compress_chunks(_inputs(n, chunks, torch.float32, seed), chunks)
        for dtype in DTYPES:
            ref = decompress_chunks(packed, dtype=dtype)
            out = torch.empty(ref.numel(), dtype=dtype, device=device)
            kernels.decompress(packed.to(device), out, block=block)
            _same(out.cpu(), ref, f"decompress to {dtype} {tuple(packed.shape)}")


@check
def constant_and_extreme_chunks(device: torch.device, block: int | None) -> None:
    n = 48
    cases = [
        torch.full((2 * n,), 3.25),                                              # constant chunks
        torch.cat([torch.zeros(n), torch.full((n,), -7.0)]),
        torch.cat([torch.linspace(-1e38, 1e38, n), torch.linspace(0, 3e38, n)]),  # near float32's max
        torch.cat([torch.linspace(-1e-30, 1e-30, n), torch.linspace(1e-37, 2e-37, n)]),  # tiny widths
        torch.cat([torch.linspace(-1e30, 1e-30, n), torch.tensor([1e20, -1e-20] * (n // 2))]),  # mixed scales
    ]
    for x in cases:
        packed = _compress_both(x, 2, device, block)
        out = torch.empty(2 * n, device=device)
        kernels.decompress(packed.to(device), out, block=block)
        _same(out.cpu(), decompress_chunks(packed), "decompress extreme")
    constant = decompress_chunks(compress_chunks(cases[0], 2))
    if not torch.equal(constant, cases[0]):
        raise AssertionError("a constant chunk must decode exactly")


@check
def non_finite_values_decode_non_finite(device: torch.device, block: int | None) -> None:
    # A NaN or an infinity makes its whole chunk decode to non-finite values on both paths (a GradScaler
    # sees the overflow after the exchange); the other chunk is untouched.
    n = 40
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = _inputs(n, 2, torch.float32, 21)
        x[n // 2] = bad
        for packed in (compress_chunks(x, 2), _compress_with_kernels(x, 2, device, block)):
            values = torch.empty(2 * n, device=device)
            kernels.decompress(packed.to(device), values, block=block)
            for decoded in (values.cpu(), decompress_chunks(packed.cpu())):
                if torch.isfinite(decoded[:n]).any():
                    raise AssertionError(f"a chunk holding {bad} decoded to finite values")
                _same(decoded[n:], decompress_chunks(compress_chunks(x[n:], 1)), "the other chunk")
        received = torch.cat([compress_chunks(x[:n], 1), compress_chunks(x[n:], 1)])
        out = torch.empty(1, HEADER_BYTES + n, dtype=torch.uint8, device=device)
        kernels.reduce_compressed(received.to(device), 0.5, out, block=block)
        if torch.isfinite(decompress_chunks(out.cpu())).any():
            raise AssertionError(f"the owner step dropped a {bad}")


def _compress_with_kernels(x: torch.Tensor, chunks: int, device: torch.device, block: int | None) -> torch.Tensor:
    out = torch.empty(chunks, HEADER_BYTES + x.numel() // chunks, dtype=torch.uint8, device=device)
    return kernels.compress(x.to(device), chunks, out, block=block)


@check
def unaligned_buffers_use_the_byte_layout(device: torch.device, block: int | None) -> None:
    n, chunks = 64, 2
    x = _inputs(n, chunks, torch.float32, 7)
    ref = compress_chunks(x, chunks)
    backing = torch.zeros(ref.numel() + 1, dtype=torch.uint8, device=device)
    out = backing[1:].view(ref.shape)  # one byte off a word boundary
    kernels.compress(x.to(device), chunks, out, block=block)
    _same(out.cpu(), ref, "compress into an unaligned buffer")
    values = torch.empty(n * chunks, device=device)
    kernels.decompress(out, values, block=block)
    _same(values.cpu(), decompress_chunks(ref), "decompress from an unaligned buffer")
    if backing[0].item() != 0:
        raise AssertionError("wrote before the buffer")


@check
def owner_step_matches_decompress_sum_recompress(device: torch.device, block: int | None) -> None:
    for world, n in [(2, 64), (3, 37), (4, 1), (8, 100)]:
        received = torch.cat([compress_chunks(_inputs(n, 1, torch.float32, 100 + i) * (i + 1), 1)
                              for i in range(world)])
        for scale in (1.0, 1.0 / world):
            total = torch.zeros(n)
            for i in range(world):
                total += decompress_chunks(received[i : i + 1])
            ref = compress_chunks(total * scale, 1)
            summed, scratch = torch.empty(n), torch.empty(n)  # the Gloo path's owner step: the same sum
            mins, maxs = read_header(received)
            _sum_levels(received[:, HEADER_BYTES:], mins, maxs, scale, summed, scratch)
            _same(summed, total * scale, f"torch owner step world={world} n={n} scale={scale}")
            out = torch.full((1, HEADER_BYTES + n), 77, dtype=torch.uint8, device=device)
            kernels.reduce_compressed(received.to(device), scale, out, block=block)
            _same(out.cpu(), ref, f"owner step world={world} n={n} scale={scale}")


@check
def weight_difference_matches_torch(device: torch.device, block: int | None) -> None:
    # The reference: low_precision_decentralized's torch path (Bagua's order of float32 operations).
    for n in (37, 64):
        x, left, right, w = (_inputs(n, 1, torch.float32, s) for s in (1, 2, 3, 4))
        for one_peer in (True, False):
            d_ref = x.clone()
            weight_difference_(d_ref, left, left if one_peer else right, w, one_peer, torch.empty(n))
            ref = compress_chunks(d_ref, 1)
            d = x.to(device)
            out = torch.empty(ref.shape, dtype=torch.uint8, device=device)
            kernels.weight_difference_compress(d, left.to(device), None if one_peer else right.to(device),
                                               w.to(device), (THIRD, THIRD, -FIVE_THIRDS), out, block=block)
            _same(d.cpu(), d_ref, "weight difference")
            _same(out.cpu(), ref, "compressed weight difference")


@check
def add_decompressed_matches_torch(device: torch.device, block: int | None) -> None:
    # target + (q + lower) / scale, the decoded value and the sum each rounded once, as the torch path.
    for n in (37, 64):
        packed = compress_chunks(_inputs(n, 1, torch.float32, 11), 1)
        target = _inputs(n, 1, torch.float32, 12)
        ref = target.clone()
        _add_decompressed(ref, packed, torch.empty(n))
        out = target.to(device)
        kernels.add_decompressed(out, packed.to(device), block=block)
        _same(out.cpu(), ref, "add_decompressed")


@check
def repeated_layouts_match_cpu(device: torch.device, block: int | None) -> None:
    # The launchers keep a validated plan per layout and, on a GPU, launch the compiled kernels directly
    # from the second call on. Calls on one layout with new values, new buffers, and aligned and unaligned
    # buffers of one shape in turn must each give the CPU path's bytes and values.
    n, chunks = 64, 2
    backing = torch.zeros(2 * (chunks * (HEADER_BYTES + n) + 4), dtype=torch.uint8, device=device)
    size = chunks * (HEADER_BYTES + n)
    for step in range(4):
        x = _inputs(n, chunks, torch.float32, 40 + step)
        ref = compress_chunks(x, chunks)
        offset = 0 if step % 2 == 0 else 1  # word layout, then byte layout, for one shape
        out = backing[offset + (step // 2) * (size + 4): offset + (step // 2) * (size + 4) + size].view(ref.shape)
        kernels.compress(x.to(device), chunks, out, block=block)
        _same(out.cpu(), ref, f"compress, call {step}")
        values = torch.empty(n * chunks, device=device)
        kernels.decompress(out, values, block=block)
        _same(values.cpu(), decompress_chunks(ref), f"decompress, call {step}")
        received = torch.cat([compress_chunks(_inputs(n, 1, torch.float32, 60 + step + i), 1) for i in range(3)])
        total = torch.zeros(n)
        for i in range(3):
            total += decompress_chunks(received[i : i + 1])
        own = torch.empty(1, HEADER_BYTES + n, dtype=torch.uint8, device=device)
        kernels.reduce_compressed(received.to(device), 0.25 + step, own, block=block)
        _same(own.cpu(), compress_chunks(total * (0.25 + step), 1), f"owner step, call {step}")
        target = _inputs(n, 1, torch.float32, 80 + step)
        expected = target.clone()
        _add_decompressed(expected, own.cpu(), torch.empty(n))
        applied = target.to(device)
        kernels.add_decompressed(applied, own, block=block)
        _same(applied.cpu(), expected, f"add_decompressed, call {step}")
    if device.type == "cuda":  # the later calls took the direct launch
        plans = list(kernels._LAYOUTS._plans.values())
        launches = [v for p in plans for v in vars(p).values() if isinstance(v, kernels.Launch)]
        if not launches or not all(launch.direct for launch in launches):
            raise AssertionError("a launcher still goes through Triton's JIT after its first launch")


@check
def bad_arguments_are_refused(device: torch.device, block: int | None) -> None:
    x = torch.zeros(8, device=device)
    for call, match in [
        (lambda: kernels.compress(x, 3, torch.empty(3, 10, dtype=torch.uint8, device=device)), "chunks"),
        (lambda: kernels.compress(x, 2, torch.empty(2, 9, dtype=torch.uint8, device=device)), "shape"),
        (lambda: kernels.decompress(torch.zeros(2, 12, dtype=torch.uint8, device=device), x[:7]), "8 elements"),
        (lambda: kernels.compress(x, 2, torch.empty(2, 12, dtype=torch.uint8, device=device), block=6), "power"),
        (lambda: kernels.compress(x.double(), 2, torch.empty(2, 12, dtype=torch.uint8, device=device)), "float64"),
    ]:
        try:
            call()
        except ValueError as e:
            if match not in str(e):
                raise AssertionError(f"error {e!r} does not name {match!r}") from e
        else:
            raise AssertionError(f"no ValueError for a call that should name {match!r}")


def run(device: torch.device, block: int | None, names: list[str] | None = None) -> dict[str, str]:
    results = {}
    for name, fn in CHECKS.items():
        if names and name not in names:
            continue
        try:
            fn(device, block)
            results[name] = "ok"
        except Exception:  # reported per check to the test that asked
            results[name] = traceback.format_exc()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", help="cpu (needs TRITON_INTERPRET=1) or cuda")
    parser.add_argument("--block", type=int, default=None, help="elements per block (default: the launchers')")
    parser.add_argument("names", nargs="*", help="checks to run (default: all)")
    args = parser.parse_args(argv)
    results = run(torch.device(args.device), args.block, args.names)
    print(json.dumps(results))
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
