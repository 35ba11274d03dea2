"""What the service learns from reports: measured samples, the communication cost model and ready times.

A :class:`Sample` is one measured plan (means over the reports of every rank).
The model-based planner fits, per reduction mode, ``comm_ms = latency_ms +
bytes * ms_per_byte`` (:func:`fit_comm_model`) and a map from a position in the
gradient-ready order (cumulative bytes) to the moment that gradient is ready
(:class:`ReadyModel`); :func:`simulate_overlap` then replays a plan: buckets are
communicated one after another in plan order, each starting once its last
gradient is ready and the previous bucket is done.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from ...proto.plan import BucketPlan, BucketTimingRecord

MB = 1024.0**2


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured plan.

    Attributes:
        plan: the plan that was in use.
        speed: mean training speed over the reports, samples per second; 0 when unknown.
        backward_ms: mean backward duration, ms; 0 when unknown.
        bucket_timings: mean timings per bucket index (empty for speed-only clients).
        reports: how many reports the means are over.
        train_iter: the newest train_iter among those reports.
    """

    plan: BucketPlan
    speed: float
    backward_ms: float
    bucket_timings: tuple[BucketTimingRecord, ...]
    reports: int
    train_iter: int

    @property
    def exposed_ms(self) -> float:
        """Communication left after backward ended (the largest per-bucket wait), ms."""
        return max((t.wait_ms for t in self.bucket_timings), default=0.0)

    @property
    def score(self) -> float:
        """Higher is better: the speed when known, else minus the step's backward + exposed time."""
        if self.speed > 0:
            return self.speed
        return -(self.backward_ms + self.exposed_ms)


@dataclass(frozen=True, slots=True)
class CommModel:
    """Communication cost of one bucket: ``latency_ms + nbytes * ms_per_byte``."""

    latency_ms: float
    ms_per_byte: float

    def cost_ms(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        return self.latency_ms + np.asarray(nbytes) * self.ms_per_byte if isinstance(nbytes, np.ndarray) \
            else self.latency_ms + float(nbytes) * self.ms_per_byte


def fit_comm_model(points: Sequence[tuple[float, float]], *, min_spread: float = 1.5) -> CommModel | None:
    """Least-squares fit (latency and per-byte cost both >= 0) of ``(bytes, comm_ms)`` points.

    Returns None while the data cannot separate latency from bandwidth: fewer
    than two distinct sizes, or the largest less than ``min_spread`` times the
    smallest.
    """
    clean = [(b, c) for b, c in points if b > 0 and math.isfinite(c) and c >= 0]
    if not clean:
        return None
    sizes = np.array([b for b, _ in clean], dtype=float)
    if sizes.max() < min_spread * sizes.min():
        return None
    # Average repeated sizes so a bucket measured many times does not dominate the fit.
    unique, inverse = np.unique(sizes, return_inverse=True)
    costs = np.bincount(inverse, weights=[c for _, c in clean]) / np.bincount(inverse)
    a = np.column_stack([np.ones_like(unique), unique / MB])
    (latency, per_mb), _ = nnls(a, costs)
    return CommModel(latency_ms=float(latency), ms_per_byte=float(per_mb) / MB)


class ReadyModel:
    """When the gradient at a position of the ready order becomes ready, from bucket ready times.

    Positions are cumulative bytes in gradient-ready order. Known points are each
    measured bucket's end position and ready_ms, plus ``(0, 0)`` and ``(total,
    backward_ms)``; between them the time is interpolated linearly, which is also
    the prior (gradients produced at a constant rate) before any bucket is measured.
    """

    def __init__(self, points: Sequence[tuple[float, float]], total_bytes: float, backward_ms: float) -> None:
        by_pos: dict[float, list[float]] = {0.0: [0.0]}
        for pos, ms in points:
            if math.isfinite(ms) and ms >= 0:
                by_pos.setdefault(float(pos), []).append(float(ms))
        if backward_ms > 0:
            by_pos.setdefault(float(total_bytes), []).append(backward_ms)
        xs = np.array(sorted(by_pos))
        ys = np.array([float(np.mean(by_pos[x])) for x in xs])
        self._xs = xs
        self._ys = np.maximum.accumulate(ys)  # ready times never go backwards along the ready order

    def ready_ms(self, positions: np.ndarray) -> np.ndarray:
        # Beyond the last known point, extrapolate at the mean rate seen so far.
        xs, ys = self._xs, self._ys
        out = np.interp(positions, xs, ys)
        if len(xs) > 1 and xs[-1] > 0:
            beyond = positions > xs[-1]
            out[beyond] = ys[-1] + (positions[beyond] - xs[-1]) * (ys[-1] / xs[-1])
        return out


def simulate_overlap(ready_ms: Sequence[float], comm_ms: Sequence[float], backward_ms: float) -> tuple[float, float]:
    """Replay buckets in plan order; return (communication finish time, exposed ms after backward)."""
    free = 0.0
    for ready, cost in zip(ready_ms, comm_ms, strict=True):
        free = max(free, ready) + cost
    return free, max(0.0, free - backward_ms)
