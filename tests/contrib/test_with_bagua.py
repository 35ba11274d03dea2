"""Contrib with Bagua's ``with_bagua`` on real Gloo ranks: fused optimizer per algorithm, MoE training."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ranks import run_ranks

WORKER = str(Path(__file__).with_name("bagua_workers.py"))


@pytest.mark.parametrize(("case", "world", "marker"), [("fused", 2, "fused"), ("fused_qadam_async", 2, "qadam"),
                                                       ("moe", 2, "moe k="), ("moe", 4, "moe k=")])
def test_contrib_under_with_bagua(tmp_path: Path, case: str, world: int, marker: str) -> None:
    out = run_ranks(WORKER, [case], world_size=world, log_dir=tmp_path, timeout_s=240,
                    env={"CUDA_VISIBLE_DEVICES": ""})
    expected = {"fused": 6, "qadam": 2, "moe k=": 2}[marker] * world
    assert out.count(" ok ") == expected, out
