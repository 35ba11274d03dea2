"""Measuring an interval on one rank, reducing it over the job's ranks, and what the trainer is told.

:class:`IntervalMeter` measures one rank (samples/s, per-bucket timings and
backward time between two step boundaries); :func:`reduce_over_ranks` turns every
rank's measurement into the job's view with one ``all_gather`` (every rank calls
it at the same step); :class:`BoundaryReport` and :class:`AutotuneSummary` are
what the controller hands back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...proto.plan import BucketPlan, BucketTimingRecord, StepTimings


@dataclass(slots=True)
class IntervalMeter:
    """Samples, busy time and per-step bucket timings between two step boundaries."""

    samples: int = 0
    started: float | None = None
    paused_at: float | None = None
    paused_s: float = 0.0
    steps: list[StepTimings] = field(default_factory=list)
    _last_key: tuple[float, ...] | None = None

    def count(self, samples: int, now: float) -> None:
        if self.started is None:
            self.started = now
        self.samples += samples

    def add_timings(self, timings: StepTimings | None, num_buckets: int) -> None:
        """Keep ``timings`` once (a step's timings can be read several times) when they fit the plan."""
        if timings is None or len(timings.buckets) != num_buckets:
            return
        key = (timings.backward_ms, *(b.comm_ms for b in timings.buckets), *(b.ready_ms for b in timings.buckets))
        if key != self._last_key:
            self._last_key = key
            self.steps.append(timings)

    def pause(self, now: float) -> None:
        if self.started is not None and self.paused_at is None:
            self.paused_at = now

    def resume(self, now: float) -> None:
        if self.paused_at is not None:
            self.paused_s += now - self.paused_at
            self.paused_at = None

    def close(self, now: float) -> Measurement:
        """This rank's measurement of the interval that ends now; resets for the next one."""
        self.resume(now)
        elapsed = 0.0 if self.started is None else now - self.started - self.paused_s
        speed = self.samples / elapsed if elapsed > 0 and self.samples > 0 else None
        timings: list[BucketTimingRecord] = []
        backward_ms = 0.0
        if self.steps:
            n = len(self.steps)
            backward_ms = sum(s.backward_ms for s in self.steps) / n
            for i in range(len(self.steps[0].buckets)):
                rows = [s.buckets[i] for s in self.steps]
                timings.append(BucketTimingRecord(
                    bucket_index=i, bytes=rows[0].bytes, ready_ms=sum(r.ready_ms for r in rows) / n,
                    comm_ms=sum(r.comm_ms for r in rows) / n, wait_ms=sum(r.wait_ms for r in rows) / n))
        # The next interval starts here (its first batch may begin after the boundary's collectives).
        self.samples, self.paused_at, self.paused_s = 0, None, 0.0
        self.started = now if self.started is not None else None
        self.steps, self._last_key = [], None
        return Measurement(speed=speed, timings=timings, backward_ms=backward_ms)


@dataclass(frozen=True, slots=True)
class Measurement:
    """One interval's measurement: one rank's, or the job's (``ranks > 1``: means with their spread).

    Attributes:
        speed: samples per second per rank (None: nothing was measured).
        timings: per-bucket timings (means; ``*_max`` the largest over ranks).
        backward_ms: mean backward duration, ms.
        ranks: how many ranks measured it.
        speed_min: slowest rank's speed (the job's view only).
        speed_max: fastest rank's speed.
        speed_stddev: standard deviation of the ranks' speeds.
    """

    speed: float | None
    timings: list[BucketTimingRecord]
    backward_ms: float
    ranks: int = 1
    speed_min: float = 0.0
    speed_max: float = 0.0
    speed_stddev: float = 0.0


def reduce_over_ranks(mine: Measurement, num_buckets: int, *, group: dist.ProcessGroup | None,
                      device: torch.device, world_size: int) -> Measurement:
    """The job's view of an interval from every rank's ``mine``: one ``all_gather``, a collective.

    Ranks whose timings do not cover ``num_buckets`` buckets (none measured) count for the speed only.
    """
    if world_size == 1:
        return mine
    # One row per rank: [speed measured?, speed, backward_ms (0: no timings), then per bucket bytes, ready_ms,
    # comm_ms, wait_ms]. Every rank gets every row and computes the same view from them.
    width = 3 + 4 * num_buckets
    row = torch.zeros(width, dtype=torch.float64)
    if mine.speed is not None:
        row[0], row[1] = 1.0, mine.speed
    if len(mine.timings) == num_buckets and num_buckets:
        row[2] = mine.backward_ms if mine.backward_ms > 0 else -1.0
        for t in mine.timings:
            row[3 + 4 * t.bucket_index: 7 + 4 * t.bucket_index] = torch.tensor(
                [t.bytes, t.ready_ms, t.comm_ms, t.wait_ms], dtype=torch.float64)
    row = row.to(device)
    rows = [torch.empty_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row, group=group)
    table = torch.stack(rows).cpu().tolist()
    speeds = [r[1] for r in table if r[0] > 0]
    timed = [r for r in table if r[2] != 0.0]
    speed = sum(speeds) / len(speeds) if speeds else None
    std = math.sqrt(sum((s - speed) ** 2 for s in speeds) / len(speeds)) if speed is not None else 0.0
    timings: list[BucketTimingRecord] = []
    for i in range(num_buckets if timed else 0):
        cols = [r[3 + 4 * i: 7 + 4 * i] for r in timed]
        n = len(cols)
        timings.append(BucketTimingRecord(
            bucket_index=i, bytes=round(cols[0][0]), ready_ms=sum(c[1] for c in cols) / n,
            comm_ms=sum(c[2] for c in cols) / n, wait_ms=sum(c[3] for c in cols) / n,
            comm_ms_max=max(c[2] for c in cols), wait_ms_max=max(c[3] for c in cols)))
    backward = [r[2] for r in timed if r[2] > 0]
    return Measurement(speed=speed, timings=timings, backward_ms=sum(backward) / len(backward) if backward else 0.0,
                       ranks=len(speeds) or world_size, speed_min=min(speeds, default=0.0),
                       speed_max=max(speeds, default=0.0), speed_stddev=std)


@dataclass(frozen=True, slots=True)
class BoundaryReport:
    """What happened at one step boundary (identical plan fields on every rank).

    Attributes:
        step: ``global_step`` of the boundary.
        samples_per_s: speed over the interval that ended here, samples/s per rank (the
            job's mean over ranks when reports are aggregated; None: not measured).
        plan: the plan in use from this step on (None: the algorithm has none).
        plan_version: its service version (-1: the strategy's own default plan).
        applied: True when a new plan was applied at this boundary.
        completed: whether the service finished tuning.
    """

    step: int
    samples_per_s: float | None
    plan: BucketPlan | None
    plan_version: int
    applied: bool
    completed: bool

    def metrics(self) -> dict[str, float]:
        """The ``autotune/*`` metrics logged through the trainer's loggers."""
        out: dict[str, float] = {"autotune/completed": float(self.completed),
                                 "autotune/plan_version": float(self.plan_version)}
        if self.samples_per_s is not None:
            out["autotune/samples_per_s"] = self.samples_per_s
        if self.plan is not None:
            out["autotune/bucket_size"] = float(self.plan.bucket_size)
            out["autotune/num_buckets"] = float(len(self.plan.buckets))
            out["autotune/hierarchical"] = float(self.plan.is_hierarchical_reduce)
        return out


@dataclass(frozen=True, slots=True)
class AutotuneSummary:
    """End-of-fit summary: the plan in use and what tuning changed, measured under the same conditions.

    ``speed_before`` is the **last** interval measured on the first plan the job trained
    on and ``speed_after`` the last interval on the final plan (samples/s per rank), so
    both come from the same phase of training rather than comparing a cold start with a
    warm end. No ratio is given when the service was never reached or no other plan
    was applied (``plans_applied <= 1``): there is nothing to compare.
    """

    model_name: str
    service: str
    registered: bool
    plan_version: int
    num_buckets: int
    bucket_size: int
    hierarchical: bool
    completed: bool
    plans_applied: int
    speed_before: float | None
    speed_after: float | None
    job_id: str = ""
    #: Which algorithm would be (or was measured) faster, when one would (:mod:`.advice`); "" otherwise.
    advice: str = ""

    @property
    def ratio(self) -> float | None:
        """``speed_after / speed_before`` when the two measure different plans, else None."""
        if not self.registered or self.plans_applied <= 1 or not self.speed_before or not self.speed_after:
            return None
        return self.speed_after / self.speed_before

    def line(self) -> str:
        def fmt(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1f}"

        job = f", job {self.job_id}" if self.job_id else ""
        head = f"autotune [{self.model_name}{job} @ {self.service}]: "
        if not self.registered:
            return (f"{head}the service was not reachable; trained on the default plan ({self.num_buckets} "
                    f"buckets, bucket_size {self.bucket_size} B); no tuning, nothing to compare")
        ratio = self.ratio
        compare = (f"samples/s per rank, last interval on the first plan {fmt(self.speed_before)} -> on the final "
                   f"plan {fmt(self.speed_after)} ({ratio:.2f}x)" if ratio is not None else
                   f"samples/s per rank {fmt(self.speed_after)} (one plan: nothing to compare)")
        return (f"{head}service plan v{self.plan_version}, {self.num_buckets} buckets, bucket_size "
                f"{self.bucket_size} B, {'hierarchical' if self.hierarchical else 'flat'}, "
                f"{'completed' if self.completed else 'not completed'}, {self.plans_applied} plans applied; "
                f"{compare}{f'. {self.advice}' if self.advice else ''}")
