"""What a report carries into a session: the plan it names, its numbers (range-checked), running sums.

Every number a report brings is checked here against ranges far beyond any real job
but small enough that no sum, mean or fit of them overflows (a speed of 1e308 would
turn the cost model's fit into inf for good).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ...proto.plan import BucketPlan, BucketTimingRecord
from .costmodel import Sample
from .errors import InvalidArgumentError

MAX_TRAIN_ITER = 2**62
MAX_SPEED = 1e12  # samples/s
MAX_MS = 1e7  # milliseconds (close to 3 hours per step)
MAX_BYTES = 2**50


@dataclass(frozen=True, slots=True)
class PlanRef:
    """A plan as reported back by a trainer, decoded only when it is not one this service issued.

    Attributes:
        version: the reported plan_version.
        matches: True when the reported plan is exactly this issued plan (a digest of its
            full layout, every tensor of every bucket, compared with the issued plan's).
        decode: builds the full, validated plan (raises ValueError/TypeError when malformed).
    """

    version: int
    matches: Callable[[BucketPlan], bool]
    decode: Callable[[], BucketPlan]


@dataclass(frozen=True, slots=True)
class Spread:
    """How an aggregated report's ranks differed (samples/s); all 0 for one rank's own report."""

    ranks: int = 1
    speed_min: float = 0.0
    speed_max: float = 0.0
    speed_stddev: float = 0.0


@dataclass(slots=True)
class LayoutStats:
    """Running sums of the reports that measured one layout."""

    plan: BucketPlan
    reports: int = 0
    speed_sum: float = 0.0
    backward_sum: float = 0.0
    backward_n: int = 0
    max_iter: int = -1
    timing_sums: dict[int, list[float]] = field(default_factory=dict)  # index -> [bytes, ready, comm, wait, n]

    def add(self, speed: float, backward_ms: float, timings: Sequence[BucketTimingRecord], train_iter: int) -> None:
        self.reports += 1
        self.speed_sum += speed
        if backward_ms > 0:
            self.backward_sum += backward_ms
            self.backward_n += 1
        self.max_iter = max(self.max_iter, train_iter)
        for t in timings:
            sums = self.timing_sums.setdefault(t.bucket_index, [0.0, 0.0, 0.0, 0.0, 0.0])
            sums[0] += t.bytes
            sums[1] += t.ready_ms
            sums[2] += t.comm_ms
            sums[3] += t.wait_ms
            sums[4] += 1

    def sample(self, plan: BucketPlan) -> Sample:
        timings = tuple(
            BucketTimingRecord(bucket_index=i, bytes=round(s[0] / s[4]), ready_ms=s[1] / s[4],
                               comm_ms=s[2] / s[4], wait_ms=s[3] / s[4])
            for i, s in sorted(self.timing_sums.items())
        )
        return Sample(plan=plan, speed=self.speed_sum / max(1, self.reports),
                      backward_ms=self.backward_sum / self.backward_n if self.backward_n else 0.0,
                      bucket_timings=timings, reports=self.reports, train_iter=self.max_iter)


_MAX_ITERS_PER_RANK = 4096  # remembered train_iters per rank before the oldest half is dropped
_MAX_ITERS = 65536  # remembered (rank, train_iter) pairs per model before every rank drops its oldest half


class SeenIters:
    """The (rank, train_iter) pairs a session counted, bounded: past the limits a rank keeps the newer
    half, and anything at or below what it dropped counts as seen (a duplicate)."""

    def __init__(self) -> None:
        self._seen: dict[int, set[int]] = {}
        self._floor: dict[int, int] = {}
        self._total = 0

    def add(self, rank: int, train_iter: int) -> bool:
        """Count ``(rank, train_iter)``; False when it was counted before (a duplicate)."""
        seen = self._seen.setdefault(rank, set())
        if train_iter in seen or train_iter <= self._floor.get(rank, -1):
            return False
        seen.add(train_iter)
        self._total += 1
        if len(seen) > _MAX_ITERS_PER_RANK:
            self._forget_oldest(rank)
        if self._total > _MAX_ITERS:
            for r in list(self._seen):
                self._forget_oldest(r)
        return True

    def _forget_oldest(self, rank: int) -> None:
        seen = sorted(self._seen[rank])
        keep = seen[len(seen) // 2:]
        self._total -= len(seen) - len(keep)
        if len(keep) < len(seen):
            self._floor[rank] = keep[0] - 1
        self._seen[rank] = set(keep)


def _check_range(name: str, value: float, high: float, unit: str) -> None:
    if not (math.isfinite(value) and 0 <= value <= high):
        raise InvalidArgumentError(f"{name} must be a finite number in [0, {high:g}] {unit}, got {value}")


def check_measurement(speed: float, backward_ms: float, timings: Sequence[BucketTimingRecord],
                      spread: Spread) -> None:
    """Range-check every number of a report (InvalidArgumentError naming the field).

    ``0 <= v <= high`` is False for NaN and for infinities, so one chained comparison per
    value checks both; the field is named only once one fails (this runs on every report).
    """
    if not (0 <= speed <= MAX_SPEED and 0 <= backward_ms <= MAX_MS and 0 <= spread.speed_min <= MAX_SPEED
            and 0 <= spread.speed_max <= MAX_SPEED and 0 <= spread.speed_stddev <= MAX_SPEED):
        _check_range("speed", speed, MAX_SPEED, "samples/s")
        _check_range("backward_ms", backward_ms, MAX_MS, "ms")
        for name in ("speed_min", "speed_max", "speed_stddev"):
            _check_range(name, getattr(spread, name), MAX_SPEED, "samples/s")
    for i, t in enumerate(timings):
        if not (0 <= t.bytes <= MAX_BYTES and 0 <= t.ready_ms <= MAX_MS and 0 <= t.comm_ms <= MAX_MS
                and 0 <= t.wait_ms <= MAX_MS and 0 <= t.comm_ms_max <= MAX_MS and 0 <= t.wait_ms_max <= MAX_MS):
            _check_range(f"bucket_timings[{i}].bytes", t.bytes, MAX_BYTES, "bytes")
            for name in ("ready_ms", "comm_ms", "wait_ms", "comm_ms_max", "wait_ms_max"):
                _check_range(f"bucket_timings[{i}].{name}", getattr(t, name), MAX_MS, "ms")
