"""Contrib with Bagua's ``with_bagua`` on real Gloo ranks: fused optimizer per algorithm, MoE training."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ranks import run_ranks

WORKER = str(Path(__file__).with_name("bagua_workers.py"))


# The cases of one world size run in one job, one after the other (one start of the ranks for all).
@pytest.mark.parametrize(("cases", "world"), [("fused,fused_qadam_async,moe", 2), ("moe", 4)])
def test_contrib_under_with_bagua(tmp_path: Path, cases: str, world: int) -> None:
    out = run_ranks(WORKER, [cases], world_size=world, log_dir=tmp_path, timeout_s=240,
                    env={"CUDA_VISIBLE_DEVICES": ""})
    # " ok " lines per rank of each case, and a marker found only in that case's lines.
    oks = {"fused": (6, "fused "), "fused_qadam_async": (2, "fused qadam ok"), "moe": (2, "moe k=")}
    names = cases.split(",")
    assert out.count(" ok ") == world * sum(oks[c][0] for c in names), out
    for case in names:
        assert oks[case][1] in out, (case, out)
