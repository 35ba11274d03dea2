"""The one timing method of the speed benchmarks (benchmarks/interleaved.py): shuffling, timing, intervals."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from interleaved import Speed, bootstrap_ratio, interleave, round_order, slowest_rank, speeds


def noisy(median_ms: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [median_ms * rng.uniform(0.9, 1.1) for _ in range(n)]


def test_same_distribution_is_no_difference() -> None:
    ratio, low, high = bootstrap_ratio(noisy(10.0, 60, 1), noisy(10.0, 60, 2))
    assert low < 1.0 < high
    assert 0.95 < ratio < 1.05


def test_a_twice_as_fast_variant_is_faster_with_an_interval_that_excludes_one() -> None:
    ratio, low, high = bootstrap_ratio(noisy(20.0, 60, 1), noisy(10.0, 60, 2))
    assert 1.8 < low <= ratio <= high < 2.2
    (base, fast) = speeds({"ddp": noisy(20.0, 60, 1), "bytegrad": noisy(10.0, 60, 2)}, "ddp")
    assert fast.verdict == "faster" and fast.variant == "bytegrad"
    assert base.variant == "ddp" and base.steps == 60
    slow = Speed("x", 30.0, 0.66, 0.6, 0.7, 60)
    assert slow.verdict == "slower"
    assert "0.660x [0.600, 0.700]  slower" in slow.row()


def test_the_interval_is_reproducible_from_its_seed() -> None:
    a, b = noisy(10.0, 30, 3), noisy(11.0, 30, 4)
    assert bootstrap_ratio(a, b, seed=7) == bootstrap_ratio(a, b, seed=7)


@pytest.mark.parametrize(("baseline", "variant", "kwargs", "match"), [
    ([], [1.0], {}, "baseline has no step times"),
    ([1.0], [0.0], {}, "variant has a step time <= 0"),
    ([1.0], [1.0], {"confidence": 1.5}, "confidence=1.5"),
    ([1.0], [1.0], {"resamples": 0}, "resamples=0"),
])
def test_bad_series_are_refused_with_the_value(baseline: list[float], variant: list[float],
                                               kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bootstrap_ratio(baseline, variant, **kwargs)  # type: ignore[arg-type]


def test_paired_rounds_take_the_shared_drift_out_of_the_interval() -> None:
    # Two equal variants timed in the same rounds, the machine drifting 2x across the run: each round's pair
    # shares the drift, so the paired interval is narrow around 1 and the unpaired one is wide.
    rng = random.Random(5)
    drift = [1.0 + i / 100 for i in range(100)]
    a = [10.0 * d * rng.uniform(0.99, 1.01) for d in drift]
    b = [10.0 * d * rng.uniform(0.99, 1.01) for d in drift]
    ratio, low, high = bootstrap_ratio(a, b)
    pratio, plow, phigh = bootstrap_ratio(a, b, paired=True)
    assert pratio == ratio
    assert plow < 1.0 < phigh and phigh - plow < 0.03
    assert high - low > 2 * (phigh - plow)
    with pytest.raises(ValueError, match="paired series of 2 and 1 step times"):
        bootstrap_ratio([1.0, 2.0], [1.0], paired=True)


def test_slowest_rank_without_a_group_returns_the_times() -> None:
    times = {"a": [1.0, 2.0], "b": [3.0, 4.0]}
    assert slowest_rank(times) == times and slowest_rank(times) is not times


def test_speeds_needs_its_baseline() -> None:
    with pytest.raises(ValueError, match="baseline 'ddp' is not among"):
        speeds({"a": [1.0]}, "ddp")


def test_round_order_is_a_shuffle_shared_by_every_rank() -> None:
    names = [f"v{i}" for i in range(6)]
    orders = [round_order(names, r, seed=5) for r in range(20)]
    assert all(sorted(o) == names for o in orders)
    assert orders == [round_order(names, r, seed=5) for r in range(20)]  # another rank, same seed
    assert len({tuple(o) for o in orders}) > 1  # it does shuffle
    assert orders != [round_order(names, r, seed=6) for r in range(20)]


def test_interleave_times_one_step_of_every_variant_per_round_between_syncs() -> None:
    now = [0.0]
    events: list[str] = []
    cost = {"a": 0.010, "b": 0.025}

    def step(name: str):  # type: ignore[no-untyped-def]
        def run() -> None:
            events.append(name)
            now[0] += cost[name]
        return run

    def sync() -> None:
        events.append("sync")

    times = interleave({n: step(n) for n in cost}, 5, sync=sync, clock=lambda: now[0], seed=1)
    assert times["a"] == pytest.approx([10.0] * 5) and times["b"] == pytest.approx([25.0] * 5)
    steps_only = [e for e in events if e != "sync"]
    assert [sorted(steps_only[i:i + 2]) for i in range(0, 10, 2)] == [["a", "b"]] * 5  # one of each per round
    assert steps_only == [n for r in range(5) for n in round_order(["a", "b"], r, 1)]
    assert events.count("sync") == 20  # before and after every step
    with pytest.raises(ValueError, match="rounds=0"):
        interleave({"a": lambda: None}, 0)
