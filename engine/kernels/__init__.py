"""Fused GPU kernels (Triton) for the MinMax uint8 format of :mod:`bagua_lightning.engine.compression`.

Each pass reads the bucket once and writes its result once, with no float
temporaries: compression is two passes (per-chunk extrema, then header and levels),
decompression one, bytegrad's owner step two passes over the received bytes (the
reduced chunk is recomputed, never stored). The bytes and values are those of the CPU
torch path (``_minmax``'s docstring says how), so the two paths interoperate.

Importing this package is cheap; Triton is imported on the first launch. The
launchers take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set
before Triton was imported (how the tests run them without a GPU).
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType
from typing import Any, NamedTuple

import torch

from ..chunk_format import HEADER_BYTES

__all__ = [
    "add_decompressed",
    "compress",
    "decompress",
    "enabled",
    "reduce_compressed",
    "weight_difference_compress",
]

#: Elements per block and warps per program: 16 values per thread. With PROGRAMS_PER_SM, the best of a
#: sweep on an H100 (``benchmarks/compression_kernels.py --sweep``; 4096/8/4 was within 5 %).
BLOCK = 2048
NUM_WARPS = 4
#: Programs per SM for the looping passes (compression, owner step): enough loads in flight per SM.
PROGRAMS_PER_SM = 8


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported."""
    return importlib.util.find_spec("triton") is not None


#: The value dtypes the kernels read and write (others take the torch path).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def enabled(device: torch.device) -> bool:
    """True when tensors on ``device`` go through these kernels (CUDA with Triton installed)."""
    return device.type == "cuda" and triton_available()


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{what} must be float32, bfloat16 or float16, got {t.dtype}; use the torch path "
                         "(bagua_lightning.engine.compression) for other dtypes")


@functools.cache
def _k() -> ModuleType:
    from . import _minmax

    return _minmax


class _Plan(NamedTuple):
    """How a pass over ``rows`` rows of ``n`` values is launched (cached: launches are host-bound when small)."""

    block: int
    nblocks: int  # blocks per row
    programs: int  # programs per row of the looping passes
    pb: int  # a power of two >= programs (the partial-extrema reduction's width)
    options: dict[str, Any]  # Triton launch options; shared, never modified


@functools.lru_cache(maxsize=1024)
def _plan(device: torch.device, n: int, rows: int, block: int | None, warps: int, per_sm: int,
          default_block: int) -> _Plan:
    if block is not None and (block < 4 or block & (block - 1)):
        raise ValueError(f"block must be a power of two >= 4, got {block}")
    blk = block if block is not None else default_block if device.type == "cuda" else 64
    nblocks = -(-n // blk)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = per_sm * int(torch.cuda.get_device_properties(index).multi_processor_count)
        programs = max(1, min(nblocks, -(-total // rows)))
        # No fused multiply-add contraction: the CPU path rounds after every multiply (see _minmax).
        options: dict[str, Any] = {"num_warps": warps, "enable_fp_fusion": False}
    else:  # the interpreter: still more than one program, and more than one block per program
        programs, options = max(1, min(nblocks, 3)), {}
    return _Plan(blk, nblocks, programs, 1 << max(0, (programs - 1).bit_length()), options)


def _plan_for(device: torch.device, n: int, rows: int, block: int | None) -> _Plan:
    return _plan(device, n, rows, block, NUM_WARPS, PROGRAMS_PER_SM, BLOCK)


def _packed_view(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """``(view, row_stride, PACK)``: the int32 view of a word-aligned packed tensor, else the bytes."""
    if n % 4 == 0 and packed.data_ptr() % 4 == 0 and packed.is_contiguous():
        return packed.view(torch.int32), (HEADER_BYTES + n) // 4, 4
    return packed, packed.stride(0) if packed.dim() == 2 else HEADER_BYTES + n, 1


def _check_packed(packed: torch.Tensor, rows: int | None, n: int, device: torch.device, what: str) -> None:
    shape = (rows if rows is not None else packed.shape[0], HEADER_BYTES + n)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or tuple(packed.shape) != shape or packed.device != device:
        raise ValueError(
            f"{what} must be a uint8 tensor of shape {shape} on {device}, "
            f"got {packed.dtype} {tuple(packed.shape)} on {packed.device}"
        )
    if packed.stride(1) != 1:
        raise ValueError(f"{what} must have contiguous rows, got strides {packed.stride()}")


def _compress_rows(
    src: torch.Tensor, num_chunks: int, out: torch.Tensor, block: int | None,
    combine: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, float, float, float] | None = None,
) -> torch.Tensor:
    n = src.numel() // num_chunks
    device = src.device
    _check_packed(out, num_chunks, n, device, "out")
    plan = _plan_for(device, n, num_chunks, block)
    blk, nblocks, programs, opts = plan.block, plan.nblocks, plan.programs, plan.options
    partials = torch.empty(num_chunks * programs * 2, dtype=torch.float32, device=device)
    k = _k()
    if combine is None:
        k._extrema_kernel[(programs, num_chunks)](
            src, src, src, src, partials, n, nblocks, programs, 0.0, 0.0, 0.0,
            BLOCK=blk, COMBINE=False, HAS_RIGHT=False, **opts,
        )
    else:
        left, right, weight, c_left, c_right, c_weight = combine
        k._extrema_kernel[(programs, num_chunks)](
            src, left, right if right is not None else left, weight, partials, n, nblocks, programs,
            c_left, c_right, c_weight, BLOCK=blk, COMBINE=True, HAS_RIGHT=right is not None, **opts,
        )
    view, row_stride, pack = _packed_view(out, n)
    k._quantise_kernel[(programs, num_chunks)](
        src, partials, view, n, nblocks, programs, row_stride,
        BLOCK=blk, PACK=pack, PB=plan.pb, **opts,
    )
    return out


def compress(x: torch.Tensor, num_chunks: int, out: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """Compress the 1-D contiguous float tensor ``x`` (fp32, bf16 or fp16) in ``num_chunks`` chunks into ``out``.

    ``out``: uint8 ``(num_chunks, 8 + x.numel() // num_chunks)`` with contiguous rows.
    ``block``: elements per block (a power of two; tests use small ones). Returns ``out``.
    """
    if x.dim() != 1 or not x.is_contiguous() or x.numel() % num_chunks != 0:
        raise ValueError(
            f"compress needs a contiguous 1-D tensor whose length divides into {num_chunks} chunks, "
            f"got shape {tuple(x.shape)}"
        )
    _check_dtype(x, "x")
    return _compress_rows(x.detach(), num_chunks, out, block)


def decompress(packed: torch.Tensor, out: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """Decompress the packed ``(chunks, 8 + n)`` uint8 tensor into the contiguous 1-D tensor ``out``.

    ``out``'s dtype (fp32, bf16 or fp16) is the dtype of the values; ``chunks * n`` elements.
    """
    rows, n = packed.shape[0], packed.shape[1] - HEADER_BYTES
    _check_packed(packed, None, n, out.device, "packed")
    _check_dtype(out, "out")
    if out.dim() != 1 or not out.is_contiguous() or out.numel() != rows * n:
        raise ValueError(f"out must be a contiguous 1-D tensor of {rows * n} elements, got {tuple(out.shape)}")
    plan = _plan_for(out.device, n, rows, block)
    view, row_stride, pack = _packed_view(packed, n)
    _k()._decompress_kernel[(plan.nblocks, rows)](view, out, n, row_stride, BLOCK=plan.block, PACK=pack,
                                                 **plan.options)
    return out


def reduce_compressed(
    received: torch.Tensor, scale: float, out: torch.Tensor, *, block: int | None = None
) -> torch.Tensor:
    """Bytegrad's owner step: ``out`` (``(1, 8 + n)`` uint8) := compress(scale * sum of the rows' values).

    ``received``: ``(world, 8 + n)`` packed chunks, one per rank. The rows are
    decompressed as :func:`decompress` would and summed in row order in float32, then
    multiplied by ``scale``; the sum is compressed with its own min/max. Two passes over
    ``received``; the sum is never stored.
    """
    world, n = received.shape[0], received.shape[1] - HEADER_BYTES
    device = received.device
    _check_packed(received, None, n, device, "received")
    _check_packed(out, 1, n, device, "out")
    plan = _plan_for(device, n, 1, block)
    blk, nblocks, programs, opts = plan.block, plan.nblocks, plan.programs, plan.options
    partials = torch.empty(programs * 2, dtype=torch.float32, device=device)
    recv_view, row_stride, pack = _packed_view(received, n)
    out_view, _, out_pack = _packed_view(out, n)
    if out_pack != pack:  # both word-aligned or neither: one layout inside the kernel
        recv_view, row_stride, pack = received, received.stride(0), 1
        out_view = out
    k = _k()
    tables = torch.empty(world * 256, dtype=torch.float32, device=device)  # each row's 256 decoded values
    k._decode_table_kernel[(world,)](recv_view, tables, row_stride, PACK=pack, **opts)
    k._reduce_extrema_kernel[(programs,)](
        recv_view, tables, partials, world, n, nblocks, programs, row_stride, float(scale), BLOCK=blk, PACK=pack,
        **opts,
    )
    k._reduce_quantise_kernel[(programs,)](
        recv_view, tables, partials, out_view, world, n, nblocks, programs, row_stride, float(scale),
        BLOCK=blk, PACK=pack, PB=plan.pb, **opts,
    )
    return out


def weight_difference_compress(
    diff: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor | None,
    weight: torch.Tensor,
    coefficients: tuple[float, float, float],
    out: torch.Tensor,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """``diff += a * left + b * right + c * weight`` and compress ``diff`` as one chunk into ``out``.

    All four tensors are contiguous 1-D float32 of one length; ``right=None`` drops its
    term (two ranks: one neighbour). ``coefficients``: ``(a, b, c)``. The combination is
    written into ``diff`` by the first pass, which the second pass then quantises.
    """
    tensors = [t for t in (diff, left, right, weight) if t is not None]
    if any(t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.numel() != diff.numel()
           for t in tensors):
        raise ValueError("weight_difference_compress needs contiguous 1-D float32 tensors of one length")
    a, b, c = (float(v) for v in coefficients)
    return _compress_rows(diff, 1, out, block, combine=(left, right, weight, a, b, c))


def add_decompressed(target: torch.Tensor, packed: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """``target += decompress(packed)`` for a single-chunk ``(1, 8 + n)`` packed tensor; float32 ``target``."""
    n = packed.shape[1] - HEADER_BYTES
    _check_packed(packed, 1, n, target.device, "packed")
    if target.dtype != torch.float32 or target.dim() != 1 or not target.is_contiguous() or target.numel() != n:
        raise ValueError(f"target must be a contiguous 1-D float32 tensor of {n} elements, got "
                         f"{target.dtype} {tuple(target.shape)}")
    plan = _plan_for(target.device, n, 1, block)
    view, _, pack = _packed_view(packed, n)
    _k()._apply_kernel[(plan.nblocks,)](view, target, n, BLOCK=plan.block, PACK=pack, **plan.options)
    return target
