"""The NCCL paths on one GPU: SyncBatchNorm's kernels and collectives, MoE on CUDA, fused + with_bagua."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HERE = Path(__file__).parent


@pytest.mark.parametrize("args", [["sync_bn"], ["moe", "--k", "1"], ["moe", "--k", "2"]], ids=["sync_bn", "moe1", "moe2"])
def test_nccl_one_gpu(tmp_path: Path, args: list[str]) -> None:
    out = run_ranks(str(HERE / "workers.py"), [*args, "--backend", "nccl"], world_size=1, log_dir=tmp_path)
    assert f"{args[0]} ok (nccl" in out


def test_fused_optimizer_with_bagua_wrapper_is_exact(tmp_path: Path) -> None:
    out = run_ranks(str(HERE / "gpu_workers.py"), [], world_size=1, log_dir=tmp_path)
    assert out.count(" ok") == 12, out
