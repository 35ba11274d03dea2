"""MinMax uint8 compression (Bagua's ``MinMaxUInt8``), shared by bytegrad, qadam and
low_precision_decentralized.

A chunk of ``n`` floats becomes ``8 + n`` bytes: its min and max as two float32
(the header), then each value quantised to 256 levels between them. Packing the
header and the payload in one ``uint8`` tensor lets one collective move both.
The worst-case error of a value is half a level: ``(max - min) / 510``.
"""

from __future__ import annotations

import torch

HEADER_BYTES = 8  # two float32: min, max
LEVELS = 255.0


def compressed_nbytes(num_elements: int) -> int:
    """Size in bytes of one compressed chunk of ``num_elements`` values."""
    return HEADER_BYTES + num_elements


def compress_chunks(x: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Compress each of ``num_chunks`` equal chunks of the 1-D float tensor ``x`` with its own min/max.

    ``x.numel()`` must be divisible by ``num_chunks``. Returns a ``uint8`` tensor of
    shape ``(num_chunks, 8 + x.numel() // num_chunks)``.
    """
    if x.dim() != 1:
        raise ValueError(f"compress_chunks expects a 1-D tensor, got shape {tuple(x.shape)}")
    if num_chunks <= 0 or x.numel() % num_chunks != 0:
        raise ValueError(f"cannot split {x.numel()} elements into {num_chunks} equal chunks")
    chunks = x.detach().view(num_chunks, -1)
    if chunks.dtype != torch.float32:
        chunks = chunks.float()
    mins, maxs = torch.aminmax(chunks, dim=1, keepdim=True)  # one pass for both
    width = maxs - mins
    # A constant chunk has width 0: every value encodes to 0 and decodes to min exactly.
    inv = torch.where(width > 0, LEVELS / width, torch.zeros_like(width))
    packed = torch.empty(num_chunks, HEADER_BYTES + chunks.shape[1], dtype=torch.uint8, device=x.device)
    packed[:, :HEADER_BYTES] = torch.cat([mins, maxs], dim=1).view(torch.uint8)
    # (x - min) * inv + 0.5, truncated by the uint8 cast, is round-half-up onto 0..255:
    # one fused multiply-add and one casting copy instead of sub/div/round/clamp passes.
    packed[:, HEADER_BYTES:] = torch.addcmul(0.5 - mins * inv, chunks, inv)
    return packed


def decompress_chunks(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`compress_chunks`: ``(num_chunks, 8 + n)`` uint8 to a 1-D tensor of ``dtype``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] < HEADER_BYTES:
        raise ValueError(f"expected a (chunks, 8 + n) uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    # Flatten first: a one-row slice counts as contiguous but keeps its row stride, which a
    # float32 view cannot take when 8 + n is not a multiple of 4.
    header = packed[:, :HEADER_BYTES].reshape(-1).view(torch.float32).view(-1, 2)  # (num_chunks, 2)
    mins, maxs = header[:, 0:1], header[:, 1:2]
    scale = (maxs - mins) / LEVELS
    values = torch.addcmul(mins, packed[:, HEADER_BYTES:].to(torch.float32), scale)
    return values.view(-1) if dtype == torch.float32 else values.view(-1).to(dtype)


def max_quantisation_error(x: torch.Tensor, num_chunks: int) -> float:
    """The bound on ``|decompress(compress(x)) - x|``: half a level of the widest chunk (plus float slack)."""
    chunks = x.detach().float().view(num_chunks, -1)
    width = (chunks.amax(dim=1) - chunks.amin(dim=1)).max().item()
    return width / (2 * LEVELS) * (1 + 1e-4) + 1e-7
