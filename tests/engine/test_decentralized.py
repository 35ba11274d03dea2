"""Decentralized SGD: peer selection logic, and real 2- and 4-rank Gloo runs of the algorithm."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.algorithms.decentralized import DecentralizedAlgorithm
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.topology import check_shift_one_world_size, ring_neighbours, shift_one_peer
from tests.engine.weight_averaging_workers import (
    decentralized_trace,
    decentralized_traces,
    make_model,
    make_plan,
    run_ranks,
)

# --- topology (plain functions) -------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4, 6, 8])
def test_shift_one_pairs_are_symmetric_and_rotate(world_size: int) -> None:
    half = world_size // 2
    seen: dict[int, set[int]] = {r: set() for r in range(world_size)}
    for round_index in range(half):
        for rank in range(world_size):
            peer = shift_one_peer(rank, world_size, round_index)
            assert peer != rank
            assert shift_one_peer(peer, world_size, round_index) == rank
            assert (rank < half) != (peer < half)  # lower half pairs with upper half
            seen[rank].add(peer)
    # over world_size/2 rounds every rank meets every rank of the other half
    assert all(len(peers) == half for peers in seen.values())
    if world_size > 2:
        assert shift_one_peer(0, world_size, 0) != shift_one_peer(0, world_size, 1)


def test_shift_one_rejects_odd_world_size_naming_it() -> None:
    with pytest.raises(ConfigurationError, match=r"even world size, got world size 3"):
        check_shift_one_world_size(3)
    with pytest.raises(ConfigurationError, match="world size 5"):
        shift_one_peer(0, 5, 0)
    assert shift_one_peer(0, 1, 7) == 0  # a single rank has nobody to pair with: a no-op, not an error


def test_ring_neighbours() -> None:
    assert ring_neighbours(0, 4) == (3, 1)
    assert ring_neighbours(3, 4) == (2, 0)
    assert ring_neighbours(0, 2) == (1, 1)
    with pytest.raises(ValueError, match="outside"):
        ring_neighbours(4, 4)


# --- configuration errors -------------------------------------------------------------------------


def test_registered_under_bagua_name_with_defaults() -> None:
    algo = get_algorithm_class("decentralized").from_kwargs()
    assert isinstance(algo, DecentralizedAlgorithm)
    assert (algo.hierarchical, algo.peer_selection_mode, algo.communication_interval) == (True, "all", 1)
    assert algo.keeps_replicas_identical is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"peer_selection_mode": "ring"}, r"peer_selection_mode='ring'.*'all', 'shift_one'"),
        ({"communication_interval": 0}, "communication_interval must be an int >= 1"),
        ({"hierarchical": "yes"}, "hierarchical must be True or False"),
        ({"average": True}, r"unknown argument\(s\) \['average'\]"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        DecentralizedAlgorithm.from_kwargs(**kwargs)


@pytest.mark.parametrize(
    ("world_size", "local_size", "match"),
    [(3, 1, "got world size 3"), (6, 2, "got number of nodes 3")],
)
def test_shift_one_setup_rejects_odd_participants(world_size: int, local_size: int, match: str) -> None:
    # The check runs before any collective, so a plain CommContext (no process group) is enough.
    comm = CommContext(rank=0, world_size=world_size, local_rank=0, local_size=local_size)
    algo = DecentralizedAlgorithm(peer_selection_mode="shift_one")
    model = make_model()
    with pytest.raises(ConfigurationError, match=match):
        algo.setup(model, comm, make_plan(model))


# --- real processes -------------------------------------------------------------------------------


def _stack(results: list[dict[str, Any]], key: str, step: int) -> torch.Tensor:
    return torch.stack([r[key][step] for r in results])


def test_all_two_ranks_identical_after_each_averaging_and_converges() -> None:
    steps = 12
    results = run_ranks(decentralized_trace, 2, {"peer_selection_mode": "all", "communication_interval": 2}, steps)
    for step in range(steps):
        before, after = _stack(results, "before", step), _stack(results, "after", step)
        if step % 2 == 0:
            # every rank holds the mean of the weights all ranks had at the start of the step
            torch.testing.assert_close(after[0], after[1], rtol=0, atol=0)
            torch.testing.assert_close(after[0], before.mean(0))
        else:
            assert torch.equal(after, before)  # a local step: no averaging
            if step > 1:
                assert not torch.equal(after[0], after[1])  # local gradients moved the ranks apart
    for r in results:
        assert r["end_loss"] < 0.5 * r["start_loss"]


def test_four_ranks_as_two_nodes_shift_one_flat_and_hierarchical() -> None:
    steps = 4
    configs = [
        {"peer_selection_mode": "shift_one", "hierarchical": False},
        {"peer_selection_mode": "all", "hierarchical": True},
        {"peer_selection_mode": "shift_one", "hierarchical": True},
    ]
    # One launch of 4 ranks declared as 2 nodes x 2 local ranks runs all three configurations.
    by_rank = run_ranks(decentralized_traces, 4, configs, steps, local_size=2)
    flat, hier_all, hier_shift = ([by_rank[r][i] for r in range(4)] for i in range(3))

    for step in range(steps):
        before, after = _stack(flat, "before", step), _stack(flat, "after", step)
        for rank in range(4):
            peer = flat[rank]["peers"][step]
            assert peer == shift_one_peer(rank, 4, step)
            torch.testing.assert_close(after[rank], (before[rank] + before[peer]) / 2)
    assert [flat[0]["peers"][s] for s in range(2)] == [2, 3]  # the peer changes every step
    for r in flat:
        assert r["end_loss"] < r["start_loss"]

    # Hierarchical: intra-node average on the leader, leaders exchange, broadcast within the node.
    # With two nodes "shift_one" pairs the two leaders, so both modes reach the global mean.
    for results in (hier_all, hier_shift):
        for step in range(steps):
            before, after = _stack(results, "before", step), _stack(results, "after", step)
            for rank in range(4):
                torch.testing.assert_close(after[rank], before.mean(0))
    assert [hier_shift[r]["peers"][0] for r in range(4)] == [2, None, 0, None]  # leaders only
    assert hier_all[0]["peers"][0] is None
