"""Bagua's QAdam: Adam whose first moment, not the gradient, is exchanged compressed after a warm-up.

Warm-up (the first ``warmup_steps`` optimizer steps): gradients are averaged with a
plain allreduce and :class:`QAdamOptimizer` is Adam. Afterwards the second moment
``v`` is frozen; in each backward the algorithm updates every parameter's first
moment ``m`` from its local gradient as soon as the gradient is ready, and the
``m`` buckets are averaged with ByteGrad's compressed exchange (MinMax uint8, about
4x fewer bytes). The optimizer then steps with the averaged ``m`` and the frozen
``v``. Every rank decodes the same bytes, so replicas stay identical.

Notes:
    * ``m`` lives in the algorithm's flat buffers (the optimizer state's ``exp_avg``
      tensors are views of them), so no copy is made; a loaded optimizer state is
      copied in once and re-pointed.
    * After warm-up, ``m`` absorbs the gradient when it is ready: gradient clipping
      and loss scaling (``16-mixed``) would apply too late, so they are refused
      for ``16-mixed`` by the strategy and clipping only affects the warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ...core.errors import ConfigurationError
from ..buckets import Bucket, BucketEngine, BucketStep
from ..comm import CommContext
from ..compressed_comm import ExchangeBuffers, compressed_all_reduce_
from ..parameters import trainable_parameters
from .base import Algorithm, AlgorithmOptimizerError, register_algorithm
from .bucketed import thread_comm
from .gradient_allreduce import allreduce_step

if TYPE_CHECKING:  # pragma: no cover
    from ...proto.plan import BucketPlan, StepTimings

QADAM_OPTIMIZER_ERROR = "Bagua QAdam can only accept one QAdamOptimizer"


class QAdamOptimizerError(AlgorithmOptimizerError):
    """qadam was given something other than exactly one :class:`QAdamOptimizer`."""


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam for the ``qadam`` algorithm (Bagua's ``QAdamOptimizer``).

    Args:
        params: parameters or parameter groups.
        lr: learning rate, > 0.
        warmup_steps: steps of plain gradient allreduce and ordinary Adam before the
            second moment is frozen and the compressed first moment is exchanged; >= 1
            (the frozen second moment must come from at least one step).
        betas: decay rates of the first and second moment, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"QAdamOptimizer: lr must be > 0, got {lr}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(
                f"QAdamOptimizer: warmup_steps must be an int >= 1, got {warmup_steps!r}; "
                "the frozen second moment is estimated during warm-up"
            )
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"QAdamOptimizer: betas must be two values in [0, 1), got {betas!r}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"QAdamOptimizer: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        self.warmup_steps = warmup_steps
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        #: Set by the qadam algorithm: after warm-up it updates and averages ``exp_avg`` itself.
        self.momentum_is_external = False
        #: ids of parameters whose first moment stays local even then (not communicated: MoE experts).
        self.local_momentum: set[int] = set()
        self._steps = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    @property
    def completed_steps(self) -> int:
        """Optimizer steps taken so far (restored with the optimizer state)."""
        for group in self.param_groups:
            for p in group["params"]:
                return int(self.state[p]["step"])
        return 0

    @property
    def in_warmup(self) -> bool:
        """True while the next step is a warm-up step."""
        return self.completed_steps < self.warmup_steps

    def group_of(self, param: torch.Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError("parameter is not optimised by this QAdamOptimizer")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step over every parameter, with multi-tensor (``torch._foreach_*``) updates.

        During warm-up both moments follow the gradient; afterwards ``v`` is frozen and
        ``m`` is either updated here from the local gradient or, when the qadam
        algorithm exchanges it (``momentum_is_external``), taken as it is.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for (t, phase), params in self._batches(group).items():
                self._update(group, t, phase, params)
        return loss

    def _batches(self, group: dict[str, Any]) -> dict[tuple[int, str], list[torch.Tensor]]:
        """Advance every parameter's step count; the parameters to update by (step, phase).

        Phases: "warmup" (both moments from the gradient), "local" (``m`` from the
        gradient, ``v`` frozen), "external" (``m`` averaged by the algorithm). All
        parameters normally share one step count, so this is one or two batches.
        """
        batches: dict[tuple[int, str], list[torch.Tensor]] = {}
        for p in group["params"]:
            state = self.state[p]
            t = int(state["step"]) + 1
            state["step"] = t
            external = self.momentum_is_external and t > self.warmup_steps
            if p.grad is None and not external:
                continue  # (after warm-up the averaged m moves every parameter, as on every rank)
            phase = "warmup" if t <= self.warmup_steps else "external" if external else "local"
            batches.setdefault((t, phase), []).append(p)
        return batches

    def _update(self, group: dict[str, Any], t: int, phase: str, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        if phase != "external":
            # Every parameter of these phases has a gradient (see _batches); foreach ops refuse unequal lists.
            grads: list[torch.Tensor] | tuple[torch.Tensor, ...] = [p.grad for p in params if p.grad is not None]
            if group["weight_decay"] != 0:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
            if phase == "warmup":
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        bias1 = 1 - beta1**t
        bias2 = 1 - beta2 ** min(t, self.warmup_steps)  # v froze after warm-up
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, math.sqrt(bias2))
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-group["lr"] / bias1)


@register_algorithm(
    name="qadam",
    description="Adam whose compressed first moment is exchanged after warm-up",
    bagua_name="QAdamAlgorithm",
    optimizer_arg="q_adam_optimizer",
)
class QAdamAlgorithm(Algorithm):
    """Gradient allreduce during warm-up, then the compressed exchange of Adam's first moment.

    Needs exactly one :class:`QAdamOptimizer` (bound with :meth:`bind_optimizers`).

    Args:
        hierarchical: reduce within each node first; only node leaders exchange
            (compressed after warm-up); broadcast within the node (flat with one node).
    """

    uses_gradient_buckets = True
    fault_tolerance_refusal: ClassVar[str | None] = (
        "its compressed first moment lives in every node's optimizer state and is exchanged in place of the "
        "gradient: a node that drops out mid-exchange leaves the others' momentum half-updated; use "
        "gradient_allreduce with torch.optim.Adam for fault-tolerant training"
    )
    unsupported_precisions: ClassVar[Mapping[str, str]] = {
        "16-mixed": "the loss-scaled gradient would enter the momentum; use precision='bf16-mixed' or '32-true'",
    }

    def __init__(self, hierarchical: bool = True) -> None:
        if not isinstance(hierarchical, bool):
            raise TypeError(f"qadam: hierarchical must be a bool, got {hierarchical!r}")
        self.hierarchical = hierarchical
        self._comm: CommContext | None = None
        self._module: nn.Module | None = None
        self._grad_engine: BucketEngine | None = None
        self._momentum_engine: BucketEngine | None = None
        self._optimizer: QAdamOptimizer | None = None
        self._compressed_phase = False
        self._plan: BucketPlan | None = None
        self._exchange_buffers: dict[int, ExchangeBuffers] = {}

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        self._comm, self._module, self._plan = thread_comm(comm, module), module, plan
        self._grad_engine = BucketEngine(
            trainable_parameters(module), plan, reducer=_GradientReducer(self), flatten=self.flatten,
            plan_is_default=self.plan_is_default,
        )

    @staticmethod
    def check_optimizers(optimizers: Sequence[Any]) -> QAdamOptimizer:
        """The single QAdamOptimizer, or a :class:`QAdamOptimizerError` starting with Bagua's message."""
        if len(optimizers) != 1 or not isinstance(optimizers[0], QAdamOptimizer):
            kinds = [type(o).__name__ for o in optimizers]
            raise QAdamOptimizerError(
                f"{QADAM_OPTIMIZER_ERROR}, but got {len(optimizers)} optimizer(s): {kinds}. "
                "Return exactly one QAdamOptimizer from configure_optimizers "
                "(from bagua_lightning.strategy import QAdamOptimizer)."
            )
        return optimizers[0]

    @classmethod
    def check_optimizer(cls, optimizer: object) -> None:
        if not isinstance(optimizer, QAdamOptimizer):
            raise QAdamOptimizerError(
                f"QAdamAlgorithm needs the model's QAdamOptimizer, got {type(optimizer).__name__}; build one with "
                "QAdamOptimizer(model.parameters(), ...) and pass it to with_bagua too"
            )

    def bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        opt = self.check_optimizers(optimizers)
        if self._module is None or self._comm is None or self._plan is None:
            raise RuntimeError("qadam: bind_optimizers called before setup")
        optimised = {id(p) for g in opt.param_groups for p in g["params"]}
        if optimised - {id(p) for p in self._module.parameters()}:
            raise ConfigurationError(
                "qadam: the QAdamOptimizer optimises parameters that are not parameters of the "
                "model; build it from model.parameters()"
            )
        named = [(n, p) for n, p in trainable_parameters(self._module) if id(p) in optimised]
        # Parameters that are not communicated (experts, ignored names) keep an ordinary local Adam.
        opt.local_momentum = optimised - {id(p) for _, p in named}
        keep = {n for n, _ in named}
        from ...proto.plan import BucketPlan as _Plan

        buckets = tuple(b for b in (tuple(t for t in bucket if t.name in keep) for bucket in self._plan.buckets) if b)
        momentum_plan = _Plan(buckets=buckets, bucket_size=self._plan.bucket_size,
                              is_hierarchical_reduce=self._plan.is_hierarchical_reduce, version=self._plan.version)
        if self._momentum_engine is not None:
            self._momentum_engine.close()
        self._momentum_engine = BucketEngine(
            named, momentum_plan, reducer=_MomentumReducer(self), bind_grads=False,
            pad_multiple=self._comm.world_size,
        )
        self._optimizer = opt
        opt.momentum_is_external = True
        if self.flatten:  # flatten=False (do_flatten=False): exp_avg stays where the optimizer keeps it
            self._repoint_all()

    def _repoint_all(self) -> None:
        assert self._momentum_engine is not None and self._optimizer is not None
        engine = self._momentum_engine
        for b in engine.buckets:
            for p, v in zip(b.params, b.views, strict=True):
                self._repoint(p, v)

    def _repoint(self, p: torch.Tensor, view: torch.Tensor) -> None:
        assert self._optimizer is not None
        state = self._optimizer.state[p]
        current = state.get("exp_avg")
        if current is not view:
            if current is not None:
                view.copy_(current)
            state["exp_avg"] = view

    # ------------------------------------------------------------------ communication

    def allreduce_step(self, bucket: Bucket) -> BucketStep:
        """Warm-up: the gradient bucket's full-precision allreduce (gradient_allreduce's step)."""
        engine = self._set_up(self._grad_engine)
        return allreduce_step(bucket, self._set_up(self._comm), hierarchical=engine.plan.is_hierarchical_reduce,
                              average=True)

    def compressed_step(self, bucket: Bucket) -> BucketStep:
        """After warm-up: the momentum bucket's compressed exchange."""
        comm, engine = self._set_up(self._comm), self._set_up(self._momentum_engine)
        buffers = self._exchange_buffers.setdefault(bucket.index, ExchangeBuffers())  # reused every step
        compressed_all_reduce_(bucket.flat, comm, average=True, hierarchical=engine.plan.is_hierarchical_reduce,
                               buffers=buffers)
        if not self.flatten and self._optimizer is not None:  # the exchanged momentum back where it lives
            state = self._optimizer.state
            with torch.no_grad():
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    state[p]["exp_avg"].copy_(view)
        yield from ()

    # ------------------------------------------------------------------ hooks

    def _engine(self) -> BucketEngine:
        engine = self._momentum_engine if self._compressed_phase else self._grad_engine
        if engine is None:
            raise RuntimeError("qadam is not set up (setup and bind_optimizers must run first)")
        return engine

    def on_forward_start(self, step: int) -> None:
        if self._grad_engine is not None and self._grad_engine.wants_ready_order_plan:
            self._grad_engine.adopt_ready_order(self._comm.group if self._comm else None)
            self._plan = self._grad_engine.plan
            if self._optimizer is not None:  # the momentum buckets follow the same order
                self.bind_optimizers([self._optimizer])
        if self._grad_engine is not None and (self._optimizer is None or self._optimizer.in_warmup):
            self._grad_engine.attach_grads()

    def on_backward_start(self, step: int) -> None:
        if self._optimizer is None:
            raise QAdamOptimizerError(f"{QADAM_OPTIMIZER_ERROR}, but none was bound to the algorithm")
        # Decided once per backward from the optimizer's step count, which every rank shares.
        self._compressed_phase = not self._optimizer.in_warmup
        self._engine().begin()

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._compressed_phase:
            self._engine().mark_ready(param)
            return
        engine, opt = self._momentum_engine, self._optimizer
        assert engine is not None and opt is not None
        view = engine.view(param)
        if self.flatten:
            self._repoint(param, view)
            momentum = view
        else:  # the user's layout stays (a fused optimizer steps it): the bucket exchanges a copy
            momentum = opt.state[param]["exp_avg"]
        group = opt.group_of(param) if len(opt.param_groups) > 1 else opt.param_groups[0]
        beta1 = group["betas"][0]
        grad = param.grad
        with torch.no_grad():
            if grad is not None:
                if group["weight_decay"] != 0:
                    grad = grad.add(param, alpha=group["weight_decay"])
                momentum.mul_(beta1).add_(grad, alpha=1 - beta1)
            if momentum is not view:
                view.copy_(momentum)
        engine.mark_ready(param)

    def on_backward_end(self, step: int) -> None:
        self._engine().finish()

    def apply_plan(self, plan: BucketPlan) -> None:
        assert self._grad_engine is not None
        self._plan = plan
        self._grad_engine.rebuild(plan)
        if self._optimizer is not None:
            self.bind_optimizers([self._optimizer])

    @property
    def plan(self) -> BucketPlan | None:
        return self._grad_engine.plan if self._grad_engine else None

    def last_step_timings(self) -> StepTimings | None:
        engine = self._momentum_engine if self._compressed_phase else self._grad_engine
        return engine.last_step_timings() if engine else None

    def teardown(self) -> None:
        for engine in (self._grad_engine, self._momentum_engine):
            if engine is not None:
                engine.close()
        self._grad_engine = self._momentum_engine = None
        self._comm = None
        self._exchange_buffers.clear()
        if self._optimizer is not None:
            self._optimizer.momentum_is_external = False
        self._optimizer = None


class _GradientReducer:
    """The gradient engine's reducer during warm-up (one collective unless hierarchical)."""

    def __init__(self, algorithm: QAdamAlgorithm) -> None:
        self.algorithm = algorithm

    def bucket_step(self, bucket: Bucket) -> BucketStep:
        return self.algorithm.allreduce_step(bucket)

    def one_collective(self) -> bool:
        engine = self.algorithm._grad_engine
        return engine is not None and not engine.plan.is_hierarchical_reduce


class _MomentumReducer:
    """The momentum engine's reducer after warm-up: the compressed exchange, waited on in the step."""

    def __init__(self, algorithm: QAdamAlgorithm) -> None:
        self.algorithm = algorithm

    def bucket_step(self, bucket: Bucket) -> BucketStep:
        return self.algorithm.compressed_step(bucket)

    def one_collective(self) -> bool:
        return False
