"""Triton kernels of the MinMax uint8 format (see :mod:`bagua_lightning.engine.compression`).

Every kernel computes exactly what the CPU torch path computes, operation by
operation, so both paths produce the same bytes and the same values (Bagua's rule,
every operation a float32 operation):

* per chunk ``[lo, hi]``: ``scale = 255 * (1 / (hi - lo + 1e-7))``,
  ``lower = rint(hi * scale) - 255`` (``rint``: round to nearest even);
* level of ``x``: ``clamp(rint(x * scale) - lower, 0, 255)``;
* value of level ``q``: ``(q + lower) / scale``.

Divisions are ``div_rn`` (Triton's ``/`` on float32 is an approximate division), and
the launchers pass ``enable_fp_fusion=False``: a fused multiply-add rounds once where
the CPU path rounds twice, which would move an occasional value across a level
boundary.

Packed tensors are either the ``(rows, 8 + n)`` uint8 tensor itself (``PACK=1``) or,
when ``n`` is a multiple of 4 and the buffer 4-byte aligned, its int32 view
(``PACK=4``): the header is then two words holding the float bits, and each payload word
four levels, the first in the low byte (the little-endian layout of the same bytes).
Word stores move four levels per store instead of one.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_header(packed_ptr, row_start, PACK: tl.constexpr):
    """(lo, hi) float32 scalars of the row starting at element ``row_start`` of the packed tensor."""
    if PACK == 4:
        lo = tl.load(packed_ptr + row_start).to(tl.float32, bitcast=True)
        hi = tl.load(packed_ptr + row_start + 1).to(tl.float32, bitcast=True)
    else:
        idx = tl.arange(0, 4)
        b_lo = tl.load(packed_ptr + row_start + idx).to(tl.int32)
        b_hi = tl.load(packed_ptr + row_start + 4 + idx).to(tl.int32)
        lo = tl.sum(b_lo << (idx * 8), axis=0).to(tl.float32, bitcast=True)
        hi = tl.sum(b_hi << (idx * 8), axis=0).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _store_header(packed_ptr, row_start, lo, hi, PACK: tl.constexpr):
    if PACK == 4:
        tl.store(packed_ptr + row_start, lo.to(tl.int32, bitcast=True))
        tl.store(packed_ptr + row_start + 1, hi.to(tl.int32, bitcast=True))
    else:
        idx = tl.arange(0, 8)
        bits = tl.where(idx < 4, lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True))
        tl.store(packed_ptr + row_start + idx, ((bits >> ((idx % 4) * 8)) & 0xFF).to(tl.uint8))


@triton.jit
def _rint(t):
    """``t`` rounded to the nearest integer, ties to even (float32), as ``torch.round``.

    Adding and subtracting 2**23 rounds a float32 below 2**23 in magnitude to an integer
    in the current rounding mode (to nearest even); from 2**23 on every float32 is one.
    """
    big = tl.where(t < 0, -8388608.0, 8388608.0)
    return tl.where(tl.abs(t) < 8388608.0, (t + big) - big, t)


@triton.jit
def _level_parameters(lo, hi):
    """``(scale, lower)`` of the chunk ``[lo, hi]``: see the module docstring."""
    width = (hi - lo) + 1e-7
    scale = tl.math.div_rn(1.0, width) * 255.0
    return scale, _rint(hi * scale) - 255.0


@triton.jit
def _tile(b, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """Block ``b`` as a ``(BLOCK // PACK, PACK)`` tile: (element indices, packed-unit index of each tile row).

    A tile row is one packed word (``PACK=4``) or one byte (``PACK=1``).
    """
    return _tile_at(b * (BLOCK // PACK), BLOCK, PACK)


@triton.jit
def _tile_at(unit0, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """The ``(BLOCK // PACK, PACK)`` tile of packed units ``unit0, unit0 + 1, ...``: (element indices, units)."""
    rows = unit0 + tl.arange(0, BLOCK // PACK)
    cols = tl.arange(0, PACK)
    return rows[:, None] * PACK + cols[None, :], rows


@triton.jit
def _load_levels(packed_ptr, row_start, units, n, PACK: tl.constexpr):
    """Levels (int32, a ``(len(units), PACK)`` tile) of the packed units ``units`` of one packed row.

    ``n``: the first element not to read (the row's length, or the end of a program's span; a
    multiple of 4 with ``PACK=4``).
    """
    if PACK == 4:
        words = tl.load(packed_ptr + row_start + 2 + units, mask=units * 4 < n, other=0)
        return (words[:, None] >> (tl.arange(0, 4)[None, :] * 8)) & 0xFF
    else:
        return tl.load(packed_ptr + row_start + 8 + units[:, None], mask=units[:, None] < n, other=0).to(tl.int32)


@triton.jit
def _store_levels(packed_ptr, row_start, units, q, n, PACK: tl.constexpr, STREAM: tl.constexpr):
    """Store the int32 levels ``q`` (a ``(len(units), PACK)`` tile) into one packed row, up to element ``n``.

    ``STREAM``: the stores are marked first to be evicted from L2 (they are not read again by this
    launch), so that they do not push out values that are about to be re-read.
    """
    if PACK == 4:
        words = tl.sum(q << (tl.arange(0, 4)[None, :] * 8), axis=1)  # disjoint bytes: the sum is an OR
        if STREAM:
            tl.store(packed_ptr + row_start + 2 + units, words, mask=units * 4 < n, eviction_policy="evict_first")
        else:
            tl.store(packed_ptr + row_start + 2 + units, words, mask=units * 4 < n)
    else:
        if STREAM:
            tl.store(packed_ptr + row_start + 8 + units[:, None], q.to(tl.uint8), mask=units[:, None] < n,
                     eviction_policy="evict_first")
        else:
            tl.store(packed_ptr + row_start + 8 + units[:, None], q.to(tl.uint8), mask=units[:, None] < n)


@triton.jit
def _quantise(v, scale, lower):
    t = _rint(v * scale) - lower
    return tl.minimum(tl.maximum(t, 0.0), 255.0).to(tl.int32)  # exact integers 0..255: the cast is exact


@triton.jit
def _decoded(q, scale, lower):
    return tl.math.div_rn(q.to(tl.float32) + lower, scale)


@triton.jit
def _to_dtype(v, dtype: tl.constexpr):
    """float32 ``v`` rounded to nearest even in ``dtype``, as torch's ``copy_`` rounds.

    bfloat16 by integer rounding of the bits: the same on the GPU and in Triton's
    interpreter (which truncates in its own float32 -> bfloat16 cast). Finite inputs.
    """
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float32:
        return v
    else:
        return v.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _min_nan(a, b):
    # NaN wins, as in torch.aminmax: a NaN gradient gives a NaN header and decodes to NaN (so a
    # GradScaler still sees it) instead of being quietly dropped from the extrema.
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _partials_store(part_ptr, slot, lo, hi):
    tl.store(part_ptr + slot * 2, lo)
    tl.store(part_ptr + slot * 2 + 1, hi)


@triton.jit
def _partials_reduce(part_ptr, c, P, PB: tl.constexpr):
    """Chunk ``c``'s (lo, hi) from its ``P`` partial extrema (``PB``: a power of two >= P)."""
    i = tl.arange(0, PB)
    base = (c * P + i) * 2
    lo = tl.reduce(tl.load(part_ptr + base, mask=i < P, other=float("inf")), 0, _min_nan)
    hi = tl.reduce(tl.load(part_ptr + base + 1, mask=i < P, other=float("-inf")), 0, _max_nan)
    return lo, hi


@triton.jit
def _extrema_kernel(
    src_ptr, left_ptr, right_ptr, weight_ptr, part_ptr, n, span, iters, P,
    c_left, c_right, c_weight,
    BLOCK: tl.constexpr, COMBINE: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Pass 1 of a compression: partial extrema of program ``p``'s span of chunk ``program_id(1)``.

    Program ``p`` reads elements ``[p * span, min((p + 1) * span, n))`` of its chunk, ``iters``
    blocks of ``BLOCK`` from the front (``span``: a multiple of 4; the programs of a chunk move
    the same bytes, so none of them is left with one block more than the others).

    ``COMBINE``: the values are ``((src + c_left * left) + c_right * right) + c_weight * weight``,
    each product and sum rounded (low_precision_decentralized's weight difference; without
    ``HAS_RIGHT`` the left term is added twice), written back into ``src`` so that pass 2
    reads one tensor instead of four.
    """
    p = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    base = c * n
    start = p * span
    end = tl.minimum(start + span, n)
    lo_acc = tl.full([BLOCK], float("inf"), tl.float32)
    hi_acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for i in range(iters):
        idx = start + i * BLOCK + tl.arange(0, BLOCK)
        m = idx < end
        v = tl.load(src_ptr + base + idx, mask=m, other=0.0).to(tl.float32)
        if COMBINE:
            from_left = c_left * tl.load(left_ptr + base + idx, mask=m, other=0.0)
            v = v + from_left
            if HAS_RIGHT:
                v = v + c_right * tl.load(right_ptr + base + idx, mask=m, other=0.0)
            else:  # one peer is both neighbours: its term is added twice
                v = v + from_left
            v = v + c_weight * tl.load(weight_ptr + base + idx, mask=m, other=0.0)
            tl.store(src_ptr + base + idx, v, mask=m)
        lo_acc = _min_nan(lo_acc, tl.where(m, v, float("inf")))
        hi_acc = _max_nan(hi_acc, tl.where(m, v, float("-inf")))
    _partials_store(part_ptr, c * P + p, tl.reduce(lo_acc, 0, _min_nan), tl.reduce(hi_acc, 0, _max_nan))


@triton.jit
def _quantise_kernel(
    src_ptr, part_ptr, out_ptr, n, span_units, iters, P, row_stride,
    BLOCK: tl.constexpr, PACK: tl.constexpr, PB: tl.constexpr, REVERSE: tl.constexpr, STREAM: tl.constexpr,
):
    """Pass 2 of a compression: header and levels of program ``p``'s span of chunk ``program_id(1)``.

    The spans are pass 1's (``span_units`` packed units of ``PACK`` elements each). ``REVERSE``:
    each program walks its span from the back, so it first re-reads what pass 1 read last,
    which is still in L2.
    """
    p = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    lo, hi = _partials_reduce(part_ptr, c, P, PB)
    row = c * row_stride
    if p == 0:
        _store_header(out_ptr, row, lo, hi, PACK)
    scale, lower = _level_parameters(lo, hi)
    end = tl.minimum((p + 1) * span_units * PACK, n)
    for i in range(iters):
        if REVERSE:
            unit0 = p * span_units + (iters - 1 - i) * (BLOCK // PACK)
        else:
            unit0 = p * span_units + i * (BLOCK // PACK)
        idx, units = _tile_at(unit0, BLOCK, PACK)
        v = tl.load(src_ptr + c * n + idx, mask=idx < end, other=0.0).to(tl.float32)
        _store_levels(out_ptr, row, units, _quantise(v, scale, lower), end, PACK, STREAM)


@triton.jit
def _decompress_kernel(packed_ptr, out_ptr, n, row_stride, BLOCK: tl.constexpr, PACK: tl.constexpr,
                       STREAM: tl.constexpr):
    """Values of block ``program_id(0)`` of chunk ``program_id(1)``, in ``out``'s dtype.

    One block per program: on an H200 this beat a span of blocks per program (0.84 of copy bandwidth
    against 0.64 at 100 MiB, ``compression_kernels.py --sweep``), and 4096-element blocks of 8 warps (0.81).
    ``STREAM``: how the values are stored: 0 plainly, 1 marked first to be evicted from L2, 2 as streaming
    stores (``st.global.cs``: not expected to be read again soon).
    """
    b = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    row = c * row_stride
    lo, hi = _load_header(packed_ptr, row, PACK)
    idx, units = _tile(b, BLOCK, PACK)
    scale, lower = _level_parameters(lo, hi)
    v = _to_dtype(_decoded(_load_levels(packed_ptr, row, units, n, PACK), scale, lower), out_ptr.dtype.element_ty)
    if STREAM == 1:
        tl.store(out_ptr + c * n + idx, v, mask=idx < n, eviction_policy="evict_first")
    elif STREAM == 2:
        tl.store(out_ptr + c * n + idx, v, mask=idx < n, cache_modifier=".cs")
    else:
        tl.store(out_ptr + c * n + idx, v, mask=idx < n)


@triton.jit
def _apply_kernel(packed_ptr, target_ptr, n, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """``target += decompress(packed)`` for one single-chunk packed row (float32 target): one rounding of the sum."""
    b = tl.program_id(0)
    lo, hi = _load_header(packed_ptr, 0, PACK)
    scale, lower = _level_parameters(lo, hi)
    idx, units = _tile(b, BLOCK, PACK)
    m = idx < n
    t = tl.load(target_ptr + idx, mask=m, other=0.0)
    tl.store(target_ptr + idx, t + _decoded(_load_levels(packed_ptr, 0, units, n, PACK), scale, lower), mask=m)


@triton.jit
def _decode_table_kernel(recv_ptr, table_ptr, row_stride, PACK: tl.constexpr):
    """The 256 decoded values of row ``program_id(0)``'s levels, for the owner step's lookups.

    A level decodes with a correctly rounded division; the owner step decodes every received
    value twice, so it looks the values up (the same bits) instead of dividing.
    """
    i = tl.program_id(0)
    lo, hi = _load_header(recv_ptr, i * row_stride, PACK)
    scale, lower = _level_parameters(lo, hi)
    q = tl.arange(0, 256)
    tl.store(table_ptr + i * 256 + q, _decoded(q, scale, lower))


@triton.jit
def _reduced(recv_ptr, table_ptr, world, row_stride, units, n, scale, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """``scale * sum_i decompress(row i)`` at the packed units ``units``, summed in row order."""
    acc = tl.zeros([BLOCK // PACK, PACK], tl.float32)
    for i in range(world):
        q = _load_levels(recv_ptr, i * row_stride, units, n, PACK)
        acc = acc + tl.load(table_ptr + i * 256 + q)
    return acc * scale


@triton.jit
def _reduce_extrema_kernel(
    recv_ptr, table_ptr, part_ptr, world, n, nblocks, P, row_stride, scale, BLOCK: tl.constexpr, PACK: tl.constexpr,
):
    """Pass 1 of bytegrad's owner step: partial extrema of the reduced chunk (never stored)."""
    p = tl.program_id(0)
    lo_acc = tl.full([BLOCK // PACK, PACK], float("inf"), tl.float32)
    hi_acc = tl.full([BLOCK // PACK, PACK], float("-inf"), tl.float32)
    for b in range(p, nblocks, P):
        idx, units = _tile(b, BLOCK, PACK)
        m = idx < n
        v = _reduced(recv_ptr, table_ptr, world, row_stride, units, n, scale, BLOCK, PACK)
        lo_acc = _min_nan(lo_acc, tl.where(m, v, float("inf")))
        hi_acc = _max_nan(hi_acc, tl.where(m, v, float("-inf")))
    _partials_store(part_ptr, p, tl.reduce(tl.reduce(lo_acc, 1, _min_nan), 0, _min_nan),
                    tl.reduce(tl.reduce(hi_acc, 1, _max_nan), 0, _max_nan))


@triton.jit
def _reduce_quantise_kernel(
    recv_ptr, table_ptr, part_ptr, out_ptr, world, n, nblocks, P, row_stride, scale,
    BLOCK: tl.constexpr, PACK: tl.constexpr, PB: tl.constexpr,
):
    """Pass 2 of bytegrad's owner step: the reduced chunk, recomputed and compressed into ``out``'s row."""
    p = tl.program_id(0)
    lo, hi = _partials_reduce(part_ptr, 0, P, PB)
    if p == 0:
        _store_header(out_ptr, 0, lo, hi, PACK)
    q_scale, lower = _level_parameters(lo, hi)
    for b in range(p, nblocks, P):
        _, units = _tile(b, BLOCK, PACK)
        v = _reduced(recv_ptr, table_ptr, world, row_stride, units, n, scale, BLOCK, PACK)
        _store_levels(out_ptr, 0, units, _quantise(v, q_scale, lower), n, PACK, False)
