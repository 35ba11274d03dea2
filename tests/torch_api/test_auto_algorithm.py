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


def _run(tmp_path: Path, candidates: list[str], *extra: str) -> list[dict[str, Any]]:
    run_ranks(str(WORKER), [str(tmp_path), ",".join(candidates), *extra], world_size=2, log_dir=tmp_path, hide_cuda=True,
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
        # A (1+2) B (1+3) A (1+1): 3 timed steps each over two mirrored rounds; then, when the two were too
        # close to tell apart on this CPU, runoffs of 8 steps each (A 0+2, B 1+3, A 1+1); then the kept one.
        a, b = candidates
        assert r["decide_at"] == 9 and r["used"][:9] == [a] * 3 + [b] * 4 + [a] * 2
        assert r["decided_at"] == 9 + r["runoffs"] * r["runoff_steps"]
        for k in range(r["runoffs"]):
            start = 9 + k * 8
            assert r["used"][start:start + 8] == [a] * 2 + [b] * 4 + [a] * 2
        assert set(r["used"][r["decided_at"]:]) == {chosen} and len(r["used"]) == r["decided_at"] + 6
        # Handed over: the driver calls the chosen algorithm itself, nothing of auto in between.
        assert r["driven"] == get_algorithm_class(chosen).__name__
        assert any(f"chose {chosen}" in line for line in r["log"]), r["log"]
        assert f"{chosen}: " in r["reason"] and "(kept)" in r["reason"]
    if chosen in SYNCHRONOUS:  # trained on a synchronous algorithm since the switch: identical replicas
        assert results[0]["params"] == results[1]["params"]
    else:
        assert results[0]["params"] != results[1]["params"]  # decentralized: each rank applies its own gradient


def test_work_between_steps_does_not_change_the_choice(tmp_path: Path) -> None:
    # gradient_allreduce's steps are fast, but the loop sleeps 1 s after each of them; slow_allreduce's steps
    # take 0.3 s longer. Timing the loop would keep slow_allreduce; timing the step keeps gradient_allreduce.
    # slow_allreduce is registered in the worker's file only: auto takes it from the registry.
    results = _run(tmp_path, ["slow_allreduce", "gradient_allreduce"], "--busy-loop")
    for r in results:
        assert r["chosen"] == "gradient_allreduce" and r["step_ms"] == results[0]["step_ms"]
        assert r["driven"] == "GradientAllReduceAlgorithm"
        assert "forward start to optimizer step end" in r["log"][-1] and "slowest of 2 ranks" in r["log"][-1]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"candidates": ["gradient_allreduce", "fastest"]}, r"\['fastest'\].*choose from"),
    ({"candidates": ["qadam"]}, r"qadam needs its own optimizer"),
    ({"candidates": ["bytegrad"], "candidate_kwargs": {"peer_selection_mode": "all"}},
     r"candidate 'bytegrad' refuses the arguments given"),
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
