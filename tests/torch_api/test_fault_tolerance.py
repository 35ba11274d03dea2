"""``with_bagua(..., fault_tolerance=...)``: refusals, and real nodes killed and healed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.fault_tolerance import FaultTolerance
from tests.front_door_nodes import kill_and_heal


def test_without_fault_tolerance_there_is_no_elastic_sampler() -> None:
    import bagua_lightning.torch_api  # noqa: F401  (patches torch.nn.Module)

    model = torch.nn.Linear(2, 1)
    assert model.bagua_fault_tolerance is None  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match=r"needs with_bagua\(\.\.\., fault_tolerance=FaultTolerance\(\)\)"):
        model.bagua_batch_sampler(8, 2)  # type: ignore[attr-defined]


def test_a_custom_process_group_is_refused_naming_the_fix() -> None:
    import bagua_lightning.torch_api  # noqa: F401
    from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="leave process_group=None"):
        model.with_bagua([optimizer], GradientAllReduceAlgorithm(), process_group=object(),  # type: ignore[attr-defined]
                         fault_tolerance=FaultTolerance(node_id="node0"))


@pytest.mark.slow
def test_torch_api_a_killed_node_leaves_the_other_training_and_heals_from_a_live_peer_when_back(
        tmp_path: Path) -> None:
    """2 nodes x 2 ranks through with_bagua; kill -9 node1 mid-epoch; node0 finishes the epoch; node1 returns,
    heals and ends with node0's weights; each index of the epoch trained once."""
    kill_and_heal(tmp_path, "bagua_lightning.examples.elastic_torch_api", 2404)
