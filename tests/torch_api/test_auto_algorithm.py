"""``AutoAlgorithm`` through ``with_bagua``: candidates measured in flight on real Gloo ranks, one choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.torch_api.algorithms import AutoAlgorithm
from tests.ranks import run_ranks

WORKER = Path(__file__).with_name("auto_workers.py")
SYNCHRONOUS = {"gradient_allreduce", "bytegrad"}


def _run(tmp_path: Path, candidates: list[str]) -> list[dict[str, Any]]:
    run_ranks(str(WORKER), [str(tmp_path), ",".join(candidates)], world_size=2, log_dir=tmp_path, hide_cuda=True,
              timeout_s=240, log_name="auto-log")
    return [json.loads((tmp_path / f"auto-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("candidates", [["gradient_allreduce", "bytegrad"], ["decentralized", "gradient_allreduce"]])
def test_every_rank_keeps_the_same_measured_candidate(tmp_path: Path, candidates: list[str]) -> None:
    results = _run(tmp_path, candidates)
    chosen = results[0]["chosen"]
    assert chosen in candidates
    assert all(r["chosen"] == chosen and r["decided_at"] == results[0]["decided_at"] for r in results)
    for r in results:
        assert list(r["step_ms"]) == candidates and r["step_ms"] == results[0]["step_ms"]  # the group's numbers
        assert all(ms > 0 for ms in r["step_ms"].values())
        # Each candidate drove its trial (1 warm-up + 3 timed steps), then the kept one drove the rest.
        assert r["used"][:8] == [candidates[0]] * 4 + [candidates[1]] * 4
        assert set(r["used"][8:]) == {chosen}
        assert any(f"chose {chosen}" in line for line in r["log"]), r["log"]
        assert f"{chosen}: " in r["reason"] and "(kept)" in r["reason"]
    if chosen in SYNCHRONOUS:  # trained on a synchronous algorithm since the switch: identical replicas
        assert results[0]["params"] == results[1]["params"]
    else:
        assert results[0]["params"] != results[1]["params"]  # decentralized: each rank applies its own gradient


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"candidates": ["gradient_allreduce", "fastest"]}, r"\['fastest'\].*choose from"),
    ({"candidates": ["qadam"]}, r"qadam needs its own optimizer"),
    ({"candidates": []}, r"candidates=\[\]; name each algorithm once, at least one"),
    ({"candidates": "bytegrad"}, r"candidates='bytegrad'; give a list"),
    ({"warmup_steps": 0}, r"warmup_steps=0; give at least 1"),
    ({"trial_steps": -2}, r"trial_steps=-2; give at least 3"),
    ({"trial_steps": 2.5}, r"trial_steps=2.5 is not a number of steps"),
])
def test_bad_arguments_name_the_value_and_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoAlgorithm(**kwargs)


def test_one_registration_gives_both_front_doors_their_spelling() -> None:
    algorithm = AutoAlgorithm(candidates=["bytegrad", "decentralized"], warmup_steps=2, trial_steps=4)
    assert (algorithm.candidates, algorithm.warmup_steps, algorithm.trial_steps) == (
        ["bytegrad", "decentralized"], 2, 4)
    assert algorithm.selection is None  # no model wrapped yet
    assert get_algorithm_class("auto").spec.bagua_name == "AutoAlgorithm"
