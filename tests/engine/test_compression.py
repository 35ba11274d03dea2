"""MinMax uint8 compression: round trip within the documented bound, constant chunks exact."""

from __future__ import annotations

import pytest
import torch

from bagua_lightning.engine.compression import (
    compress_chunks,
    compressed_nbytes,
    decompress_chunks,
    max_quantisation_error,
)


@pytest.mark.parametrize("num_chunks", [1, 2, 4])
def test_round_trip_error_is_within_half_a_level(num_chunks: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.linspace(0.1, 10, 4096)
    packed = compress_chunks(x, num_chunks)
    assert packed.dtype == torch.uint8
    assert packed.shape == (num_chunks, compressed_nbytes(4096 // num_chunks))
    y = decompress_chunks(packed)
    err = (y - x).abs().max().item()
    assert err <= max_quantisation_error(x, num_chunks)
    assert err > 0  # it really is lossy: the test would catch a pass-through


def test_each_chunk_keeps_its_own_range() -> None:
    x = torch.cat([torch.full((8,), 5.0), torch.linspace(-1, 1, 8)])
    y = decompress_chunks(compress_chunks(x, 2))
    # the constant chunk's levels are 1e-7 / 255 apart, not the other chunk's 2 / 255
    assert (y[:8] - 5.0).abs().max().item() <= max_quantisation_error(x[:8], 1) < 1e-5
    assert (y[8:] - x[8:]).abs().max().item() <= max_quantisation_error(x[8:], 1) < 2 / 255
    zeros = decompress_chunks(compress_chunks(torch.zeros(6), 1))
    assert torch.equal(zeros, torch.zeros(6))  # an all-zero chunk (an unused gradient) decodes exactly


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="equal chunks"):
        compress_chunks(torch.zeros(10), 3)
    with pytest.raises(ValueError, match="1-D"):
        compress_chunks(torch.zeros(2, 2), 1)
    with pytest.raises(ValueError, match="uint8"):
        decompress_chunks(torch.zeros(2, 10))


@pytest.mark.parametrize("n", [1, 5, 6, 7])
def test_single_chunk_of_any_length_round_trips(n: int) -> None:
    # 8 + n not a multiple of 4 once broke the float32 view of the header.
    x = torch.arange(n, dtype=torch.float32) - 2.5
    y = decompress_chunks(compress_chunks(x, 1))
    assert (y - x).abs().max().item() <= max_quantisation_error(x, 1)


def test_bf16_input_decompresses_to_the_requested_dtype() -> None:
    x = torch.linspace(-3, 3, 64).to(torch.bfloat16)
    y = decompress_chunks(compress_chunks(x, 4), dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert (y.float() - x.float()).abs().max().item() <= max_quantisation_error(x.float(), 4) + 0.02


def test_decoding_yields_no_subnormal_floats() -> None:
    # Subnormal gradients cost Intel CPUs a microcode assist per operand: the decoded values are whole
    # levels of at least (max - min + 1e-7) / 255, so values far below the normal range decode to 0 or to
    # normal floats, never to subnormals (the slow CPU steps of a benchmark came from its model instead).
    tiny = torch.finfo(torch.float32).tiny
    x = torch.cat([torch.full((64,), tiny / 8), torch.linspace(-3 * tiny, 3 * tiny, 64), torch.zeros(64)])
    for values in (x, x + torch.linspace(-1e-3, 1e-3, 192)):
        y = decompress_chunks(compress_chunks(values, 2))
        a = y.abs()
        assert not bool(((a > 0) & (a < tiny)).any()), y
