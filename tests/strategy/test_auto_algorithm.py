"""``algorithm="auto"``: candidates measured in flight, the fastest kept, the same choice on every rank."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms.auto import auto_settings
from bagua_lightning.engine.algorithms.base import switchable_algorithms
from bagua_lightning.engine.autotune.selection import (
    DEFAULT_CANDIDATES,
    MAX_RUNOFFS,
    AlgorithmSelector,
    AutoSettings,
    Block,
    Selection,
    choose,
)
from tests.procs import free_port
from tests.ranks import run_commands
from tests.services.conftest import FAST, autotune_service

WORKER = str(Path(__file__).with_name("auto_workers.py"))
AUTOTUNE_WORKER = str(Path(__file__).with_name("auto_autotune_worker.py"))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"candidates": ("gradient_allreduce", "qadam")},
     r"auto_candidates has \['qadam'\], which algorithm='auto' cannot measure.*qadam needs its own optimizer"),
    ({"candidates": ("nope",)}, r"\['nope'\]"),
    ({"candidates": ("auto",)}, r"\['auto'\], which algorithm='auto' cannot measure"),
    ({"candidates": ()}, "name each algorithm once, at least one"),
    ({"candidates": ("bytegrad", "bytegrad")}, "name each algorithm once"),
    ({"candidates": "bytegrad"}, "give a list of algorithm names"),
    ({"trial_steps": 2}, "auto_trial_steps=2; give at least 3"),
    ({"warmup_steps": 0}, "auto_warmup_steps=0"),
    ({"warmup_steps": 1.5}, "is not a number of steps"),
    ({"max_runoffs": -1}, r"auto_max_runoffs=-1; give 0 \(no runoff\) or more"),
    ({"max_runoffs": True}, "auto_max_runoffs=True is not a number of runoffs"),
])
def test_settings_refuse_what_cannot_be_measured(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        auto_settings(kwargs.get("candidates"), kwargs.get("warmup_steps", 3), kwargs.get("trial_steps", 10),
                      prefix="auto_", max_runoffs=kwargs.get("max_runoffs", 3))


def test_candidates_come_from_the_registry() -> None:
    # Every registered algorithm that needs no optimizer of its own and accepts a switch; not qadam, not auto.
    assert set(switchable_algorithms()) == {"gradient_allreduce", "bytegrad", "decentralized",
                                            "low_precision_decentralized", "async", "powersgd", "half_allreduce"}


def test_defaults_are_the_allreduce_like_algorithms() -> None:
    s = AutoSettings()
    assert s.candidates == DEFAULT_CANDIDATES == ("gradient_allreduce", "bytegrad")
    # A B | B A: each candidate's 10 timed steps in two halves; B's two visits are one (no switch between).
    assert s.blocks() == [Block("gradient_allreduce", 3, 5), Block("bytegrad", 3, 10), Block("gradient_allreduce", 3, 5)]
    assert s.steps_to_decide == 29
    assert "forward start to optimizer step end (monotonic clock)" in s.measured(torch.device("cpu"), 2)


def test_strategy_arguments_are_checked_at_construction() -> None:
    from bagua_lightning.strategy import BaguaStrategy

    with pytest.raises(ConfigurationError, match="needs algorithm='auto'"):
        BaguaStrategy(algorithm="bytegrad", auto_candidates=["bytegrad"])
    with pytest.raises(ConfigurationError, match="candidate 'gradient_allreduce' refuses"):
        BaguaStrategy(algorithm="auto", auto_candidates=["decentralized", "gradient_allreduce"],
                      peer_selection_mode="shift_one")
    strategy = BaguaStrategy(algorithm="auto", auto_candidates=["decentralized", "bytegrad"], hierarchical=False)
    assert strategy.algorithm_name == "decentralized"  # the first candidate drives the first steps
    assert BaguaStrategy(algorithm="auto", autotune=True, auto_candidates=["decentralized"]).algorithm_name


def test_choose_is_the_first_fastest() -> None:
    assert choose([3.0, 1.0, 2.0]) == 1
    assert choose([1.0, 1.0]) == 0
    with pytest.raises(ValueError):
        choose([])


def test_selection_explains_itself() -> None:
    sel = Selection(step_ms={"gradient_allreduce": 170.0, "bytegrad": 48.0}, chosen="bytegrad", decided_at=26)
    assert sel.reason() == "bytegrad: 48.0 ms/step (kept); gradient_allreduce: 170.0 ms/step (3.54x slower)"
    assert sel.metrics() == {"bagua/auto/gradient_allreduce_step_ms": 170.0, "bagua/auto/bytegrad_step_ms": 48.0,
                             "bagua/auto/chosen_index": 1.0}
    assert Selection().reason() == "still measuring"
    # After a runoff, a candidate judged out in the first rounds says so (its median may even be lower than the
    # kept one's, whose runoff steps were slower).
    ran_off = Selection(step_ms={"gradient_allreduce": 10.0, "bytegrad": 9.8, "decentralized": 10.1},
                        chosen="gradient_allreduce", runoff=("gradient_allreduce", "decentralized"), runoffs=1)
    assert ran_off.reason() == ("gradient_allreduce: 10.0 ms/step (kept); bytegrad: 9.8 ms/step (0.98x, first "
                                "rounds); decentralized: 10.1 ms/step (1.01x slower) after a runoff of "
                                "gradient_allreduce and decentralized")


def drive(settings: AutoSettings, cost: Callable[[str, int], float], steps: int,
          loop: Callable[[str], float] = lambda name: 0.0) -> tuple[list[tuple[int, str]], Selection | None]:
    """Run a selector for ``steps`` steps on a fake clock: ``cost(candidate, step)`` seconds per step (forward
    start to optimizer step end), ``loop(candidate)`` seconds of the loop's other work after it. Returns the
    switches (step, candidate) and the selection at the step it was made."""
    now = [0.0]
    running = [settings.candidates[0]]
    switches: list[tuple[int, str]] = []
    step = [0]

    def switch(name: str) -> None:
        switches.append((step[0], name))
        running[0] = name

    selector = AlgorithmSelector(settings, switch, clock=lambda: now[0])
    decided = None
    for step[0] in range(steps):
        got = selector.on_forward_start(step[0])
        if got is not None:
            assert decided is None
            decided = got
        assert selector.current == running[0]
        # A warm-up step after a switch is slow (buckets, communicators): never counted.
        now[0] += cost(running[0], step[0]) * (10 if switches and step[0] == switches[-1][0] else 1)
        selector.on_step_end()
        now[0] += loop(running[0])
    assert selector.done and selector.on_forward_start(steps + 1) is None
    return switches, decided


def test_selector_times_the_step_not_the_loop_and_spreads_the_trials() -> None:
    a, b, c = "gradient_allreduce", "bytegrad", "decentralized"
    cost = {a: 0.030, b: 0.010, c: 0.020}  # seconds per step (forward start to optimizer step end)
    loop = {a: 0.0, b: 0.500, c: 0.0}  # other work in the loop between steps: the fastest step has the most
    switches, decided = drive(AutoSettings(candidates=(a, b, c), warmup_steps=2, trial_steps=4),
                              lambda name, step: cost[name], 40, loop.__getitem__)
    # A (2+2) B (2+2) C (2+4) B (2+2) A (2+2), then the fastest step: b.
    assert switches == [(4, b), (8, c), (14, b), (18, a), (22, b)]
    assert decided is not None and decided.chosen == b and decided.decided_at == 22
    assert decided.step_ms == pytest.approx({a: 30.0, b: 10.0, c: 20.0})
    assert "median of 4 steps per candidate in 2 mirrored rounds" in decided.measured
    assert decided.line().startswith("algorithm='auto' chose bytegrad at step 22: bytegrad: 10.0 ms/step (kept)")
    assert decided.runoffs == 0  # c is 2x, a 3x behind: nothing to run off


def test_close_leaders_run_a_runoff_and_are_judged_on_all_their_steps() -> None:
    a, b, c = "gradient_allreduce", "bytegrad", "decentralized"

    def cost(name: str, step: int) -> float:  # b is 2 % slower than a in the first rounds, 10 % faster after
        return {a: 0.0100, b: 0.0102 if step < 22 else 0.0090, c: 0.0200}[name]

    switches, decided = drive(AutoSettings(candidates=(a, b, c), warmup_steps=2, trial_steps=4), cost, 50)
    # The first rounds as before (a is ahead by 2 %, c 2x behind), then a runoff of a and b, a first without a
    # warm-up (it was running): a (0+2) b (2+4) a (2+2). After it b's steps spread over 9.0 and 10.2 ms (median
    # 9.6, 0.4 from a: within two standard errors of the difference), so a second runoff; then b's median is
    # 9.0 with no spread, a clear lead, and b is kept.
    assert switches == [(4, b), (8, c), (14, b), (18, a), (24, b), (30, a), (36, b), (42, a), (46, b)]
    assert decided is not None and decided.chosen == b and decided.decided_at == 46
    assert decided.runoff == (a, b) and decided.runoffs == 2
    # medians over all of a leader's timed steps: b's 4 first-round steps at 10.2 and 8 runoff steps at 9.0
    assert decided.step_ms == pytest.approx({a: 10.0, b: 9.0, c: 20.0})
    assert decided.reason() == ("bytegrad: 9.0 ms/step (kept); gradient_allreduce: 10.0 ms/step (1.11x slower); "
                                "decentralized: 20.0 ms/step (2.22x slower, first rounds) after 2 runoffs, the last "
                                "of gradient_allreduce and bytegrad")


def test_runoffs_end_after_the_most_allowed() -> None:
    # Two candidates 1 % apart under +-30 % noise: never told apart, so MAX_RUNOFFS runoffs, then the lower median.
    a, b = "gradient_allreduce", "bytegrad"
    noise = [0.7, 1.3, 1.0, 0.8, 1.2, 1.1, 0.9]
    settings = AutoSettings(candidates=(a, b), warmup_steps=2, trial_steps=4)
    _, decided = drive(settings, lambda name, step: {a: 0.0100, b: 0.0101}[name] * noise[step % len(noise)], 200)
    assert decided is not None and decided.runoffs == MAX_RUNOFFS == 3 and decided.runoff == (a, b)
    # each runoff of two: the running one 0 + 2 steps, the other 2 + 4, the running one again 2 + 2
    assert decided.decided_at == settings.steps_to_decide + MAX_RUNOFFS * 12
    assert decided.chosen == min((a, b), key=lambda n: decided.step_ms[n])
    # max_runoffs=0: the first rounds decide, at steps_to_decide exactly
    _, first = drive(AutoSettings(candidates=(a, b), warmup_steps=2, trial_steps=4, max_runoffs=0),
                     lambda name, step: {a: 0.0100, b: 0.0101}[name] * noise[step % len(noise)], 40)
    assert first is not None and first.runoffs == 0 and first.decided_at == settings.steps_to_decide


def test_a_clear_leader_needs_no_runoff() -> None:
    a, b = "gradient_allreduce", "bytegrad"
    settings = AutoSettings(candidates=(a, b), warmup_steps=1, trial_steps=4)
    _, decided = drive(settings, lambda name, step: {a: 0.0100, b: 0.0104}[name], 30)  # 4 % apart, no noise
    assert decided is not None and decided.chosen == a and decided.runoff == () and decided.runoffs == 0
    assert decided.decided_at == settings.steps_to_decide


def _results(tmp_path: Path, n: int) -> list[dict[str, Any]]:
    out = [json.loads((tmp_path / f"torchrun_rank{r}.json").read_text()) for r in range(n)]
    for r in out:
        assert "error" not in r, r["error"]
    return out


@pytest.mark.slow
def test_auto_under_lightning_and_switching_on_two_gloo_ranks(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), WORKER, str(tmp_path), "--mode", "torchrun"]
    run_commands([cmd], log_dir=tmp_path)
    ranks = _results(tmp_path, 2)
    fits = [r["fit"] for r in ranks]
    # Every rank measured the same numbers (the slowest rank's) and chose the same, fastest, algorithm.
    assert fits[0]["step_ms"] == fits[1]["step_ms"] and fits[0]["chosen"] == fits[1]["chosen"]
    step_ms = fits[0]["step_ms"]
    assert list(step_ms) == ["gradient_allreduce", "bytegrad", "decentralized"]
    assert fits[0]["chosen"] == min(step_ms, key=step_ms.get)
    # A (1+2) B (1+2) C (1+3) B (1+1) A (1+1): 3 timed steps each over two mirrored rounds.
    assert fits[0]["decided_at"] == 14
    a, b, c = step_ms
    for fit in fits:
        # Each candidate drove its visits in order, then the chosen one drove the rest.
        assert fit["algorithms"] == [a] * 3 + [b] * 3 + [c] * 4 + [b] * 2 + [a] * 2 + [fit["chosen"]] * 2
        assert fit["algorithm_name"] == fit["chosen"]
        # Handed over: the wrapper drives the chosen algorithm itself, nothing of auto in between.
        assert fit["driven"][:14] == ["AutoAlgorithm"] * 14 and "AutoAlgorithm" not in fit["driven"][14:]
        assert all(x == x and x < 10 for x in fit["losses"])  # finite, no blow-up from the switches
    # Rank 0 logs through Lightning's loggers.
    assert "bagua/auto/chosen_index" in fits[0]["logged"]
    assert {f"bagua/auto/{n}_step_ms" for n in step_ms} <= set(fits[0]["logged"])
    if fits[0]["chosen"] != "decentralized":  # a synchronous winner keeps the replicas identical
        assert fits[0]["params"] == fits[1]["params"]
    # Engine-level switch from decentralized (replicas drift) to gradient_allreduce: replicas averaged first.
    sw = [r["switch"] for r in ranks]
    assert sw[0]["before"] != sw[1]["before"]
    for r in sw:
        assert r["after_switch"] == pytest.approx(r["mean_before"], abs=1e-6)
        assert r["steps"] == [3, 4] and r["algorithm"] == "GradientAllReduceAlgorithm"
    assert sw[0]["grads"] == pytest.approx(sw[1]["grads"], abs=1e-7)  # allreduced from the first step on
    assert sw[0]["after_step"] == pytest.approx(sw[1]["after_step"], abs=1e-6)


@pytest.mark.slow
def test_auto_with_autotune_reports_its_choice_to_the_service(tmp_path: Path) -> None:
    with autotune_service(*FAST, "--world-size", "2", log_path=tmp_path / "service.log") as (target, _):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), AUTOTUNE_WORKER, str(tmp_path), "--mode", "torchrun"]
        run_commands([cmd], log_dir=tmp_path, env={"AUTO_TEST_SERVICE": target})
        ranks = _results(tmp_path, 2)
        fit = ranks[0]
        assert ranks[1]["chosen"] == fit["chosen"] and ranks[1]["step_ms"] == fit["step_ms"]
        with AutotuneClient(target=target) as client:
            described = client.describe_model("auto-net", fit["job_id"])
    # The service holds rank 0's selection: the kept candidate, each candidate's step time, the step.
    selection = described.selection
    assert selection is not None and described.summary.algorithm == fit["chosen"]
    assert (selection.chosen, selection.step, selection.job_id) == (fit["chosen"], fit["decided_at"], fit["job_id"])
    assert dict(selection.step_ms) == pytest.approx(fit["step_ms"])
    assert f"{fit['chosen']}: " in selection.reason and "(kept)" in selection.reason
    # The end-of-fit summary gives the measured ratio (not an estimate).
    other = "bytegrad" if fit["chosen"] == "gradient_allreduce" else "gradient_allreduce"
    ratio = fit["step_ms"][other] / fit["step_ms"][fit["chosen"]]
    assert fit["advice"] == (f"algorithm='auto' kept {fit['chosen']}: {fit['chosen']} was {ratio:.2f}x as fast as "
                             f"{other} here (measured in flight, forward start to optimizer step end: "
                             f"{fit['step_ms'][fit['chosen']]:.1f} vs "
                             f"{fit['step_ms'][other]:.1f} ms/step)")
    assert fit["summary"].endswith(fit["advice"])
