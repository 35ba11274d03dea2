"""The tuners as plain Python: cost-model fit, the cut-point programme, the Bayesian baseline."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration, split_into_buckets
from bagua_lightning.services.autotune.bayes import BayesianTuner, GaussianProcess
from bagua_lightning.services.autotune.costmodel import CommModel, ReadyModel, Sample, fit_comm_model
from bagua_lightning.services.autotune.planner import ModelBasedPlanner
from bagua_lightning.services.autotune.simulator import (
    SimulatedJob,
    bandwidth_scenario,
    compute_proportional,
    oracle_plan,
    transformer_like,
)
from tests.services.simulated_trainers import MB, abcde, peak_at_20mb


def test_comm_fit_recovers_latency_and_bandwidth_and_refuses_one_size() -> None:
    points = [(b, 0.2 + b * 1e-6) for b in (1e5, 1e6, 4e6, 1.6e7)]
    model = fit_comm_model(points)
    assert model is not None
    assert model.latency_ms == pytest.approx(0.2, rel=1e-6)
    assert model.ms_per_byte == pytest.approx(1e-6, rel=1e-6)
    assert fit_comm_model([(1e6, 1.0), (1e6, 1.1)]) is None


def test_ready_model_interpolates_and_never_goes_back() -> None:
    ready = ReadyModel([(100.0, 10.0), (200.0, 8.0)], total_bytes=400.0, backward_ms=40.0)
    assert list(ready.ready_ms(np.array([0.0, 50.0, 100.0, 200.0, 400.0]))) == [0.0, 5.0, 10.0, 10.0, 40.0]


def _brute_force(order: list[TensorDeclaration], comm: CommModel, ready_ms: list[float],
                 max_buckets: int | None = None, overhead_ms: float = 0.0, backward_ms: float = 0.0) -> float:
    """The best plan's predicted end by trying every cut (k-th bucket ready (k - 1) x overhead later)."""
    best = math.inf
    n = len(order)
    for cuts in itertools.product([False, True], repeat=n - 1):
        if max_buckets is not None and sum(cuts) + 1 > max_buckets:
            continue
        free, start = 0.0, 0
        for k, end in enumerate([i + 1 for i, c in enumerate(cuts) if c] + [n]):
            nbytes = sum(t.nbytes for t in order[start:end])
            free = max(free, ready_ms[end - 1] + k * overhead_ms) + comm.latency_ms + nbytes * comm.ms_per_byte
            start = end
        if overhead_ms > 0:
            free = max(free, backward_ms + (sum(cuts) + 1) * overhead_ms)
        best = min(best, free)
    return best


def _random_chain(seed: int) -> tuple[list[TensorDeclaration], list[float], ReadyModel, ModelBasedPlanner]:
    """Nine tensors of random sizes with random gaps between their ready times."""
    rng = np.random.default_rng(seed)
    order = [TensorDeclaration(f"t{i}", int(rng.integers(1, 50)) * 10_000, "f32") for i in range(9)]
    ends = np.cumsum([t.nbytes for t in order])
    ready_ms = list(np.cumsum(rng.uniform(0.1, 2.0, len(order))))
    ready = ReadyModel(list(zip(ends, ready_ms, strict=True)), float(ends[-1]), ready_ms[-1])
    return order, ready_ms, ready, ModelBasedPlanner(order, hierarchical_allowed=False)


def test_cut_programme_is_optimal_against_brute_force() -> None:
    order, ready_ms, ready, planner = _random_chain(3)
    for comm in (CommModel(0.05, 1e-6), CommModel(1.0, 1e-7), CommModel(0.0, 5e-6)):
        buckets = planner.optimal_buckets(comm, ready)
        assert [t for b in buckets for t in b] == order
        assert planner.predict_ms(buckets, comm, ready) == pytest.approx(_brute_force(order, comm, ready_ms))


def test_capped_and_overhead_programmes_are_optimal_against_brute_force() -> None:
    order, ready_ms, ready, planner = _random_chain(5)
    comm = CommModel(0.01, 2e-7)  # cheap latency: unbounded, the programme wants many buckets
    assert len(planner.optimal_buckets(comm, ready)) > 3
    for cap in (1, 2, 3):
        buckets = planner.optimal_buckets(comm, ready, max_buckets=cap)
        assert len(buckets) <= cap
        assert [t for b in buckets for t in b] == order
        assert planner.predict_ms(buckets, comm, ready) == pytest.approx(_brute_force(order, comm, ready_ms, cap))
    backward = ready_ms[-1]
    for overhead in (0.05, 0.3, 2.0):  # more overhead per bucket: fewer buckets
        buckets = planner.optimal_buckets(comm, ready, overhead_ms=overhead, backward_ms=backward)
        assert [t for b in buckets for t in b] == order
        assert planner.predict_ms(buckets, comm, ready, overhead, backward) == pytest.approx(
            _brute_force(order, comm, ready_ms, None, overhead, backward))
    assert len(planner.optimal_buckets(comm, ready, overhead_ms=2.0, backward_ms=backward)) < \
        len(planner.optimal_buckets(comm, ready))


def _run(tuner: object, job: SimulatedJob, timings: bool, reports: int) -> list[Sample]:
    plan = BucketPlan(split_into_buckets(job.ready_order, 10 * MB), bucket_size=10 * MB)
    samples: list[Sample] = []
    for i in range(reports):
        speed, bucket_timings, backward_ms = job.measure(plan)
        samples.append(Sample(plan, speed, backward_ms, tuple(bucket_timings) if timings else (), 1, i))
        proposal = tuner.propose(samples)  # type: ignore[attr-defined]
        if proposal.converged:
            break
        plan = proposal.plan
    return samples


@pytest.mark.parametrize(("bandwidth", "latency", "nodes"), [(1.25, 0.3, 1), (3.0, 0.2, 2), (10.0, 0.05, 2)])
def test_planner_reaches_near_best_in_a_few_reports(bandwidth: float, latency: float, nodes: int) -> None:
    tensors = transformer_like(layers=6, hidden=512)
    flat, hier = bandwidth_scenario(bandwidth, latency, nodes=nodes)
    job = SimulatedJob(tensors=tensors, compute_ms=compute_proportional(tensors, 60.0), flat=flat,
                       hierarchical=hier, forward_ms=20.0)
    planner = ModelBasedPlanner(job.ready_order, hierarchical_allowed=nodes > 1)
    samples = _run(planner, job, timings=True, reports=10)
    assert len(samples) <= 6
    final = planner.final(samples)
    assert job.step_ms(final.plan) <= 1.05 * job.step_ms(oracle_plan(job))


def test_planner_finds_fewer_buckets_when_each_costs_compute() -> None:
    # Each bucket costs backward 0.4 ms, which communication timings do not show: the communication model
    # alone (even fed the true link costs) wants many small buckets. Backward measured at different bucket
    # counts reveals the cost, and measured speed (the coarsening ladder) confirms the coarse plan.
    tensors = transformer_like(layers=12, hidden=512)
    flat, _ = bandwidth_scenario(40.0, 0.02)
    job = SimulatedJob(tensors=tensors, compute_ms=compute_proportional(tensors, 30.0), flat=flat,
                       forward_ms=10.0, bucket_overhead_ms=0.4, noise=0.005)
    planner = ModelBasedPlanner(job.ready_order, hierarchical_allowed=False)
    best = job.step_ms(oracle_plan(job))
    ready_at = np.cumsum(list(reversed(job.compute_ms)))
    ends = np.cumsum([t.nbytes for t in job.ready_order])
    truth = ReadyModel(list(zip(ends, ready_at, strict=True)), float(ends[-1]), job.backward_ms)
    model_pick = planner.optimal_buckets(CommModel(flat.latency_ms, 1e-6 / flat.gbytes_per_s), truth)
    assert job.step_ms(BucketPlan(model_pick)) > 1.05 * best

    samples = _run(planner, job, timings=True, reports=20)
    final = planner.final(samples)
    assert job.step_ms(final.plan) <= 1.03 * best
    assert planner.fit(samples).overhead_ms == pytest.approx(0.4, rel=0.25)  # read off backward vs bucket count
    assert len(final.plan.buckets) < len(model_pick)
    assert len(samples) <= 8


def test_coarsening_ladder_stops_when_coarser_is_slower() -> None:
    # No per-bucket overhead and a slow link: overlap matters, so the first coarser step is slower and ends it.
    tensors = transformer_like(layers=6, hidden=512)
    flat, _ = bandwidth_scenario(1.25, 0.3)
    job = SimulatedJob(tensors=tensors, compute_ms=compute_proportional(tensors, 60.0), flat=flat, forward_ms=20.0,
                       noise=0.005)
    planner = ModelBasedPlanner(job.ready_order, hierarchical_allowed=False)
    samples = _run(planner, job, timings=True, reports=20)
    reasons = [planner.propose(samples[: i + 1]).reason for i in range(len(samples))]
    assert reasons.count("coarsen") == 1 and reasons[-1] == "best"
    assert planner.final(samples).plan.fingerprint() != samples[-1].plan.fingerprint()  # the coarser one lost


def test_planner_explores_when_one_bucket_size_was_seen() -> None:
    order = [TensorDeclaration(f"t{i}", MB, "f32") for i in range(32)]
    planner = ModelBasedPlanner(order, hierarchical_allowed=False)
    plan = BucketPlan(split_into_buckets(order, 4 * MB), bucket_size=4 * MB)  # 8 equal buckets
    job = SimulatedJob(tensors=list(reversed(order)), compute_ms=[1.0] * 32, flat=bandwidth_scenario(1.0, 0.5)[0])
    speed, timings, backward = job.measure(plan)
    proposal = planner.propose([Sample(plan, speed, backward, tuple(timings), 1, 0)])
    assert proposal.reason == "explore"
    assert len(set(proposal.plan.bucket_bytes)) > 1 or len(proposal.plan.buckets) != 8


def test_planner_keeps_dtypes_apart() -> None:
    order = [TensorDeclaration(f"t{i}", MB, "f16" if i % 3 == 0 else "f32") for i in range(12)]
    planner = ModelBasedPlanner(order, hierarchical_allowed=False)
    buckets = planner.optimal_buckets(CommModel(0.1, 1e-6), ReadyModel([], 12 * 4 * MB, 10.0))
    assert all(len({t.dtype for t in b}) == 1 for b in buckets)
    assert sorted(t.name for b in buckets for t in b) == sorted(t.name for t in order)


def test_gp_fits_a_smooth_function() -> None:
    x = np.linspace(0, 1, 12)[:, None]
    gp = GaussianProcess(x, np.sin(4 * x[:, 0]))
    mean, std = gp.predict(np.array([[0.33], [0.71]]))
    assert mean == pytest.approx(np.sin(4 * np.array([0.33, 0.71])), abs=0.05)
    assert np.all(std < 0.2)


def test_bayesian_baseline_finds_the_20mb_cut() -> None:
    tensors = abcde()
    tuner = BayesianTuner(tensors, hierarchical_allowed=True)
    plan = BucketPlan(split_into_buckets(tensors, 10 * MB), bucket_size=10 * MB)
    samples = []
    for i in range(12):
        samples.append(Sample(plan, peak_at_20mb(plan), 0.0, (), 1, i))
        plan = tuner.propose(samples).plan
    best = tuner.final(samples).plan
    assert best.tensor_names == [["A", "B", "C"], ["D", "E"]]
    assert not best.is_hierarchical_reduce


def test_planner_and_simulator_reject_bad_values_with_the_fix() -> None:
    order, _, ready, planner = _random_chain(1)
    with pytest.raises(ValueError, match=r"noise must be a relative speed difference in \[0, 1\), e.g. 0.02, got 2"):
        ModelBasedPlanner(order, hierarchical_allowed=False, noise=2)
    with pytest.raises(ValueError, match=r"max_buckets must be >= 1 \(or None for no cap\), got 0"):
        planner.optimal_buckets(CommModel(0.1, 1e-6), ready, max_buckets=0)
    with pytest.raises(ValueError, match="overhead_ms must be >= 0 ms per bucket, got -1"):
        planner.optimal_buckets(CommModel(0.1, 1e-6), ready, overhead_ms=-1)
    with pytest.raises(ValueError, match=r"bucket_overhead_ms must be >= 0 ms per bucket, got -0\.5"):
        SimulatedJob(tensors=order, compute_ms=[1.0] * len(order), flat=bandwidth_scenario(1.0, 0.1)[0],
                     bucket_overhead_ms=-0.5)
