"""The primitives through NCCL on a one-GPU group (world size 1): native collectives and the emulated ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.torch_api.launch import run_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_primitives_on_one_gpu(tmp_path: Path) -> None:
    out = run_case("primitives", world_size=1, log_dir=tmp_path, cuda=True)
    assert out.count("primitives ok") == 1
