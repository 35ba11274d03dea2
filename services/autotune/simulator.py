"""A simulated data-parallel job: what a plan would measure, with noise (for ``simulate``, tests, benchmarks).

Backward produces gradients one after another (``compute_ms`` each, in ready
order); each bucket is communicated once its last gradient is ready and the
previous bucket is done, costing ``latency_ms + bytes / bandwidth`` (per mode),
times log-normal noise. Launching a bucket also costs the compute side
``bucket_overhead_ms`` (the launch on the backward thread, SMs the collective
takes from backward): every later gradient is that much later and backward that
much longer; a trainer's communication timings do not show it. A step is forward
+ backward + the communication left after backward. Measurements come back in
the shape trainers report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...proto.plan import BucketPlan, BucketTimingRecord, TensorDeclaration
from .costmodel import MB, CommModel, ReadyModel, simulate_overlap
from .planner import ModelBasedPlanner


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Communication cost of one bucket in one mode: ``latency_ms + bytes / (gbytes_per_s * 1e9) * 1e3``."""

    latency_ms: float
    gbytes_per_s: float

    def cost_ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / (self.gbytes_per_s * 1e9) * 1e3


@dataclass(kw_only=True, slots=True)
class SimulatedJob:
    """The ground truth of one simulated job.

    Attributes:
        tensors: the model's tensors in registration (forward) order.
        compute_ms: backward compute time of each tensor's gradient, same order as ``tensors``.
        flat: link model of flat reduction.
        hierarchical: link model of hierarchical reduction (None: one node, no choice).
        forward_ms: forward time per step, ms.
        batch_size: samples per step per rank (speed = batch_size / step seconds).
        noise: relative standard deviation of every measured duration.
        bucket_overhead_ms: compute-side cost of launching one bucket, ms (see the module docstring).
        seed: seed of the noise.
    """

    tensors: Sequence[TensorDeclaration]
    compute_ms: Sequence[float]
    flat: LinkModel
    hierarchical: LinkModel | None = None
    forward_ms: float = 30.0
    batch_size: int = 32
    noise: float = 0.02
    bucket_overhead_ms: float = 0.0
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.tensors) != len(self.compute_ms) or not self.tensors:
            raise ValueError(f"need one compute time per tensor, got {len(self.compute_ms)} for "
                             f"{len(self.tensors)} tensors")
        if self.bucket_overhead_ms < 0:
            raise ValueError(f"bucket_overhead_ms must be >= 0 ms per bucket, got {self.bucket_overhead_ms}")
        self._rng = np.random.default_rng(self.seed)

    @property
    def ready_order(self) -> list[TensorDeclaration]:
        """Gradients become ready in reverse registration order (last layer first)."""
        return list(reversed(self.tensors))

    @property
    def backward_ms(self) -> float:
        return float(sum(self.compute_ms))

    def _ready_times(self) -> dict[str, float]:
        times = np.cumsum(list(reversed(self.compute_ms)))
        return {t.name: float(ms) for t, ms in zip(self.ready_order, times, strict=True)}

    def _link(self, plan: BucketPlan) -> LinkModel:
        if plan.is_hierarchical_reduce and self.hierarchical is not None:
            return self.hierarchical
        return self.flat

    def step_ms(self, plan: BucketPlan) -> float:
        """Noise-free step time of ``plan``."""
        ready = self._ready_times()
        link = self._link(plan)
        ovh = self.bucket_overhead_ms
        backward = self.backward_ms + ovh * len(plan.buckets)
        _, exposed = simulate_overlap([max(ready[t.name] for t in b) + ovh * i for i, b in enumerate(plan.buckets)],
                                     [link.cost_ms(n) for n in plan.bucket_bytes], backward)
        return self.forward_ms + backward + exposed

    def measure(self, plan: BucketPlan) -> tuple[float, list[BucketTimingRecord], float]:
        """A noisy measurement of one step: (speed in samples/s, bucket timings, backward_ms)."""
        def noisy(value: float) -> float:
            return float(value * np.exp(self._rng.normal(0.0, self.noise)))

        ready = self._ready_times()
        link = self._link(plan)
        compute = noisy(self.backward_ms)
        scale = compute / self.backward_ms
        ovh = self.bucket_overhead_ms
        backward = compute + ovh * len(plan.buckets)
        free = 0.0
        timings = []
        for index, (bucket, nbytes) in enumerate(zip(plan.buckets, plan.bucket_bytes, strict=True)):
            ready_ms = max(ready[t.name] for t in bucket) * scale + ovh * index
            comm = noisy(link.cost_ms(nbytes))
            free = max(free, ready_ms) + comm
            timings.append(BucketTimingRecord(bucket_index=index, bytes=nbytes, ready_ms=ready_ms, comm_ms=comm,
                                              wait_ms=0.0))
        exposed = max(0.0, free - backward)
        # The step waits for each bucket in turn after backward; the last wait is the exposed time.
        for record in timings:
            record.wait_ms = exposed if record is timings[-1] else 0.0
        step = noisy(self.forward_ms) + backward + exposed
        return self.batch_size / (step / 1e3), timings, backward


def oracle_plan(job: SimulatedJob) -> BucketPlan:
    """The best plan for the true (noise-free) costs: the planner's programme fed the ground truth."""
    order = job.ready_order
    planner = ModelBasedPlanner(order, hierarchical_allowed=job.hierarchical is not None, max_atoms=4096)
    ready_at = job._ready_times()
    ends = np.cumsum([t.nbytes for t in order])
    ready = ReadyModel([(float(e), ready_at[t.name]) for e, t in zip(ends, order, strict=True)],
                       float(ends[-1]), job.backward_ms)
    best: BucketPlan | None = None
    for mode, link in ((False, job.flat), (True, job.hierarchical)):
        if link is None:
            continue
        comm = CommModel(latency_ms=link.latency_ms, ms_per_byte=1e-6 / link.gbytes_per_s)
        candidates = [planner.optimal_buckets(comm, ready)]
        if job.bucket_overhead_ms > 0:
            # With a per-bucket overhead the best plan may have fewer buckets: every cap, and the
            # programme that knows the overhead.
            candidates += [planner.optimal_buckets(comm, ready, max_buckets=cap) for cap in range(1, len(candidates[0]))]
            candidates.append(planner.optimal_buckets(comm, ready, overhead_ms=job.bucket_overhead_ms,
                                                      backward_ms=job.backward_ms))
        for buckets in candidates:
            plan = BucketPlan(buckets=buckets, bucket_size=max(1, int(ends[-1] / len(buckets))),
                              is_hierarchical_reduce=mode)
            if best is None or job.step_ms(plan) < job.step_ms(best):
                best = plan
    assert best is not None
    return best


def transformer_like(layers: int = 24, hidden: int = 1024, dtype: str = "f32") -> list[TensorDeclaration]:
    """Per layer: attention (4 h^2), MLP (8 h^2), two norms (2 h); plus embeddings; registration order."""
    tensors = [TensorDeclaration("embed.weight", 32000 * hidden, dtype)]
    for i in range(layers):
        tensors += [
            TensorDeclaration(f"layer{i}.attn.weight", 4 * hidden * hidden, dtype),
            TensorDeclaration(f"layer{i}.norm1.weight", hidden, dtype),
            TensorDeclaration(f"layer{i}.mlp.weight", 8 * hidden * hidden, dtype),
            TensorDeclaration(f"layer{i}.norm2.weight", hidden, dtype),
        ]
    return tensors


def resnet_like(stages: Sequence[int] = (3, 4, 6, 3), width: int = 64) -> list[TensorDeclaration]:
    """Convolutions whose size grows 4x per stage, each followed by a small norm; registration order."""
    tensors = []
    for s, blocks in enumerate(stages):
        channels = width * 2**s
        for b in range(blocks):
            for c in range(3):
                tensors.append(TensorDeclaration(f"s{s}.b{b}.conv{c}.weight", channels * channels * 9, "f32"))
                tensors.append(TensorDeclaration(f"s{s}.b{b}.bn{c}.weight", 2 * channels, "f32"))
    tensors.append(TensorDeclaration("fc.weight", 2048 * 1000, "f32"))
    return tensors


def compute_proportional(tensors: Sequence[TensorDeclaration], backward_ms: float,
                         floor_ms: float = 0.01) -> list[float]:
    """Backward compute time per tensor, proportional to its size (plus a small floor), summing to ~backward_ms."""
    total = sum(t.nbytes for t in tensors)
    return [floor_ms + (backward_ms - floor_ms * len(tensors)) * t.nbytes / total for t in tensors]


def bandwidth_scenario(gbytes_per_s: float, latency_ms: float, *, nodes: int = 1) -> tuple[LinkModel, LinkModel | None]:
    """Flat and hierarchical links; hierarchical trades an intra-node step for less inter-node traffic."""
    flat = LinkModel(latency_ms=latency_ms, gbytes_per_s=gbytes_per_s)
    if nodes <= 1:
        return flat, None
    return flat, LinkModel(latency_ms=2.5 * latency_ms, gbytes_per_s=gbytes_per_s * 1.6)


__all__ = ["MB", "LinkModel", "SimulatedJob", "bandwidth_scenario", "compute_proportional", "oracle_plan",
           "resnet_like", "transformer_like"]
