"""``BaguaStrategy(fault_tolerance=...)``: refusals at construction, and real nodes killed and healed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.fault_tolerance import FaultTolerance
from bagua_lightning.strategy.strategy import BaguaStrategy
from tests.front_door_nodes import kill_and_heal


@pytest.mark.parametrize("name", ["qadam", "low_precision_decentralized", "async"])
def test_algorithms_that_cannot_are_refused_at_construction_with_the_reason(name: str) -> None:
    with pytest.raises(MisconfigurationException, match=f"algorithm '{name}' cannot train fault-tolerantly: "):
        BaguaStrategy(algorithm=name, fault_tolerance=FaultTolerance(node_id="node0"))


def test_auto_autotune_and_bad_values_are_refused_naming_the_fix() -> None:
    with pytest.raises(MisconfigurationException, match=r"needs a fixed algorithm.*algorithm='gradient_allreduce'"):
        BaguaStrategy(algorithm="auto", fault_tolerance=True)
    with pytest.raises(MisconfigurationException, match="drop autotune=True"):
        BaguaStrategy(autotune=True, fault_tolerance=True)
    with pytest.raises(ConfigurationError, match=r"fault_tolerance must be a FaultTolerance, True or None, got 'yes'"):
        BaguaStrategy(fault_tolerance="yes")  # type: ignore[arg-type]


def test_without_fault_tolerance_the_strategy_is_unchanged() -> None:
    assert BaguaStrategy().fault_tolerance_steps is None
    assert BaguaStrategy(fault_tolerance=False).fault_tolerance_steps is None
    assert BaguaStrategy(algorithm="bytegrad", fault_tolerance=True)._elastic is not None


@pytest.mark.slow
def test_lightning_a_killed_node_leaves_the_other_training_and_heals_from_a_live_peer_when_back(
        tmp_path: Path) -> None:
    """2 nodes x 2 ranks under Lightning; kill -9 node1 mid-epoch; node0 finishes the epoch (its validation
    at the epoch's last index); node1 returns, heals (weights and global_step) and ends with node0."""
    node0, back = kill_and_heal(tmp_path, "bagua_lightning.examples.elastic_lightning", 2404)
    out = tmp_path / "out"
    for path in sorted(out.glob("*.jsonl")):  # global_step counts the job's committed steps, healed ones too
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert all(r["global_step"] == r["step"] + 1 for r in records), path.name
    steps = [json.loads(line)["global_step"] for line in (out / "node0-0.jsonl").read_text().splitlines()]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # one batch per committed step, none redone
    validated = json.loads((out / "node0-0.val.json").read_text())
    assert validated["global_step"] == steps[-1] and validated["epoch"] == 0  # epoch-end validation ran
    done = {re.search(r"done at global_step (\d+)", n.text()).group(1) for n in (node0, back)}  # type: ignore[union-attr]
    assert done == {str(steps[-1])}, done  # the healed node took the survivor's global_step
