"""The pipelined compressed exchange (ByteGrad's collective) on real Gloo jobs of 2 and 3 ranks.

Buffers span several pipeline segments (the last one ragged), are reused across
calls of different sizes, and hold float32 or bfloat16; the result must match the
unsegmented definition (compress, all-to-all, sum, recompress, all-gather) and be
identical on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ranks import run_ranks

WORKER = str(Path(__file__).with_name("compressed_exchange_workers.py"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_segmented_exchange_matches_the_unsegmented_definition(tmp_path: Path, world_size: int) -> None:
    run_ranks(WORKER, [str(tmp_path)], world_size=world_size, log_dir=tmp_path, timeout_s=120)
    for rank in range(world_size):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in res, res["error"]
        segments = [c["segments"] for c in res["cases"]]
        assert segments == [4, 4, 1, 3]
        for c in res["cases"]:
            assert c["identical_on_ranks"] and c["dtype_kept"], c
            assert 0 < c["err_vs_exact"] <= c["bound"] + (c["width"] / 128 if "bfloat16" in c["dtype"] else 0), c
            if c["dtype"] == "torch.float32":
                # Only float reordering of the sum differs: a rounding may flip by one level, rarely.
                assert c["max_diff_vs_reference"] <= c["level"] * 1.001 + 1e-6, c
                assert c["flipped_fraction"] < 0.01, c
            else:
                # bfloat16 holds the reference's values to 8 bits of mantissa.
                assert c["max_diff_vs_reference"] <= c["level"] + c["width"] / 128, c
