"""Worker for tests/engine/test_compressed_exchange.py: one JSON per rank.

``python compressed_exchange_workers.py OUT_DIR`` (under torchrun's environment, Gloo)
runs the pipelined compressed exchange on buffers spanning several segments and
compares it with an unsegmented reference built from ``compress_chunks`` /
``decompress_chunks`` and plain collectives in the same run.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bagua_lightning.engine import compressed_comm as comm_module
from bagua_lightning.engine.chunk_format import LEVELS
from bagua_lightning.engine.compressed_comm import ExchangeBuffers, compressed_exchange_
from bagua_lightning.engine.compression import (
    compress_chunks,
    decompress_chunks,
    max_quantisation_error,
)

SEGMENT = 1000  # elements: chunks of a few thousand span several segments, the last one ragged


def reference(x: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    """The exchange's definition, unsegmented: compress, all-to-all, sum, recompress, all-gather."""
    packed = compress_chunks(x.float().clone(), k)
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed)
    mine = decompress_chunks(received).view(k, -1).sum(dim=0) * scale
    gathered = torch.empty_like(packed)
    dist.all_gather_into_tensor(gathered, compress_chunks(mine, 1))
    return decompress_chunks(gathered)


def level_of_reduced(x: torch.Tensor, k: int) -> float:
    """One quantisation level of the widest reduced chunk (what a rounding flip can move a value)."""
    return float(x.float().view(k, -1).amax(dim=1).sub(x.float().view(k, -1).amin(dim=1)).max()) / LEVELS


def case(n_per_chunk: int, dtype: torch.dtype, scale: float, buffers: ExchangeBuffers) -> dict[str, Any]:
    k = dist.get_world_size()
    torch.manual_seed(5 + dist.get_rank())
    x = (torch.randn(k * n_per_chunk) * torch.linspace(0.1, 4, k * n_per_chunk)).to(dtype)
    ref = reference(x, k, scale)
    y = x.clone()
    compressed_exchange_(y, None, k, scale=scale, buffers=buffers)
    same = y.clone()
    dist.broadcast(same, src=0)
    diff = (y.float() - ref).abs()
    exact = x.float().clone()
    dist.all_reduce(exact)
    exact *= scale
    # Bound: the first quantisation of every contribution (k of them, scaled), then that of the sum.
    local = torch.tensor([max_quantisation_error(x.float(), k)])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    first = float(local) * k * scale
    bound = first + max_quantisation_error(exact, k) + first / LEVELS + 1e-6
    return {
        "n": n_per_chunk,
        "dtype": str(dtype),
        "segments": len(comm_module._segment_bounds(n_per_chunk, x.device)),
        "max_diff_vs_reference": float(diff.max()),
        "level": level_of_reduced(ref, k),
        "flipped_fraction": float((diff > 0.5 * level_of_reduced(ref, k)).float().mean()),
        "identical_on_ranks": bool(torch.equal(same, y)),
        "dtype_kept": y.dtype == dtype,
        "err_vs_exact": float((y.float() - exact).abs().max()),
        "bound": bound,
        "width": float(exact.max() - exact.min()),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    result: dict[str, Any] = {}
    try:
        comm_module.PIPELINE_SEGMENT_ELEMENTS = SEGMENT
        buffers = ExchangeBuffers()  # reused across cases of different sizes: must reshape
        k = dist.get_world_size()
        result["cases"] = [
            case(3 * SEGMENT + 7, torch.float32, 1.0 / k, buffers),
            case(3 * SEGMENT + 7, torch.float32, 1.0 / k, buffers),  # same buffers again
            case(SEGMENT // 2, torch.float32, 1.0, buffers),  # one segment
            case(2 * SEGMENT + 1, torch.bfloat16, 1.0 / k, buffers),
        ]
    except Exception:  # reported to the test
        result["error"] = traceback.format_exc()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
