"""MinMax uint8 compression (Bagua's ``MinMaxUInt8``), shared by bytegrad, qadam and
low_precision_decentralized.

A chunk of ``n`` floats becomes ``8 + n`` bytes: its min and max as two float32
(the header), then each value as one of 256 levels spanning them, by Bagua's rule
(:class:`ChunkRanges`), so that results agree with Bagua's to the last bit. Packing the
header and the payload in one ``uint8`` tensor lets one collective move both.
The worst-case error of a value is half a level, ``(max - min + 1e-7) / 510``, plus
float32 rounding.

On CUDA the work goes to the fused Triton kernels of :mod:`bagua_lightning.engine.kernels`,
which write the same bytes and values as the torch code here (see ``docs/kernels.md``).

Speed matters on CPU (Gloo), where compression competes with the network for the
step time. Measured on one core, these choices each save a factor of 2-9 on a pass:
``out=`` buffers (a fresh 50 MB tensor costs more in page faults than the arithmetic
on it); no ``uint8`` operand and no 0-dim tensor scalar inside arithmetic (both take
unvectorised paths; CPU code loops over chunks with Python floats); the float ->
uint8 cast through int16; each chunk's extrema by a full reduction, not ``aminmax(dim=1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .chunk_format import EPSILON, HEADER_BYTES, LEVELS


def _use_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """True for values the Triton kernels handle (CUDA with Triton, fp32/bf16/fp16); the torch code otherwise."""
    if device.type != "cuda":
        return False
    return kernels.enabled(device) and dtype in kernels.DTYPES


def compressed_nbytes(num_elements: int) -> int:
    """Size in bytes of one compressed chunk of ``num_elements`` values."""
    return HEADER_BYTES + num_elements


def _chunk_extrema(chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (min, max) of a 2-D tensor as float32 ``(rows, 1)`` tensors."""
    if chunks.device.type == "cpu":
        # A full reduction per row is vectorised; the dim=1 reduction is not (~9x slower).
        extrema = [torch.aminmax(row) for row in chunks]
        mins = torch.stack([e.min for e in extrema]).view(-1, 1)
        maxs = torch.stack([e.max for e in extrema]).view(-1, 1)
    else:
        mins, maxs = torch.aminmax(chunks, dim=1, keepdim=True)
    return mins.float(), maxs.float()


def level_parameters(mins: torch.Tensor, maxs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, lower)`` of chunks with these float32 extrema (Bagua's MinMax uint8 rule, in float32).

    ``scale = 255 * (1 / (max - min + 1e-7))`` and ``lower = round(max * scale) - 255``,
    every operation rounded to float32 (``round``: to nearest even). Both paths and every
    rank derive them from the header with exactly these operations.
    """
    scale = (maxs - mins).add_(EPSILON).reciprocal_().mul_(LEVELS)
    return scale, (maxs * scale).round_().sub_(LEVELS)


@dataclass(frozen=True)
class ChunkRanges:
    """The quantisation ranges of ``rows`` chunks: ``(rows, 1)`` float32 tensors of their min and max.

    Bagua's MinMax uint8 rule: with ``scale`` and ``lower`` from :func:`level_parameters`,
    a value ``x`` becomes level ``clamp(round(x * scale) - lower, 0, 255)`` (round to
    nearest even; the levels sit on the integer multiples of ``1 / scale``, the top one at
    ``round(max * scale)``) and a level ``q`` decodes to ``(q + lower) / scale``. Every
    operation is a float32 operation; the error is at most half a level,
    ``(max - min + 1e-7) / 510``, plus float32 rounding (``2**-23 |x|`` at most).
    """

    mins: torch.Tensor
    maxs: torch.Tensor

    @classmethod
    def of(cls, chunks: torch.Tensor) -> ChunkRanges:
        """The ranges of the rows of the 2-D tensor ``chunks``."""
        mins, maxs = _chunk_extrema(chunks)
        return cls(mins=mins, maxs=maxs)

    def write_header(self, header: torch.Tensor) -> None:
        """Write min and max as two float32 into the ``(rows, 8)`` uint8 tensor ``header``."""
        header.copy_(torch.cat([self.mins, self.maxs], dim=1).view(torch.uint8))

    def quantise_into(
        self,
        values: torch.Tensor,
        out: torch.Tensor,
        *,
        overwrite_input: bool = False,
        scratch: torch.Tensor | None = None,
    ) -> None:
        """``out`` (uint8, ``(rows, m)``) := the levels of ``values`` (``(rows, m)``, a slice of the chunks).

        Args:
            values: float values, row ``i`` from chunk ``i``.
            out: where the levels go (e.g. a slice of a send buffer).
            overwrite_input: a float32 ``values`` may hold the scaled values afterwards (no temporary).
            scratch: on CPU, an int16 tensor of at least ``m`` elements reused for the cast.
        """
        scale, lower = level_parameters(self.mins, self.maxs)
        if values.device.type != "cpu":
            v = values if overwrite_input and values.dtype == torch.float32 else values.to(torch.float32, copy=True)
            out.copy_(v.mul_(scale).round_().sub_(lower).clamp_(0.0, LEVELS))
            return
        # CPU: row by row with Python scalars (0-dim tensor operands take a slow, unvectorised
        # path; a Python float holding a float32 value is the same float32 operand), and the
        # float -> uint8 cast through int16 (a direct one is not vectorised: 3x slower).
        m = values.shape[1]
        if scratch is None or scratch.numel() < m:
            scratch = torch.empty(m, dtype=torch.int16)
        ints = scratch[:m]
        for row, target, s, low in zip(values, out, scale.view(-1).tolist(), lower.view(-1).tolist(), strict=True):
            v = row if overwrite_input and row.dtype == torch.float32 else row.to(torch.float32, copy=True)
            v.mul_(s).round_().sub_(low).clamp_(0.0, LEVELS)
            ints.copy_(v)  # exact integers 0..255
            target.copy_(ints)


def read_header(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mins, maxs)`` of a ``(num_chunks, 8 + n)`` packed tensor, each a float32 ``(num_chunks, 1)``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] < HEADER_BYTES:
        raise ValueError(f"expected a (chunks, 8 + n) uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    # Flatten first: a one-row slice counts as contiguous but keeps its row stride, which a
    # float32 view cannot take when 8 + n is not a multiple of 4; a row that starts off a
    # 4-byte boundary (a later row of such a tensor) is copied.
    header_bytes = packed[:, :HEADER_BYTES].reshape(-1)
    if header_bytes.storage_offset() % 4:
        header_bytes = header_bytes.clone()
    header = header_bytes.view(torch.float32).view(-1, 2)  # (num_chunks, 2)
    return header[:, 0:1], header[:, 1:2]


def dequantise_into(levels: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (float32, ``(rows, m)``) := ``(level + lower) / scale`` for uint8 ``levels`` (see :class:`ChunkRanges`).

    ``mins``/``maxs``: ``(rows, 1)`` float32, as :func:`read_header` returns them. The
    cast to float32 is its own pass: a uint8 operand inside the arithmetic is several
    times slower on CPU, and so are 0-dim tensor scalars (CPU uses Python floats).
    """
    scale, lower = level_parameters(mins, maxs)
    if levels.device.type != "cpu":
        out.copy_(levels).add_(lower).div_(scale)  # the exact integers 0..255, then two float32 roundings
        return
    for row, target, s, low in zip(levels, out, scale.view(-1).tolist(), lower.view(-1).tolist(), strict=True):
        target.copy_(row).add_(low).div_(s)


def add_dequantised_(
    target: torch.Tensor, levels: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, scratch: torch.Tensor
) -> None:
    """``target += (levels + lower) / scale`` for one chunk: 1-D float32 ``target``, uint8 ``levels``.

    ``mins``/``maxs``: the chunk's ``(1, 1)`` float32 extrema; ``scratch``: float32 like
    ``target``. The decoded value and the sum are each rounded once to float32, as on the kernels.
    """
    scale, lower = level_parameters(mins, maxs)
    scratch.copy_(levels).add_(float(lower) if target.device.type == "cpu" else lower.view(()))
    # target + (level + lower) / scale: the quotient and the sum each rounded once, in one pass
    target.addcdiv_(scratch, scale.view(()))


def compress_chunks(
    x: torch.Tensor, num_chunks: int, *, out: torch.Tensor | None = None, overwrite_input: bool = False
) -> torch.Tensor:
    """Compress each of ``num_chunks`` equal chunks of the 1-D float tensor ``x`` with its own min/max.

    Args:
        x: 1-D float tensor; ``x.numel()`` must be divisible by ``num_chunks``.
        num_chunks: number of chunks, each quantised between its own min and max.
        out: a ``uint8`` tensor of shape ``(num_chunks, 8 + x.numel() // num_chunks)`` on
            ``x``'s device to write into (e.g. a send buffer reused every step); a new one if None.
        overwrite_input: allow using a float32 ``x`` as scratch space (its values are
            garbage afterwards): spares a temporary as large as ``x``.

    Returns:
        ``out``: row ``i`` is chunk ``i``'s min and max (two float32) then its values on 0..255.
    """
    if x.dim() != 1:
        raise ValueError(f"compress_chunks expects a 1-D tensor, got shape {tuple(x.shape)}")
    if num_chunks <= 0 or x.numel() % num_chunks != 0:
        raise ValueError(f"cannot split {x.numel()} elements into {num_chunks} equal chunks")
    chunks = x.detach().view(num_chunks, -1)
    shape = (num_chunks, HEADER_BYTES + chunks.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != shape or out.device != x.device:
        raise ValueError(
            f"out must be a uint8 tensor of shape {shape} on {x.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if _use_kernels(x.device, x.dtype):
        return kernels.compress(x.detach().contiguous(), num_chunks, out)
    ranges = ChunkRanges.of(chunks)
    ranges.write_header(out[:, :HEADER_BYTES])
    ranges.quantise_into(chunks, out[:, HEADER_BYTES:], overwrite_input=overwrite_input)
    return out


def decompress_chunks(
    packed: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`compress_chunks`: ``(num_chunks, 8 + n)`` uint8 to a 1-D tensor of ``dtype``.

    ``out`` (1-D, ``num_chunks * n`` elements of ``dtype``, contiguous, on ``packed``'s
    device) receives the values instead of a new tensor, e.g. a gradient bucket.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] < HEADER_BYTES:
        raise ValueError(f"expected a (chunks, 8 + n) uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    num_chunks, n = packed.shape[0], packed.shape[1] - HEADER_BYTES
    if out is None:
        out = torch.empty(num_chunks * n, dtype=dtype, device=packed.device)
    elif out.dtype != dtype or out.numel() != num_chunks * n or not out.is_contiguous() or out.device != packed.device:
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {num_chunks * n} elements on {packed.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if _use_kernels(packed.device, dtype) and packed.stride(1) == 1:
        return kernels.decompress(packed, out)  # the kernels read the header themselves
    mins, maxs = read_header(packed)
    target = out.view(num_chunks, n) if dtype == torch.float32 else torch.empty(num_chunks, n, device=out.device)
    dequantise_into(packed[:, HEADER_BYTES:], mins, maxs, target)
    if dtype != torch.float32:
        out.view(num_chunks, n).copy_(target)
    return out


def max_quantisation_error(x: torch.Tensor, num_chunks: int) -> float:
    """The bound on ``|decompress(compress(x)) - x|``: half a level of the widest chunk plus float32 rounding.

    Half a level is ``(max - min + 1e-7) / 510``; the float32 roundings of ``x * scale`` and of
    the decoded value add at most ``2**-22 |x|`` (counted here as ``2**-21 max |x|``).
    """
    chunks = x.detach().float().view(num_chunks, -1)
    width = (chunks.amax(dim=1) - chunks.amin(dim=1)).max().item()
    magnitude = chunks.abs().max().item()
    return (width + EPSILON) / (2 * LEVELS) * (1 + 1e-4) + magnitude * 2.0**-21 + 1e-7
