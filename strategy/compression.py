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
    chunks = x.detach().float().view(num_chunks, -1)
    mins = chunks.amin(dim=1, keepdim=True)
    maxs = chunks.amax(dim=1, keepdim=True)
    scale = (maxs - mins) / LEVELS
    # A constant chunk has scale 0: every value decodes to min exactly.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((chunks - mins) / safe).round_().clamp_(0, LEVELS).to(torch.uint8)
    header = torch.cat([mins, maxs], dim=1).contiguous().view(torch.uint8)  # (num_chunks, 8)
    return torch.cat([header, q], dim=1)


def decompress_chunks(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`compress_chunks`: ``(num_chunks, 8 + n)`` uint8 to a 1-D tensor of ``dtype``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] < HEADER_BYTES:
        raise ValueError(f"expected a (chunks, 8 + n) uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    header = packed[:, :HEADER_BYTES].contiguous().view(torch.float32)  # (num_chunks, 2)
    mins, maxs = header[:, 0:1], header[:, 1:2]
    scale = (maxs - mins) / LEVELS
    values = packed[:, HEADER_BYTES:].float() * scale + mins
    return values.reshape(-1).to(dtype)


def max_quantisation_error(x: torch.Tensor, num_chunks: int) -> float:
    """The bound on ``|decompress(compress(x)) - x|``: half a level of the widest chunk (plus float slack)."""
    chunks = x.detach().float().view(num_chunks, -1)
    width = (chunks.amax(dim=1) - chunks.amin(dim=1)).max().item()
    return width / (2 * LEVELS) * (1 + 1e-5) + 1e-7
