"""Asynchronous model averaging: argument checks, and a real 2-rank Gloo run through the module wrapper."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from tests.engine.weight_averaging_workers import async_scenarios, run_ranks


def test_registered_as_async_with_bagua_defaults() -> None:
    algo = get_algorithm_class("async").from_kwargs()
    assert isinstance(algo, AsyncModelAverageAlgorithm)
    assert (algo.peer_selection_mode, algo.sync_interval_ms, algo.warmup_steps) == ("all", 500, 0)
    assert algo.keeps_replicas_identical is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_interval_ms": 0}, "sync_interval_ms must be a number of milliseconds > 0, got 0"),
        ({"warmup_steps": -2}, "warmup_steps must be an int >= 0"),
        ({"peer_selection_mode": "shift_one"}, "peer_selection_mode=\"all\" only, got 'shift_one'"),
        ({"communication_interval": 2}, r"unknown argument\(s\) \['communication_interval'\]"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        AsyncModelAverageAlgorithm.from_kwargs(**kwargs)


def test_two_ranks_warmup_averaging_abort_resume_and_clean_stop() -> None:
    results = run_ranks(async_scenarios, 2, 3)
    life = [r["lifecycle"] for r in results]
    for r in life:
        assert r["warm_spread"] == [0.0, 0.0, 0.0]  # warm-up is synchronous gradient allreduce
        assert not r["thread_during_warmup"]
        assert r["averaging"]
        # abort stops averaging on every rank after the same round; resume restarts it
        assert r["after_abort"] == {"rounds": r["aborted_rounds"], "alive": False}
        assert r["end_loss"] < 0.5 * r["start_loss"]
        assert not r["alive_after_teardown"]  # no thread left behind
    assert life[0]["aborted_rounds"] == life[1]["aborted_rounds"]

    exact = [r["exact"] for r in results]
    for r in exact:
        assert r["rounds"] >= 1
        assert not r["alive_after_teardown"]
        # ranks started at 1.0 and 2.0 with lr=0: averaging lands exactly on the mean
        torch.testing.assert_close(r["weights"], torch.full_like(r["weights"], 1.5), rtol=0, atol=0)
