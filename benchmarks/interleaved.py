"""One timing method for every speed benchmark (see ../shared/MEASURING.md, docs/benchmarks.md).

Shared machines drift by 10-20 % within a minute, so variants are never timed in blocks one after the
other. Instead:

1. every variant owns its copy of the same model (same weights, same batches) in the same process;
2. each round runs ONE step of every variant, in an order shuffled each round by a ``random.Random``
   seeded identically on every rank (so the ranks' collectives pair up, and drift hits every variant alike);
3. each step is timed between two device synchronisations (``torch.cuda.synchronize`` +
   ``time.perf_counter``; on CPU the clock alone: Gloo's collectives complete before the step returns);
4. the result per variant is the median step time, and its speed against the baseline is
   ``median(baseline) / median(variant)`` with a 95 % bootstrap interval (each variant's step times
   resampled 2,000 times, the 2.5 and 97.5 percentiles of the ratio). An interval that contains 1 is
   "no difference".

Ranks are in lockstep through the collectives, so rank 0's step times are the job's.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Speed:
    """How fast a variant is against the baseline.

    Attributes:
        variant: its name.
        median_ms: its median step time, in milliseconds.
        ratio: ``median(baseline) / median(variant)``: > 1 is faster than the baseline.
        low: lower end of the 95 % bootstrap interval of ``ratio``.
        high: upper end of that interval.
        steps: timed steps behind the median.
    """

    variant: str
    median_ms: float
    ratio: float
    low: float
    high: float
    steps: int

    @property
    def verdict(self) -> str:
        """``faster``, ``slower`` or ``no difference`` (the interval contains 1)."""
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "no difference"

    def row(self) -> str:
        """``name  12.34 ms  1.234x [1.200, 1.260]  faster``."""
        return (f"{self.variant:>30}: {self.median_ms:9.2f} ms/step  {self.ratio:6.3f}x "
                f"[{self.low:.3f}, {self.high:.3f}]  {self.verdict}")

    def to_json(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "ratio": self.ratio, "ci95": [self.low, self.high],
                "steps": self.steps, "verdict": self.verdict}


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile (0..1) of already sorted values."""
    if not sorted_values:
        raise ValueError("no values")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_ratio(baseline: Sequence[float], variant: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                    confidence: float = CONFIDENCE, seed: int = 0, paired: bool = False) -> tuple[float, float, float]:
    """``median(baseline) / median(variant)`` and its bootstrap interval.

    ``paired``: the two series are step times of the same interleaved rounds (``baseline[i]`` and ``variant[i]``
    ran in round ``i``, moments apart), and the rounds are resampled, both series together: the drift that the
    interleaving puts on both alike then leaves the interval. Unpaired (the method's default), each series is
    resampled on its own.

    Args:
        baseline: the baseline's step times (any unit, the same as ``variant``'s).
        variant: the variant's step times.
        resamples: bootstrap resamples.
        confidence: coverage of the interval (0.95: the 2.5 and 97.5 percentiles).
        seed: seed of the resampling, so a report is reproducible.
        paired: resample rounds, not steps (the series must be of one length).

    Returns:
        ``(ratio, low, high)``.

    Raises:
        ValueError: an empty or non-positive series, a confidence outside (0, 1), or paired series of two
            lengths.
    """
    for name, series in (("baseline", baseline), ("variant", variant)):
        if not series:
            raise ValueError(f"{name} has no step times; time at least one step of every variant.")
        if min(series) <= 0:
            raise ValueError(f"{name} has a step time <= 0 ({min(series)}); times must be positive.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}; give a fraction such as 0.95.")
    if resamples < 1:
        raise ValueError(f"resamples={resamples}; give at least 1 (2,000 is the method's).")
    ratio = statistics.median(baseline) / statistics.median(variant)
    rng = random.Random(seed)
    nb, nv = len(baseline), len(variant)
    if paired:
        if nb != nv:
            raise ValueError(f"paired series of {nb} and {nv} step times; pair the steps of the same rounds.")
        rounds = range(nb)
        picks = (rng.choices(rounds, k=nb) for _ in range(resamples))
        ratios = sorted(statistics.median([baseline[i] for i in pick]) / statistics.median([variant[i] for i in pick])
                        for pick in picks)
    else:
        ratios = sorted(
            statistics.median(rng.choices(baseline, k=nb)) / statistics.median(rng.choices(variant, k=nv))
            for _ in range(resamples)
        )
    tail = (1 - confidence) / 2
    return ratio, _percentile(ratios, tail), _percentile(ratios, 1 - tail)


def speeds(times_ms: Mapping[str, Sequence[float]], baseline: str, *, seed: int = 0) -> list[Speed]:
    """:class:`Speed` of every variant in ``times_ms`` against ``baseline`` (which is in it, at 1.0x)."""
    if baseline not in times_ms:
        raise ValueError(f"baseline {baseline!r} is not among the variants {sorted(times_ms)}.")
    out = []
    for name, series in times_ms.items():
        ratio, low, high = bootstrap_ratio(times_ms[baseline], series, seed=seed)
        out.append(Speed(name, statistics.median(series), ratio, low, high, len(series)))
    return out


def round_order(names: Sequence[str], round_index: int, seed: int = 0) -> list[str]:
    """The order of the variants in round ``round_index``: shuffled, and the same on every rank."""
    order = list(names)
    random.Random(f"{seed}:{round_index}").shuffle(order)
    return order


def slowest_rank(times: Mapping[str, Sequence[float]], device: Any = None) -> dict[str, list[float]]:
    """Each step's time on the slowest rank: one ``all_reduce(MAX)`` after the rounds (the rounds add nothing).

    A synchronous algorithm ends its step on every rank at once (its last collective), so rank 0's time is the
    job's. A decentralized one couples a rank only to its peers: a rank can finish its step early, and the wait
    for a slower one then falls on the next variant's first collective, in another variant's time (on 4 x H200,
    ResNet-50: decentralized's rank-0 median 34.1 ms, its slowest rank's 36.1; the others within 0.4 %). The
    slowest rank's time of each step is what the job waits for, for every variant alike. ``device``: where the
    group's collectives run (CUDA for NCCL; None: CPU). Without an initialised group of several ranks, the times
    are returned as they are. Every rank must call it with the same variants and as many steps of each.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return {n: list(v) for n, v in times.items()}
    names = list(times)
    local = torch.tensor([list(times[n]) for n in names], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return {n: [float(v) for v in row] for n, row in zip(names, local.cpu(), strict=True)}


def interleave(steps: Mapping[str, Callable[[], Any]], rounds: int, *, sync: Callable[[], None] = lambda: None,
               seed: int = 0, clock: Callable[[], float] = time.perf_counter,
               on_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Run ``rounds`` rounds of one step of every variant, shuffled per round; milliseconds per step.

    Args:
        steps: variant name -> a callable running one training step of that variant.
        rounds: how many steps of each variant to time.
        sync: waits for the device (``torch.cuda.synchronize``); called before and after every step.
        seed: the shuffle's seed: give every rank the same one.
        clock: the timer, in seconds.
        on_round: called after each round with its index (a progress line, a liveness check).

    Returns:
        ``{variant: [ms per step, ...]}`` in the order the steps were taken.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}; time at least one round.")
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in round_order(list(steps), r, seed):
            sync()
            start = clock()
            steps[name]()
            sync()
            times[name].append((clock() - start) * 1000.0)
        if on_round is not None:
            on_round(r)
    return times
