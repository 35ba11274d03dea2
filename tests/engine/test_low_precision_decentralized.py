"""Low precision decentralized SGD: real Gloo runs on a ring of 2 and 4 ranks, and a 2 x 2 hierarchical run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from tests.engine.weight_averaging_workers import low_precision_trace, low_precision_traces, run_ranks


def test_registered_with_bagua_defaults_and_validates() -> None:
    algo = get_algorithm_class("low_precision_decentralized").from_kwargs()
    assert isinstance(algo, LowPrecisionDecentralizedAlgorithm)
    assert (algo.hierarchical, algo.communication_interval) == (True, 1)
    with pytest.raises(ConfigurationError, match=r"got -1"):
        LowPrecisionDecentralizedAlgorithm(communication_interval=-1)
    with pytest.raises(ConfigurationError, match=r"unknown argument\(s\) \['peer_selection_mode'\]"):
        LowPrecisionDecentralizedAlgorithm.from_kwargs(peer_selection_mode="all")


def _check_ring(results: list[dict[str, Any]]) -> None:
    """Neighbours hold bit-identical copies of each other's public weights, and every rank converged."""
    n = len(results)
    for rank, r in enumerate(results):
        left, right = r["neighbours"]
        assert (left, right) == ((rank - 1) % n, (rank + 1) % n)
        for mine, theirs in zip(r["replicas"]["left"], results[left]["replicas"]["weight"], strict=True):
            assert torch.equal(mine, theirs)
        for mine, theirs in zip(r["replicas"]["right"], results[right]["replicas"]["weight"], strict=True):
            assert torch.equal(mine, theirs)
        # each update lands within the uint8 quantisation bound of the neighbourhood-average target
        assert r["worst_excess"] <= 1e-6
        assert r["model_equals_replica"]
        assert r["end_loss"] < 0.5 * r["start_loss"]
        assert r["restored_ok"]  # after load_state_dict the replicas are rebuilt from the loaded weights


def test_two_ranks_converge_with_consistent_replicas() -> None:
    results = run_ranks(low_precision_trace, 2, {"hierarchical": False}, 30)
    _check_ring(results)
    # Weights are pulled toward each other: far closer than the distance they move from the start.
    spread = (results[0]["weights"] - results[1]["weights"]).abs().max().item()
    assert spread < 0.05


def test_four_ranks_ring_and_two_nodes_hierarchical() -> None:
    configs = [{"hierarchical": False, "communication_interval": 2}, {"hierarchical": True}]
    by_rank = run_ranks(low_precision_traces, 4, configs, 30, local_size=2)
    ring, hier = ([by_rank[r][i] for r in range(4)] for i in range(2))
    _check_ring(ring)
    # 2 nodes x 2: node leaders (ranks 0 and 2) run the ring for their node, then broadcast in it.
    assert [r["neighbours"] for r in hier] == [(2, 2), None, (0, 0), None]
    for leader, other in ((0, 2), (2, 0)):
        for mine, theirs in zip(hier[leader]["replicas"]["left"], hier[other]["replicas"]["weight"], strict=True):
            assert torch.equal(mine, theirs)
    assert torch.equal(hier[0]["weights"], hier[1]["weights"]) and torch.equal(hier[2]["weights"], hier[3]["weights"])
    for r in hier:
        assert r["end_loss"] < 0.5 * r["start_loss"]
        assert r["restored_ok"]
