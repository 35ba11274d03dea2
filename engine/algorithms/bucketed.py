"""Shared base of the algorithms that reduce gradients bucket by bucket (gradient_allreduce, bytegrad)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar, Protocol

from ..buckets import Bucket, BucketEngine, BucketStep
from ..parameters import trainable_parameters
from .base import Algorithm

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.distributed as dist
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


class CrossNode(Protocol):
    """The fault-tolerant exchange among nodes (:class:`~bagua_lightning.engine.fault_tolerance.ElasticSession`)."""

    def allreduce(self, tensor: torch.Tensor) -> dist.Work: ...


def _across_nodes(step: BucketStep, bucket: Bucket, cross_node: CrossNode) -> BucketStep:
    """The algorithm's step inside the node, then the bucket averaged across the live nodes."""
    yield from step
    yield cross_node.allreduce(bucket.flat)


class GradientBucketAlgorithm(Algorithm):
    """Gradients go through a :class:`BucketEngine`; subclasses write :meth:`reduce_bucket`, one bucket step.

    The algorithm is the engine's :class:`~bagua_lightning.engine.buckets.BucketReducer`: the engine asks
    :meth:`bucket_step` for each ready bucket, in plan order, and runs the step where it fits.

    The plan's ``is_hierarchical_reduce`` decides hierarchical reduction, so a plan
    applied by the autotuner can switch it; the ``hierarchical`` keyword sets the
    initial plan's flag.
    """

    uses_gradient_buckets: ClassVar[bool] = True
    fault_tolerance_refusal: ClassVar[str | None] = None
    #: Set before setup by :class:`~bagua_lightning.engine.elastic.ElasticTraining`: each bucket, once
    #: reduced inside the node by :meth:`reduce_bucket`, is averaged across the live nodes through it.
    cross_node: CrossNode | None = None
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
    def reduce_bucket(self, bucket: Bucket, comm: CommContext, hierarchical: bool) -> BucketStep:
        """The bucket step: reduce ``bucket.flat`` in place across the ranks of ``comm``.

        A generator (:data:`~bagua_lightning.engine.buckets.BucketStep`): it issues the bucket's
        collectives, yielding the work of each asynchronous one it needs finished before going on
        (the engine waits it and resumes the step), and returns when the bucket is reduced.
        """

    def one_collective(self) -> bool:
        """True when :meth:`reduce_bucket` is, under the plan in use, one asynchronous collective yielded at
        once with nothing after it (the engine may then run it in autograd's thread)."""
        return False

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        comm = self._comm = thread_comm(comm, module)
        self._engine = BucketEngine(
            trainable_parameters(module),
            plan,
            reducer=self,
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

    def bucket_step(self, bucket: Bucket) -> BucketStep:
        step = self.reduce_bucket(bucket, self._set_up(self._comm), self.engine.plan.is_hierarchical_reduce)
        return step if self.cross_node is None else _across_nodes(step, bucket, self.cross_node)

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
