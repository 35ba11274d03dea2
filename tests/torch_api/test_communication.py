"""Every primitive of ``bagua_lightning.torch_api.communication`` on real Gloo ranks, values checked on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_api.launch import run_case


@pytest.mark.parametrize("world_size", [2, 4])
def test_primitives(world_size: int, tmp_path: Path) -> None:
    out = run_case("primitives", world_size=world_size, log_dir=tmp_path)
    assert out.count("primitives ok") == world_size
