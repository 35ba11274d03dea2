"""LowPrecisionDecentralizedAlgorithm through ``with_bagua`` computes Bagua's weights to the last bit.

The reference (``bagua_rule_workers.py``) is Bagua's update written independently in
numpy float32: ``x += l/3; x += r/3; x -= 5/3 w``, the whole bucket quantised as one
chunk with ``scale = 255 / (max - min + 1e-7)`` and levels ``round(x * scale) -
(round(max * scale) - 255)``, decoded as ``(level + lower) / scale``, then
``l += decode(left's)``, ``r += decode(right's)``, ``w += decode(own)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ranks import run_ranks

WORKERS = Path(__file__).with_name("bagua_rule_workers.py")


@pytest.mark.parametrize("world_size", [2, 3])  # one peer on both sides; two distinct neighbours
def test_low_precision_decentralized_equals_bagua_rule(tmp_path: Path, world_size: int) -> None:
    run_ranks(str(WORKERS), [str(tmp_path)], world_size=world_size, log_dir=tmp_path, timeout_s=240,
              env={"CUDA_VISIBLE_DEVICES": ""})
    for rank in range(world_size):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for interval in ("1", "2"):
            r = results[interval]
            assert r["buckets"] == 1, r  # one bucket: one chunk, as in Bagua
            assert r["moved"] > 1e-3, r  # the weights trained: equality is not trivially true
            assert r["weights_equal"], (rank, interval, r["max_difference"])
            assert r["replicas_equal"] == [True, True, True], (rank, interval, r)
