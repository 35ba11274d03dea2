"""The MinMax uint8 chunk format: what the torch path (:mod:`.compression`) and the Triton kernels
(:mod:`.kernels`) both write, byte for byte.

A chunk of ``n`` values is ``HEADER_BYTES + n`` bytes: its min and max as two float32, then each
value as one of ``LEVELS + 1`` levels spanning them.
"""

from __future__ import annotations

HEADER_BYTES = 8  # two float32: min, max
LEVELS = 255.0
#: Added to ``max - min`` before the scale is taken (Bagua's rule): a constant chunk still has a finite scale.
EPSILON = 1e-7
