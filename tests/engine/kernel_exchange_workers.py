"""Worker for tests/engine/test_kernels.py: bytegrad's exchange through the fused kernels, one JSON per rank.

``python kernel_exchange_workers.py OUT_DIR`` under torchrun's environment (Gloo) with
``TRITON_INTERPRET=1``: the exchange is routed to the kernel path (the one CUDA
tensors take) on CPU tensors, run by Triton's interpreter, and compared with the
exchange's definition built from the CPU torch path and plain collectives.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bagua_lightning.engine import comm as comm_module
from bagua_lightning.engine.compressed_comm import ExchangeBuffers, compressed_exchange_
from tests.engine.compressed_exchange_workers import reference


def case(n_per_chunk: int, dtype: torch.dtype, scale: float, buffers: ExchangeBuffers) -> dict[str, Any]:
    k = dist.get_world_size()
    torch.manual_seed(11 + dist.get_rank())
    x = (torch.randn(k * n_per_chunk) * torch.linspace(0.1, 4, k * n_per_chunk)).to(dtype)
    ref = reference(x, k, scale).to(dtype)  # float32 values, rounded as a bucket of ``dtype`` holds them
    y = x.clone()
    compressed_exchange_(y, None, k, scale=scale, buffers=buffers)
    same = y.clone()
    dist.broadcast(same, src=0)
    return {
        "n": n_per_chunk,
        "dtype": str(dtype),
        "equal_to_reference": bool(torch.equal(y, ref)),
        "max_diff": float((y.float() - ref.float()).abs().max()),
        "identical_on_ranks": bool(torch.equal(same, y)),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    result: dict[str, Any] = {}
    try:
        comm_module._kernels_for = lambda device: True  # CPU tensors through the (interpreted) kernel path
        buffers = ExchangeBuffers()
        k = dist.get_world_size()
        result["cases"] = [
            case(40, torch.float32, 1.0 / k, buffers),   # word layout
            case(37, torch.float32, 1.0, buffers),       # byte layout, buffers reshaped
            case(24, torch.bfloat16, 1.0 / k, buffers),  # the bucket's own dtype in and out
        ]
    except Exception:  # reported to the test
        result["error"] = traceback.format_exc()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
