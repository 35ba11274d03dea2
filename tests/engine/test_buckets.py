"""BucketEngine in one process: launch order, views, unused parameters, re-bucketing, timings; QAdam args."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from bagua_lightning.core.errors import PlanMismatchError
from bagua_lightning.engine.algorithms.q_adam import QAdamOptimizer
from bagua_lightning.engine.buckets import Bucket, BucketEngine, BucketStep
from bagua_lightning.engine.parameters import check_plan, declare, default_plan, trainable_parameters
from bagua_lightning.proto.plan import BucketPlan


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_default_plan_is_reverse_registration_order_cut_at_bucket_size() -> None:
    named = trainable_parameters(_model())
    plan = default_plan(named, bucket_size=100)
    flat_names = [n for bucket in plan.tensor_names for n in bucket]
    assert flat_names == [n for n, _ in reversed(named)]
    assert all(b >= 100 for b in plan.bucket_bytes[:-1])  # every bucket but the last reached the size
    ordered = default_plan(named, bucket_size=100, order=["0.weight", "4.bias"])
    assert [n for b in ordered.tensor_names for n in b][:2] == ["0.weight", "4.bias"]
    with pytest.raises(PlanMismatchError, match="unknown tensors"):
        default_plan(named, order=["nope"])


def test_check_plan_names_what_is_wrong() -> None:
    named = trainable_parameters(_model())
    decls = declare(named)
    with pytest.raises(PlanMismatchError, match=r"missing \['4.bias'\]"):
        check_plan(BucketPlan(buckets=(tuple(decls[:-1]),)), named)


def test_engine_launches_in_plan_order_whatever_the_ready_order() -> None:
    model = _model()
    named = trainable_parameters(model)
    launched: list[int] = []

    class Doubling:
        def bucket_step(self, bucket: Bucket) -> BucketStep:
            launched.append(bucket.index)
            bucket.flat.mul_(2)  # stands in for a reduction
            yield from ()

        def one_collective(self) -> bool:
            return False

    engine = BucketEngine(named, default_plan(named, bucket_size=64), reducer=Doubling())
    try:
        nb = len(engine.buckets)
        assert nb >= 3
        shuffled = [p for _, p in named]
        random.Random(1).shuffle(shuffled)
        unused = shuffled.pop()  # no gradient, never becomes ready: counts as zero
        for p in shuffled:
            p.grad = torch.ones_like(p)
        engine.begin()
        for p in shuffled:
            engine.mark_ready(p)
        assert engine.finish()
        assert launched == list(range(nb))
        for _, p in named:
            assert p.grad is engine.view(p)  # gradients are views of the flat buffers
            expected = 0.0 if p is unused else 2.0
            assert torch.all(p.grad == expected)
        timings = engine.last_step_timings()
        assert timings is not None and [b.bucket_index for b in timings.buckets] == list(range(nb))
        assert sum(b.bytes for b in timings.buckets) == sum(p.numel() * 4 for _, p in named)
        # A backward with no gradient at all (torch.autograd.grad) communicates nothing.
        engine.begin()
        assert not engine.finish() and launched == list(range(nb))
        # Re-bucketing keeps the values and re-points the gradients.
        before = {n: p.grad.clone() for n, p in named if p.grad is not None}
        engine.rebuild(BucketPlan(buckets=(tuple(declare(named)),), bucket_size=1))
        assert len(engine.buckets) == 1
        for n, p in named:
            assert p.grad is engine.view(p) and torch.equal(p.grad, before[n])
    finally:
        engine.close()


def test_padding_is_a_multiple_and_stays_zero() -> None:
    named = trainable_parameters(_model())
    engine = BucketEngine(named, default_plan(named), reducer=_Staged([], one=False), pad_multiple=7)
    try:
        (bucket,) = engine.buckets
        assert bucket.flat.numel() % 7 == 0 and bucket.flat.numel() >= bucket.numel
        assert torch.all(bucket.flat[bucket.numel:] == 0)
    finally:
        engine.close()


def test_qadam_optimizer_validates_its_arguments() -> None:
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 1, got 0"):
        QAdamOptimizer(params, warmup_steps=0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        QAdamOptimizer(params, lr=0)
    with pytest.raises(ValueError, match="betas"):
        QAdamOptimizer(params, betas=(0.9, 1.0))


def test_qadam_optimizer_alone_is_adam_during_warmup() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(3, 1), nn.Linear(3, 1)
    b.load_state_dict(a.state_dict())
    qa = QAdamOptimizer(a.parameters(), lr=0.1, warmup_steps=5)
    ref = torch.optim.Adam(b.parameters(), lr=0.1)
    x = torch.randn(8, 3)
    for _ in range(5):
        for model, opt in ((a, qa), (b, ref)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert qa.completed_steps == 5 and not qa.in_warmup


def test_wrapper_keeps_a_given_plan_and_recuts_only_the_default_one() -> None:
    from bagua_lightning.engine.algorithms.base import get_algorithm_class
    from bagua_lightning.engine.comm import CommContext
    from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

    comm = CommContext(rank=0, world_size=1, local_rank=0, local_size=1)  # one rank: collectives are no-ops
    named = trainable_parameters(_model())
    decls = declare(named)
    # A chosen plan in registration order, one tensor per bucket: not what the ready-order cut would give.
    given = BucketPlan(buckets=tuple((d,) for d in decls), bucket_size=64)

    def train(plan: BucketPlan | None) -> BaguaDistributedDataParallel:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        algo = get_algorithm_class("gradient_allreduce").from_kwargs()
        wrapped = BaguaDistributedDataParallel(model, algo, comm, bucket_size=10**6, plan=plan, optimizers=[opt])
        for _ in range(3):
            wrapped(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return wrapped

    kept = train(given)
    assert kept.bucket_plan is not None and kept.bucket_plan.same_layout(given)
    recut = train(None)  # the default plan: one bucket at this size, re-cut in the observed ready order
    assert recut.bucket_plan is not None and len(recut.bucket_plan.buckets) == 1
    assert recut.bucket_plan.tensor_names[0][0] == "4.bias"  # last layer's gradient first
    kept.teardown()
    recut.teardown()


class _Done:
    """A finished work, as the step of a rank alone gets: waiting records that it was waited."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(f"wait {self.name}")
        return True


class _Staged:
    """A reducer whose step has two stages (issue, pause, finish), logging the order the engine runs them."""

    def __init__(self, log: list[str], *, one: bool, fail_at: int | None = None) -> None:
        self.log, self.one, self.fail_at = log, one, fail_at

    def bucket_step(self, bucket: Bucket) -> BucketStep:
        i = bucket.index
        self.log.append(f"issue {i}")
        yield _Done(self.log, str(i))  # type: ignore[misc]
        if i == self.fail_at:
            raise RuntimeError(f"bucket {i} failed")
        if not self.one:
            self.log.append(f"stage2 {i}")
            yield None  # a pause with nothing to wait for
        bucket.flat.add_(1)
        self.log.append(f"done {i}")

    def one_collective(self) -> bool:
        return self.one


def _backward(engine: BucketEngine, named: list[tuple[str, torch.nn.Parameter]]) -> bool:
    for _, p in named:
        p.grad = torch.zeros_like(p)
    engine.begin()
    for _, p in named:
        engine.mark_ready(p)
    return engine.finish()


def test_measured_steps_run_each_to_its_end_in_plan_order() -> None:
    named = trainable_parameters(_model())
    log: list[str] = []
    engine = BucketEngine(named, default_plan(named, bucket_size=64), reducer=_Staged(log, one=False))
    try:
        n = len(engine.buckets)
        assert _backward(engine, named)  # the first backward of a plan is measured
        expected = [f"{what} {i}" for i in range(n) for what in ("issue", "wait", "stage2", "done")]
        assert log == expected
        assert all(torch.all(p.grad == 1) for _, p in named)
    finally:
        engine.close()


def test_unmeasured_steps_overlap_the_next_bucket_and_one_collective_steps_run_inline() -> None:
    named = trainable_parameters(_model())
    for one in (False, True):
        log: list[str] = []
        engine = BucketEngine(named, default_plan(named, bucket_size=64), reducer=_Staged(log, one=one),
                              timing_every=1000)
        try:
            n = len(engine.buckets)
            assert _backward(engine, named)  # measured
            log.clear()
            assert _backward(engine, named)  # not measured
            if one:  # inline: every step issued as its bucket is ready, all waited at the end
                expected = [f"issue {i}" for i in range(n)]
                expected += [e for i in range(n) for e in (f"wait {i}", f"done {i}")]
            else:  # the previous step is resumed to its end once the next one is issued
                expected = ["issue 0"]
                for i in range(1, n):
                    expected += [f"issue {i}", f"wait {i - 1}", f"stage2 {i - 1}", f"done {i - 1}"]
                expected += [f"wait {n - 1}", f"stage2 {n - 1}", f"done {n - 1}"]
            assert log == expected, one
            assert all(torch.all(p.grad == 1) for _, p in named)
        finally:
            engine.close()


def test_a_failed_step_is_raised_and_leaves_no_half_done_step_behind() -> None:
    named = trainable_parameters(_model())
    log: list[str] = []
    reducer = _Staged(log, one=False, fail_at=0)
    engine = BucketEngine(named, default_plan(named, bucket_size=64), reducer=reducer, timing_every=1000)
    try:
        assert len(engine.buckets) >= 2
        with pytest.raises(RuntimeError, match="bucket 0 failed"):
            _backward(engine, named)
        reducer.fail_at = None
        log.clear()
        assert _backward(engine, named)  # the next backward starts clean: no step of the failed one resumes
        assert log[0] == "issue 0" and "done 0" in log
    finally:
        engine.close()
