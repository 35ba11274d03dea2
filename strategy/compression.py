"""MinMax uint8 compression (Bagua's ``MinMaxUInt8``), shared by bytegrad, qadam and
low_precision_decentralized.

A chunk of ``n`` floats becomes ``8 + n`` bytes: its min and max as two float32
(the header), then each value quantised to 256 levels between them. Packing the
header and the payload in one ``uint8`` tensor lets one collective move both.
The worst-case error of a value is half a level: ``(max - min) / 510``.

Speed matters on CPU (Gloo), where compression competes with the network for the
step time: the functions take ``out=`` buffers (a fresh 50 MB tensor costs more in
page faults than the arithmetic on it), never mix ``uint8`` and float operands in
one arithmetic op (PyTorch's CPU kernels fall back to a slow per-element cast), and
find each chunk's extrema with a full reduction per chunk (on CPU several times
faster than ``aminmax(dim=1)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_BYTES = 8  # two float32: min, max
LEVELS = 255.0


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


@dataclass(frozen=True)
class ChunkRanges:
    """The quantisation of ``rows`` chunks: ``(rows, 1)`` float32 tensors.

    Attributes:
        mins: each chunk's minimum (decodes from level 0).
        maxs: each chunk's maximum (decodes from level 255).
        inv: levels per unit, ``255 / (max - min)`` (0 for a constant chunk).
        bias: ``0.5 - min * inv``: ``x * inv + bias`` truncated is round-half-up onto 0..255.
    """

    mins: torch.Tensor
    maxs: torch.Tensor
    inv: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def of(cls, chunks: torch.Tensor) -> ChunkRanges:
        """The ranges of the rows of the 2-D tensor ``chunks``."""
        mins, maxs = _chunk_extrema(chunks)
        width = maxs - mins
        # A constant chunk has width 0: every value encodes to 0 and decodes to min exactly.
        inv = torch.where(width > 0, LEVELS / width, torch.zeros_like(width))
        return cls(mins=mins, maxs=maxs, inv=inv, bias=0.5 - mins * inv)

    def write_header(self, header: torch.Tensor) -> None:
        """Write min and max as two float32 into the ``(rows, 8)`` uint8 tensor ``header``."""
        header.copy_(torch.cat([self.mins, self.maxs], dim=1).view(torch.uint8))

    def quantise_into(self, values: torch.Tensor, out: torch.Tensor, *, overwrite_input: bool = False) -> None:
        """``out`` (uint8, ``(rows, m)``) := the levels of ``values`` (``(rows, m)``, a slice of the chunks).

        One fused multiply-add and one casting copy instead of sub/div/round/clamp passes.
        ``overwrite_input``: a float32 ``values`` holds the scaled values afterwards (no temporary).
        """
        if overwrite_input and values.dtype == torch.float32:
            scaled = torch.addcmul(self.bias, values, self.inv, out=values)
        else:
            scaled = torch.addcmul(self.bias, values.float(), self.inv)
        out.copy_(scaled)


def read_header(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mins, maxs)`` of a ``(num_chunks, 8 + n)`` packed tensor, each a float32 ``(num_chunks, 1)``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] < HEADER_BYTES:
        raise ValueError(f"expected a (chunks, 8 + n) uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    # Flatten first: a one-row slice counts as contiguous but keeps its row stride, which a
    # float32 view cannot take when 8 + n is not a multiple of 4.
    header = packed[:, :HEADER_BYTES].reshape(-1).view(torch.float32).view(-1, 2)  # (num_chunks, 2)
    return header[:, 0:1], header[:, 1:2]


def dequantise_into(levels: torch.Tensor, mins: torch.Tensor, steps: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (float32, ``(rows, m)``) := ``mins + levels * steps`` for uint8 ``levels`` of that shape.

    ``steps`` is ``(max - min) / 255`` per row. The cast to float32 is its own pass: a
    uint8 operand inside the multiply-add is several times slower on CPU.
    """
    out.copy_(levels)  # the exact integers 0..255
    torch.addcmul(mins, out, steps, out=out)


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
    mins, maxs = read_header(packed)
    num_chunks, n = packed.shape[0], packed.shape[1] - HEADER_BYTES
    if out is None:
        out = torch.empty(num_chunks * n, dtype=dtype, device=packed.device)
    elif out.dtype != dtype or out.numel() != num_chunks * n or not out.is_contiguous() or out.device != packed.device:
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {num_chunks * n} elements on {packed.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    target = out.view(num_chunks, n) if dtype == torch.float32 else torch.empty(num_chunks, n, device=out.device)
    dequantise_into(packed[:, HEADER_BYTES:], mins, (maxs - mins) / LEVELS, target)
    if dtype != torch.float32:
        out.view(num_chunks, n).copy_(target)
    return out


def max_quantisation_error(x: torch.Tensor, num_chunks: int) -> float:
    """The bound on ``|decompress(compress(x)) - x|``: half a level of the widest chunk (plus float slack)."""
    chunks = x.detach().float().view(num_chunks, -1)
    width = (chunks.amax(dim=1) - chunks.amin(dim=1)).max().item()
    return width / (2 * LEVELS) * (1 + 1e-4) + 1e-7
