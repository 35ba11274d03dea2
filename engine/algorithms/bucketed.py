"""Shared base of the algorithms that reduce gradients bucket by bucket (gradient_allreduce, bytegrad)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import torch.distributed as dist

from ..buckets import Bucket, BucketEngine
from ..parameters import trainable_parameters
from .base import Algorithm

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from ...proto.plan import BucketPlan, StepTimings
    from ..comm import CommContext


def thread_comm(comm: CommContext, module: nn.Module) -> CommContext:
    """The context a bucket engine of ``module`` communicates on.

    On CPU the engine's communication thread issues Gloo collectives while the main
    thread may issue its own during backward (SyncBatchNorm): the thread works on
    process groups of its own (:meth:`CommContext.side_context`) so the two never
    interleave on one group. Every rank calls this at the same point of setup.
    """
    params = trainable_parameters(module)
    on_cpu = not params or params[0][1].device.type != "cuda"
    return comm.side_context("thread") if on_cpu and comm.world_size > 1 else comm


class GradientBucketAlgorithm(Algorithm):
    """Gradients go through a :class:`BucketEngine`; subclasses implement :meth:`reduce_bucket`.

    The plan's ``is_hierarchical_reduce`` decides hierarchical reduction, so a plan
    applied by the autotuner can switch it; the ``hierarchical`` keyword sets the
    initial plan's flag.
    """

    uses_gradient_buckets: ClassVar[bool] = True
    hierarchical: bool
    average: bool

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        if not isinstance(hierarchical, bool) or not isinstance(average, bool):
            raise TypeError(
                f"{self.name}: hierarchical and average must be bools, got {hierarchical!r}, {average!r}"
            )
        self.hierarchical = hierarchical
        self.average = average
        self._engine: BucketEngine | None = None
        self._comm: CommContext | None = None

    def pad_multiple(self, comm: CommContext, plan: BucketPlan) -> int:
        """Buffer lengths are padded to a multiple of this (chunked collectives need it)."""
        return 1

    @abc.abstractmethod
    def reduce_bucket(
        self, bucket: Bucket, comm: CommContext, hierarchical: bool, defer: bool
    ) -> dist.Work | None:
        """Reduce ``bucket.flat`` in place across ranks.

        ``defer=False``: runs under a side stream / the communication thread and may wait.
        ``defer=True`` (only when :meth:`single_collective`): issue one asynchronous
        collective and return its work without waiting.
        """

    def single_collective(self, hierarchical: bool) -> bool:
        """True when a bucket is reduced by one collective that can be waited on later."""
        return False

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        comm = self._comm = thread_comm(comm, module)
        self._engine = BucketEngine(
            trainable_parameters(module),
            plan,
            communicate=self._communicate,
            can_defer=self._can_defer,
            bind_grads=True,
            flatten=self.flatten,
            pad_multiple=self.pad_multiple(comm, plan),
            plan_is_default=self.plan_is_default,
        )

    @property
    def engine(self) -> BucketEngine:
        if self._engine is None:
            raise RuntimeError(f"algorithm {self.name!r} is not set up; call setup(module, comm, plan) first")
        return self._engine

    def _communicate(self, bucket: Bucket, defer: bool) -> dist.Work | None:
        assert self._comm is not None
        return self.reduce_bucket(bucket, self._comm, self.engine.plan.is_hierarchical_reduce, defer)

    def _can_defer(self) -> bool:
        return self.single_collective(self.engine.plan.is_hierarchical_reduce)

    def on_forward_start(self, step: int) -> None:
        engine = self.engine
        if engine.wants_ready_order_plan:
            engine.adopt_ready_order(self._comm.group if self._comm else None)
        engine.attach_grads()

    def on_backward_start(self, step: int) -> None:
        self.engine.begin()

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        self.engine.mark_ready(param)

    def on_backward_end(self, step: int) -> None:
        self.engine.finish()

    def apply_plan(self, plan: BucketPlan) -> None:
        assert self._comm is not None
        engine = self.engine
        if engine.pad_multiple != self.pad_multiple(self._comm, plan):
            engine.pad_multiple = self.pad_multiple(self._comm, plan)
        engine.rebuild(plan)

    @property
    def plan(self) -> BucketPlan:
        return self.engine.plan

    def last_step_timings(self) -> StepTimings | None:
        return self._engine.last_step_timings() if self._engine else None

    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._comm = None
