"""Fused GPU kernels (Triton) for the MinMax uint8 format of :mod:`bagua_lightning.engine.compression`.

Each pass reads the bucket once and writes its result once, with no float
temporaries: compression is two passes (per-chunk extrema, then header and levels),
decompression one, bytegrad's owner step two passes over the received bytes (the
reduced chunk is recomputed, never stored). The bytes and values are those of the CPU
torch path (``_minmax``'s docstring says how), so the two paths interoperate.

Importing this package is cheap; Triton is imported on the first launch. The
launchers take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set
before Triton was imported (how the tests run them without a GPU).

Host time: a launcher validates a layout (shapes, dtypes, strides, alignments, devices) once
and keeps its plan under a key of exactly those properties; later calls with the same layout
read the key, take a kept scratch buffer and call the compiled kernels' launchers directly
(``_launch``): a few microseconds per kernel instead of the JIT's tens.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType
from typing import Any, NamedTuple

import torch

from ..chunk_format import HEADER_BYTES
from ._launch import Launch, Layouts, Scratch

__all__ = [
    "add_decompressed",
    "compress",
    "decompress",
    "enabled",
    "reduce_compressed",
    "weight_difference_compress",
]

class Tuning(NamedTuple):
    """Launch parameters of the kernels (``benchmarks/compression_kernels.py --sweep`` times alternatives).

    Compression's two passes split each chunk into one contiguous span per program, about
    ``per_sm`` programs per SM, each span a multiple of 64 elements: the programs move the same
    bytes (with whole blocks per program, 12.1 blocks on average meant 13 for the slowest). The
    owner step and ``add_decompressed`` loop over whole blocks.
    """

    #: elements per block and warps per program of the looping passes: 16 values per thread
    block: int = 2048
    warps: int = 4
    #: programs per SM of the looping passes: enough loads in flight per SM
    per_sm: int = 8
    #: compression's second pass walks each span from the back: it re-reads first what the first pass
    #: read last, which is still in L2
    reverse: bool = True
    #: compression's level stores marked first to be evicted from L2 (they are not read again)
    stream: bool = True
    #: decompression (one block per program): elements per block, warps per program. 1024 elements on 2 warps
    #: (16 values per thread): 0.87 and 0.89 of copy bandwidth at 100 and 420 MiB on an
    #: H200 against 0.85 and 0.88 for 2048 on 4 (``compression_kernels.py --sweep``, 2026-12-02)
    decompress_block: int = 1024
    decompress_warps: int = 2
    #: decompression's value stores: 0 plain, 1 evict-first from L2, 2 streaming (``st.global.cs``)
    decompress_stream: int = 0


#: The tuning every launcher uses (part of every layout key: assigning another one takes effect at once).
TUNING = Tuning()


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
    """How a pass over ``rows`` rows of ``n`` values is launched."""

    block: int
    nblocks: int  # blocks per row
    programs: int  # programs per row of the passes that loop over whole blocks (owner step)
    pb: int  # a power of two >= programs (the partial-extrema reduction's width)
    options: dict[str, Any]  # Triton launch options; shared, never modified
    span: int  # elements per program of the span passes (a multiple of 4; the last program's may be shorter)
    span_programs: int  # programs per row of the span passes
    iters: int  # blocks per span
    span_pb: int  # a power of two >= span_programs


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


@functools.lru_cache(maxsize=1024)
def _plan(device: torch.device, n: int, rows: int, block: int | None, warps: int, per_sm: int,
          default_block: int) -> _Plan:
    """``per_sm``: programs per SM; 0 for one block per program (the span passes' spans are then blocks)."""
    if block is not None and (block < 4 or block & (block - 1)):
        raise ValueError(f"block must be a power of two >= 4, got {block}")
    blk = block if block is not None else default_block if device.type == "cuda" else 64
    nblocks = -(-n // blk)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = max(1, per_sm) * int(torch.cuda.get_device_properties(index).multi_processor_count)
        programs = max(1, min(nblocks, -(-total // rows)))
        # Spans of whole 64-element groups: 16-byte aligned loads and stores of every dtype.
        align = 64
        # No fused multiply-add contraction: the CPU path rounds after every multiply (see _minmax).
        options: dict[str, Any] = {"num_warps": warps, "enable_fp_fusion": False}
    else:  # the interpreter: still more than one program, and more than one block per program
        programs, align, options = max(1, min(nblocks, 3)), 4, {}
    # per_sm 0: a span is a block; else the programs' spans as equal as whole align-element groups allow
    span = blk if per_sm <= 0 else max(align, -(-(-(-n // programs)) // align) * align)  # noqa: B002
    span_programs = max(1, -(-n // span))
    return _Plan(blk, nblocks, programs, _pow2_at_least(programs), options, span, span_programs,
                 -(-span // blk), _pow2_at_least(span_programs))


def _plan_for(device: torch.device, n: int, rows: int, block: int | None) -> _Plan:
    t = TUNING
    return _plan(device, n, rows, block, t.warps, t.per_sm, t.block)


def _decompress_plan_for(device: torch.device, n: int, rows: int, block: int | None) -> _Plan:
    t = TUNING
    return _plan(device, n, rows, block, t.decompress_warps, 0, t.decompress_block)


def _packed_layout(packed: torch.Tensor, n: int) -> tuple[int, int]:
    """``(row_stride, PACK)``: int32 words (``PACK=4``) for a word-aligned contiguous packed tensor, else bytes."""
    if n % 4 == 0 and packed.data_ptr() % 4 == 0 and packed.is_contiguous():
        return (HEADER_BYTES + n) // 4, 4
    return packed.stride(0) if packed.dim() == 2 else HEADER_BYTES + n, 1


def _words(position: int, pack: int) -> tuple[tuple[int, torch.dtype], ...]:
    """The view a :class:`Launch` applies to a packed argument: int32 words when ``pack == 4``."""
    return ((position, torch.int32),) if pack == 4 else ()


def _check_packed(packed: torch.Tensor, rows: int | None, n: int, device: torch.device, what: str) -> None:
    shape = (rows if rows is not None else packed.shape[0], HEADER_BYTES + n)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or tuple(packed.shape) != shape or packed.device != device:
        raise ValueError(
            f"{what} must be a uint8 tensor of shape {shape} on {device}, "
            f"got {packed.dtype} {tuple(packed.shape)} on {packed.device}"
        )
    if packed.stride(1) != 1:
        raise ValueError(f"{what} must have contiguous rows, got strides {packed.stride()}")


#: Validated layouts (key: every property a check or a kernel's specialisation depends on -> plan).
_LAYOUTS = Layouts()
_SCRATCH = Scratch()


def _current(t: torch.Tensor) -> int:
    """The current CUDA device when ``t`` is a CUDA tensor (where the kernels launch), else -1."""
    return torch.cuda.current_device() if t.is_cuda else -1


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's part of a layout key: dtype, shape, strides, device, and its address modulo 16.

    The address bits decide the word layout (4-byte alignment) and Triton's pointer
    specialisation (16-byte alignment).
    """
    return t.dtype, t.shape, t.stride(), t.get_device(), t.data_ptr() & 15


class _Runner:
    """A validated layout's launches; ``device_switch`` when the tensors live on another than the current device."""

    device: torch.device
    index: int  # the tensors' CUDA device index, -1 on CPU
    device_switch: bool

    def _locate(self, device: torch.device, current: int) -> None:
        self.device = device
        self.index = device.index if device.type == "cuda" and device.index is not None else (
            current if device.type == "cuda" else -1)
        self.device_switch = device.type == "cuda" and self.index != current


class _CompressRows(_Runner):
    """Both passes of a compression of ``chunks`` rows of ``n`` values into a packed tensor."""

    def __init__(self, src: torch.Tensor, chunks: int, out: torch.Tensor, block: int | None, combine: bool,
                 has_right: bool, current: int) -> None:
        self._locate(src.device, current)
        n = src.numel() // chunks
        _check_packed(out, chunks, n, src.device, "out")
        p = _plan_for(src.device, n, chunks, block)
        row_stride, pack = _packed_layout(out, n)
        k = _k()
        self.extrema = Launch(k._extrema_kernel, (p.span_programs, chunks), p.options)
        self.quantise = Launch(k._quantise_kernel, (p.span_programs, chunks), p.options, _words(2, pack))
        self.partials = chunks * p.span_programs * 2
        self.extrema_ints = (n, p.span, p.iters, p.span_programs)
        self.consts = (p.block, combine, has_right)
        self.quantise_args = (n, p.span // pack, p.iters, p.span_programs, row_stride, p.block, pack, p.span_pb,
                              TUNING.reverse, TUNING.stream)

    def run(self, src: torch.Tensor, out: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
            weight: torch.Tensor, coefficients: tuple[float, float, float]) -> None:
        partials = _SCRATCH.get("extrema", self.device, self.index, self.partials)
        self.extrema(src, left, right, weight, partials, *self.extrema_ints, *coefficients, *self.consts)
        self.quantise(src, partials, out, *self.quantise_args)


_NO_COMBINE = (0.0, 0.0, 0.0)


def compress(x: torch.Tensor, num_chunks: int, out: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """Compress the 1-D contiguous float tensor ``x`` (fp32, bf16 or fp16) in ``num_chunks`` chunks into ``out``.

    ``out``: uint8 ``(num_chunks, 8 + x.numel() // num_chunks)`` with contiguous rows.
    ``block``: elements per block (a power of two; tests use small ones). Returns ``out``.
    """
    current = _current(x)
    key = ("compress", num_chunks, block, TUNING, current, *_key(x), *_key(out))
    plan = _LAYOUTS.get(key)
    if plan is None:
        if x.dim() != 1 or not x.is_contiguous() or num_chunks <= 0 or x.numel() % num_chunks != 0:
            raise ValueError(
                f"compress needs a contiguous 1-D tensor whose length divides into {num_chunks} chunks, "
                f"got shape {tuple(x.shape)}"
            )
        _check_dtype(x, "x")
        plan = _LAYOUTS.put(key, _CompressRows(x, num_chunks, out, block, False, False, current))
    if plan.device_switch:
        with torch.cuda.device(plan.index):
            plan.run(x, out, x, x, x, _NO_COMBINE)
    else:
        plan.run(x, out, x, x, x, _NO_COMBINE)
    return out


class _Decompress(_Runner):
    def __init__(self, packed: torch.Tensor, out: torch.Tensor, block: int | None, current: int) -> None:
        rows, n = packed.shape[0], packed.shape[1] - HEADER_BYTES
        _check_packed(packed, None, n, out.device, "packed")
        _check_dtype(out, "out")
        if out.dim() != 1 or not out.is_contiguous() or out.numel() != rows * n:
            raise ValueError(f"out must be a contiguous 1-D tensor of {rows * n} elements, got {tuple(out.shape)}")
        self._locate(out.device, current)
        p = _decompress_plan_for(out.device, n, rows, block)
        row_stride, pack = _packed_layout(packed, n)
        self.kernel = Launch(_k()._decompress_kernel, (p.nblocks, rows), p.options, _words(0, pack))
        self.args = (n, row_stride, p.block, pack, TUNING.decompress_stream)

    def run(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        self.kernel(packed, out, *self.args)


def decompress(packed: torch.Tensor, out: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """Decompress the packed ``(chunks, 8 + n)`` uint8 tensor into the contiguous 1-D tensor ``out``.

    ``out``'s dtype (fp32, bf16 or fp16) is the dtype of the values; ``chunks * n`` elements.
    """
    current = _current(out)
    key = ("decompress", block, TUNING, current, *_key(packed), *_key(out))
    plan = _LAYOUTS.get(key)
    if plan is None:
        plan = _LAYOUTS.put(key, _Decompress(packed, out, block, current))
    if plan.device_switch:
        with torch.cuda.device(plan.index):
            plan.run(packed, out)
    else:
        plan.run(packed, out)
    return out


class _ReduceCompressed(_Runner):
    def __init__(self, received: torch.Tensor, out: torch.Tensor, block: int | None, current: int) -> None:
        world, n = received.shape[0], received.shape[1] - HEADER_BYTES
        _check_packed(received, None, n, received.device, "received")
        _check_packed(out, 1, n, received.device, "out")
        self._locate(received.device, current)
        p = _plan_for(received.device, n, 1, block)
        row_stride, pack = _packed_layout(received, n)
        if _packed_layout(out, n)[1] != pack:  # both word-aligned or neither: one layout inside the kernel
            row_stride, pack = received.stride(0), 1
        k = _k()
        self.table = Launch(k._decode_table_kernel, (world,), p.options, _words(0, pack))
        self.extrema = Launch(k._reduce_extrema_kernel, (p.programs,), p.options, _words(0, pack))
        self.quantise = Launch(k._reduce_quantise_kernel, (p.programs,), p.options,
                               _words(0, pack) + _words(3, pack))
        self.sizes = (p.programs * 2, world * 256)
        self.ints = (world, n, p.nblocks, p.programs, row_stride)
        self.consts = (p.block, pack)
        self.pb = p.pb

    def run(self, received: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        partials = _SCRATCH.get("reduce-extrema", self.device, self.index, self.sizes[0])
        tables = _SCRATCH.get("decode-tables", self.device, self.index, self.sizes[1])  # each row's 256 values
        self.table(received, tables, self.ints[4], self.consts[1])
        self.extrema(received, tables, partials, *self.ints, scale, *self.consts)
        self.quantise(received, tables, partials, out, *self.ints, scale, *self.consts, self.pb)


def reduce_compressed(
    received: torch.Tensor, scale: float, out: torch.Tensor, *, block: int | None = None
) -> torch.Tensor:
    """Bytegrad's owner step: ``out`` (``(1, 8 + n)`` uint8) := compress(scale * sum of the rows' values).

    ``received``: ``(world, 8 + n)`` packed chunks, one per rank. The rows are
    decompressed as :func:`decompress` would and summed in row order in float32, then
    multiplied by ``scale``; the sum is compressed with its own min/max. Two passes over
    ``received``; the sum is never stored.
    """
    current = _current(received)
    key = ("reduce", block, TUNING, current, *_key(received), *_key(out))
    plan = _LAYOUTS.get(key)
    if plan is None:
        plan = _LAYOUTS.put(key, _ReduceCompressed(received, out, block, current))
    if plan.device_switch:
        with torch.cuda.device(plan.index):
            plan.run(received, float(scale), out)
    else:
        plan.run(received, float(scale), out)
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
    current = _current(diff)
    tensors = (diff, left, weight) if right is None else (diff, left, right, weight)
    key = ("difference", block, TUNING, current, *_key(out),
           *(part for t in tensors for part in _key(t)))
    plan = _LAYOUTS.get(key)
    if plan is None:
        if any(t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.numel() != diff.numel()
               or t.device != diff.device for t in tensors):
            raise ValueError("weight_difference_compress needs contiguous 1-D float32 tensors of one length "
                             "on one device")
        plan = _LAYOUTS.put(key, _CompressRows(diff, 1, out, block, True, right is not None, current))
    a, b, c = (float(v) for v in coefficients)
    args = (diff, out, left, right if right is not None else left, weight, (a, b, c))
    if plan.device_switch:
        with torch.cuda.device(plan.index):
            plan.run(*args)
    else:
        plan.run(*args)
    return out


class _AddDecompressed(_Runner):
    def __init__(self, target: torch.Tensor, packed: torch.Tensor, block: int | None, current: int) -> None:
        n = packed.shape[1] - HEADER_BYTES
        _check_packed(packed, 1, n, target.device, "packed")
        if target.dtype != torch.float32 or target.dim() != 1 or not target.is_contiguous() or target.numel() != n:
            raise ValueError(f"target must be a contiguous 1-D float32 tensor of {n} elements, got "
                             f"{target.dtype} {tuple(target.shape)}")
        self._locate(target.device, current)
        p = _plan_for(target.device, n, 1, block)
        pack = _packed_layout(packed, n)[1]
        self.kernel = Launch(_k()._apply_kernel, (p.nblocks,), p.options, _words(0, pack))
        self.args = (n, p.block, pack)

    def run(self, target: torch.Tensor, packed: torch.Tensor) -> None:
        self.kernel(packed, target, *self.args)


def add_decompressed(target: torch.Tensor, packed: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """``target += decompress(packed)`` for a single-chunk ``(1, 8 + n)`` packed tensor; float32 ``target``."""
    current = _current(target)
    key = ("apply", block, TUNING, current, *_key(target), *_key(packed))
    plan = _LAYOUTS.get(key)
    if plan is None:
        plan = _LAYOUTS.put(key, _AddDecompressed(target, packed, block, current))
    if plan.device_switch:
        with torch.cuda.device(plan.index):
            plan.run(target, packed)
    else:
        plan.run(target, packed)
    return target
