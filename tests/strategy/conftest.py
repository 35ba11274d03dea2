"""Backends for the strategy suites: Gloo always; NCCL (marked gpu) where enough CUDA devices exist."""

from __future__ import annotations

import pytest
import torch


def backend_params(world_size: int) -> list[object]:
    """``gloo`` and a ``gpu``-marked ``nccl`` that skips without ``world_size`` CUDA devices."""
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    return [
        pytest.param("gloo", id="gloo"),
        pytest.param(
            "nccl",
            id="nccl",
            marks=[pytest.mark.gpu,
                   pytest.mark.skipif(not enough, reason=f"needs {world_size} CUDA devices and NCCL")],
        ),
    ]
