"""What the multi-rank autotune tests read back from their workers, and the check they share: every rank
communicated with the same plan at every step, and it changed only at apply points."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_results(out: Path, prefix: str, n: int) -> list[dict[str, Any]]:
    res = [json.loads((out / f"{prefix}{r}.json").read_text()) for r in range(n)]
    for r in res:
        assert "error" not in r, r["error"]
    return res


def check_same_plan_every_step(records_per_rank: list[list[list[Any]]], interval: int = 3,
                                delay: int = 0) -> list[list[Any]]:
    """Every rank communicated with the same plan at every step; it changed during the run, at apply points."""
    first = records_per_rank[0]
    for other in records_per_rank[1:]:
        assert other == first
    changes = [first[i][0] for i in range(1, len(first)) if first[i][1:] != first[i - 1][1:]]
    assert len(changes) >= 2, f"the plan changed only at steps {changes}"
    assert all(step % interval == delay for step in changes), changes
    return first
