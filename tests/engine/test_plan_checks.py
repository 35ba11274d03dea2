"""A bucket plan on its way into the engine is checked against the model once, where buckets are built from it
(gradient buckets and weight buckets alike), whether it comes with the wrapper or later through
``driver.apply_plan``; a plan that does not match is refused with :class:`PlanMismatchError` naming what is
wrong, and the plan in use stays."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from bagua_lightning.core.errors import PlanMismatchError
from bagua_lightning.engine import buckets
from bagua_lightning.engine.algorithms import weights
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
from bagua_lightning.engine.parameters import check_plan, declare, trainable_parameters
from bagua_lightning.proto.plan import BucketPlan

# one of each kind: gradient buckets (engine/buckets.py) and weight buckets (engine/algorithms/weights.py)
ALGORITHMS = ["gradient_allreduce", "decentralized"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BucketPlan]]:
    """The plans the real ``check_plan`` was called with, from either place that builds buckets."""
    seen: list[BucketPlan] = []

    def counted(plan: BucketPlan, named: Any) -> None:
        seen.append(plan)
        check_plan(plan, named)

    monkeypatch.setattr(buckets, "check_plan", counted)
    monkeypatch.setattr(weights, "check_plan", counted)
    yield seen


def _wrap(name: str, plan: BucketPlan | None = None) -> BaguaDistributedDataParallel:
    comm = CommContext(rank=0, world_size=1, local_rank=0, local_size=1)  # one rank: collectives are no-ops
    model = _model()
    return BaguaDistributedDataParallel(model, get_algorithm_class(name).from_kwargs(), comm, plan=plan,
                                        optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])


def _plans() -> tuple[BucketPlan, BucketPlan]:
    """A good plan (one tensor per bucket) and one missing the last tensor."""
    decls = declare(trainable_parameters(_model()))
    good = BucketPlan(buckets=tuple((d,) for d in decls), bucket_size=64)
    return good, BucketPlan(buckets=tuple((d,) for d in decls[:-1]), bucket_size=64)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_plan_is_checked_once_on_its_way_in(name: str, checks: list[BucketPlan]) -> None:
    good, bad = _plans()
    with pytest.raises(PlanMismatchError, match=r"missing \['2.bias'\]"):
        _wrap(name, plan=bad)
    assert checks == [bad]
    checks.clear()
    wrapped = _wrap(name, plan=good)
    try:
        assert checks == [good]
        checks.clear()
        with pytest.raises(PlanMismatchError, match=r"missing \['2.bias'\]"):
            wrapped.driver.apply_plan(bad)
        assert checks == [bad]
        checks.clear()
        wrapped.driver.apply_plan(good)
        assert checks == [good]
        wrapped(torch.randn(3, 4)).sum().backward()  # the new buckets work
    finally:
        wrapped.teardown()


def test_the_wrapper_forwards_no_plan() -> None:
    """One way to apply a plan: the driver's (the strategy's ``apply_plan`` finds the driver of its fit)."""
    assert not hasattr(BaguaDistributedDataParallel, "apply_plan")
    wrapped = _wrap("gradient_allreduce")
    try:
        good, _ = _plans()
        wrapped.driver.apply_plan(good)
        assert wrapped.bucket_plan is not None and wrapped.bucket_plan.same_layout(good)
    finally:
        wrapped.teardown()
