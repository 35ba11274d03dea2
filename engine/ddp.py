"""Driving an :class:`Algorithm`'s hooks from a module's training steps.

:class:`AlgorithmDriver` is the one place that turns forward, backward and
``optimizer.step()`` into the algorithm's hooks; two front doors use it:
:class:`BaguaDistributedDataParallel` (the module wrapper ``BaguaStrategy`` installs)
and ``bagua_lightning.torch_api``'s ``with_bagua`` (which hooks the module itself).

* construction broadcasts parameters, buffers and (with ``optimizers``) optimizer
  state from the group's first rank, builds the initial bucket plan and calls
  ``algorithm.setup``;
* one ``register_post_accumulate_grad_hook`` per communicated parameter calls
  ``on_grad_ready``; the first hook of a backward (or a hook on the forward's output,
  which fires earlier) calls ``on_backward_start`` and queues ``on_backward_end`` on
  autograd's engine, as DDP does, so communication is finished before ``backward()``
  returns;
* a step post-hook on each optimizer calls ``on_optimizer_step_end`` and counts steps;
* :meth:`AlgorithmDriver.no_sync` skips communication for gradient accumulation;
* :meth:`AlgorithmDriver.apply_plan` re-buckets between two steps (``wrapper.driver.apply_plan`` for a
  :class:`BaguaDistributedDataParallel`, which keeps no forwarding copy); the plan is checked against the
  model once, where the buckets are built from it;
* :meth:`BaguaDistributedDataParallel.switch_algorithm` hands the module to another algorithm between
  two steps (``algorithm="auto"`` measures its candidates so), averaging the replicas first when the
  previous algorithm let them drift apart.

Parameters marked ``param.expert = True`` and names in the module's
``_bagua_params_and_buffers_to_ignore`` are neither broadcast nor communicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from ..core.errors import ConfigurationError
from ..proto.plan import DEFAULT_BUCKET_SIZE, BucketPlan, StepTimings
from . import peer_watch
from .algorithms.base import Algorithm
from .comm import CommContext
from .parameters import (
    IGNORE_ATTRIBUTE,
    average_module_parameters,
    default_plan,
    is_communicated,
    trainable_parameters,
)


def _broadcast_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, src: int) -> None:
    """Broadcast ``tensors`` from global rank ``src`` in place, one flat broadcast per dtype and device."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in kinds.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup | None = None, src: int = 0) -> None:
    """Make every rank's communicated parameters and buffers equal to global rank ``src``'s."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    ignore = set(getattr(module, IGNORE_ATTRIBUTE, None) or ())
    tensors = [t for name, t in module.state_dict(keep_vars=True).items()
               if isinstance(t, torch.Tensor) and is_communicated(name, t, ignore)]
    if tensors:
        _broadcast_tensors(tensors, group, src)


def broadcast_optimizer_state(
    optimizers: Sequence[torch.optim.Optimizer],
    module: nn.Module,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> None:
    """Make every rank's optimizer state (momentum, step counts, ...) equal to global rank ``src``'s.

    Only the state of communicated parameters is broadcast (expert parameters keep their
    own). The layout (which parameters have which state entries) travels as plain data
    (names, shapes, dtypes and Python scalars); the tensors as broadcasts. A rank whose
    state lacks an entry (an optimizer that creates it lazily, before its first step)
    gets it allocated.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not optimizers:
        return
    ignore = set(getattr(module, IGNORE_ATTRIBUTE, None) or ())
    shared = {id(p) for n, p in module.named_parameters() if is_communicated(n, p, ignore)}
    me = dist.get_rank()
    layout: list[Any] = []
    if me == src:
        for opt in optimizers:
            entries: list[tuple[int, int, str, str, Any, str]] = []
            for gi, g in enumerate(opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if id(p) not in shared:
                        continue
                    for key, value in sorted(opt.state.get(p, {}).items()):
                        if isinstance(value, torch.Tensor):
                            entries.append((gi, pi, key, "tensor", tuple(value.shape), str(value.dtype)))
                        elif isinstance(value, int | float | bool) or value is None:
                            entries.append((gi, pi, key, "value", value, ""))
            layout.append(entries)
    holder: list[Any] = [layout]
    dist.broadcast_object_list(holder, src=src, group=group)
    layout = holder[0]
    if len(layout) != len(optimizers):
        raise ConfigurationError(
            f"rank {src} passed {len(layout)} optimizer(s) and rank {me} passed {len(optimizers)}; "
            "every rank must wrap the model with the same optimizers"
        )
    tensors: list[torch.Tensor] = []
    for opt, entries in zip(optimizers, layout, strict=True):
        for gi, pi, key, kind, value, dtype in entries:
            p = opt.param_groups[gi]["params"][pi]
            state = opt.state[p]
            if kind == "value":
                state[key] = value
                continue
            current = state.get(key)
            want_dtype = getattr(torch, dtype.removeprefix("torch."))
            if not isinstance(current, torch.Tensor) or tuple(current.shape) != value or current.dtype != want_dtype:
                device = p.device if len(value) > 0 else torch.device("cpu")
                state[key] = current = torch.zeros(value, dtype=want_dtype, device=device)
            tensors.append(current)
    if tensors:
        _broadcast_tensors(tensors, group, src)


class AlgorithmDriver:
    """Calls ``algorithm``'s hooks from ``module``'s forward, backward and optimizer steps.

    Args:
        module: the model (already on its device).
        algorithm: an engine :class:`Algorithm` instance, not set up yet and used by no other module.
        comm: process groups (:meth:`CommContext.build`).
        flatten: buckets as flat buffers with gradients as views.
        bucket_size: bytes per bucket of the default plan.
        plan: initial bucket plan; None builds the default one.
        optimizers: optimizers to hook now (or later with :meth:`attach_optimizers`).
        broadcast_state: copy the first rank's parameters and buffers (and the state of
            ``optimizers``) to every rank first.
    """

    def __init__(
        self,
        module: nn.Module,
        algorithm: Algorithm,
        comm: CommContext,
        *,
        flatten: bool = True,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        plan: BucketPlan | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        broadcast_state: bool = True,
    ) -> None:
        if getattr(algorithm, "_driven", False):
            raise ConfigurationError(
                f"this {type(algorithm).__name__} instance already drives another module; an engine "
                "algorithm holds one model's state: create one instance per model (bagua_lightning.torch_api's "
                "Algorithm objects may be shared, they reify one implementation per model)"
            )
        self.module = module
        self.algorithm = algorithm
        self.comm = comm
        self.flatten = flatten
        self.bucket_size = bucket_size
        self.optimizers: list[torch.optim.Optimizer] = []
        self.step = 0
        self._sync = True
        self._sync_this_backward = True
        self._in_backward = False
        self._hooks: list[Any] = []
        self._step_hooks: list[Any] = []
        self._closed = False
        if broadcast_state:
            src = comm.global_rank(0)
            broadcast_module_state(module, comm.group, src=src)
            broadcast_optimizer_state(optimizers, module, comm.group, src=src)
        named = trainable_parameters(module)
        algorithm.plan_is_default = plan is None  # a given plan is kept; the default one is re-cut in ready order
        if plan is None:
            plan = default_plan(named, bucket_size=bucket_size,
                                hierarchical=bool(getattr(algorithm, "hierarchical", False)))
        # A given plan is checked against the model once, where buckets are built from it (gradient buckets:
        # engine/buckets.py; weight buckets: engine/algorithms/weights.py), not here as well.
        algorithm.flatten = flatten
        self.initial_plan = plan
        algorithm._hand_over = self._take_over
        algorithm.setup(module, comm, plan)
        algorithm._driven = True
        for _, p in named:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        if optimizers:
            self.attach_optimizers(optimizers)

    # ------------------------------------------------------------------ forward / backward

    def before_forward(self) -> bool:
        """Call before the module's forward; returns whether this forward's backward communicates."""
        communicating = torch.is_grad_enabled() and self.module.training and self._sync
        self._sync_this_backward = communicating
        if communicating:
            try:
                self.algorithm.on_forward_start(self.step)
            except RuntimeError as exc:  # a peer failed: say which (the backend's error does not)
                peer_watch.raise_named(exc)
        return communicating

    def after_forward(self, out: Any) -> None:
        """Call with the forward's output: the first gradient backward computes marks the start."""
        if not self._sync_this_backward:
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # (an output of a forward that ran before teardown may still be backpropagated)
        if self._sync_this_backward and not self._closed:
            self._begin_backward()

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.algorithm.on_backward_start(self.step)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_this_backward or self._closed:
            return
        try:
            if not self._in_backward:
                self._begin_backward()
            self.algorithm.on_grad_ready(param)  # type: ignore[arg-type]
        except RuntimeError as exc:
            peer_watch.raise_named(exc)

    def _end_backward(self) -> None:
        self._in_backward = False
        try:
            self.algorithm.on_backward_end(self.step)
        except RuntimeError as exc:
            peer_watch.raise_named(exc)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients locally, without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _take_over(self, algorithm: Algorithm) -> None:
        """Drive ``algorithm`` (set up on this module by the algorithm driven now) directly from now on.

        ``auto`` hands its choice over so: its hooks then run as if the user had picked it, with nothing of
        ``auto`` left between the driver and the chosen algorithm."""
        self.algorithm._hand_over = None
        algorithm._driven = True
        self.algorithm = algorithm

    # ------------------------------------------------------------------ optimizers and plans

    def attach_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Hook ``optimizers``' ``step`` and hand them to the algorithm (replaces earlier ones)."""
        for h in self._step_hooks:
            h.remove()
        self._step_hooks = [opt.register_step_post_hook(self._after_optimizer_step) for opt in optimizers]
        self.optimizers = list(optimizers)
        self.algorithm.bind_optimizers(self.optimizers)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            self.algorithm.on_optimizer_step(optimizer, self.step)
        except RuntimeError as exc:
            peer_watch.raise_named(exc)
        self.step += 1

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """The plan in use (None for algorithms that do not bucket gradients)."""
        return getattr(self.algorithm, "plan", None) if self.algorithm.uses_gradient_buckets else None

    def apply_plan(self, plan: BucketPlan) -> None:
        """Re-bucket with ``plan``; call between steps, at the same step on every rank.

        Raises:
            PlanMismatchError: ``plan`` does not cover exactly the model's trainable parameters (checked where
                the buckets are built from it).
        """
        if self._in_backward:
            raise RuntimeError("apply_plan was called during backward; call it between training steps")
        self.algorithm.apply_plan(plan)

    def last_step_timings(self) -> StepTimings | None:
        """Per-bucket timings of the latest communicating step whose timings are available."""
        return self.algorithm.last_step_timings()

    def teardown(self) -> None:
        """Remove every hook and tear the algorithm down; idempotent."""
        for h in self._hooks + self._step_hooks:
            h.remove()
        self._hooks, self._step_hooks = [], []
        if not self._closed:
            self._closed = True
            self.algorithm._hand_over = None
            self.algorithm.teardown()
            self.algorithm._driven = False


class BaguaDistributedDataParallel(nn.Module):
    """Wraps ``module`` so that ``algorithm`` communicates during its training steps.

    Args: as :class:`AlgorithmDriver`.
    """

    def __init__(
        self,
        module: nn.Module,
        algorithm: Algorithm,
        comm: CommContext,
        *,
        flatten: bool = True,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        plan: BucketPlan | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        broadcast_state: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.driver = AlgorithmDriver(module, algorithm, comm, flatten=flatten, bucket_size=bucket_size, plan=plan,
                                      optimizers=optimizers, broadcast_state=broadcast_state)

    @property
    def algorithm(self) -> Algorithm:
        return self.driver.algorithm

    @property
    def comm(self) -> CommContext:
        return self.driver.comm

    @property
    def step(self) -> int:
        """Optimizer steps taken since wrapping."""
        return self.driver.step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.driver.before_forward()
        out = self.module(*args, **kwargs)
        self.driver.after_forward(out)
        return out

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes of forwards run inside accumulate gradients locally, without communicating."""
        return self.driver.no_sync()

    def attach_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Hook ``optimizers``' ``step`` and hand them to the algorithm (replaces earlier ones)."""
        self.driver.attach_optimizers(optimizers)

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """The plan in use (None for algorithms that do not bucket gradients)."""
        return self.driver.bucket_plan

    def last_step_timings(self) -> StepTimings | None:
        """Per-bucket timings of the latest communicating step whose timings are available."""
        return self.driver.last_step_timings()

    def teardown(self) -> None:
        """Remove every hook and tear the algorithm down; idempotent."""
        self.driver.teardown()

    def switch_algorithm(self, algorithm: Algorithm, plan: BucketPlan | None = None) -> None:
        """Drive the module with ``algorithm`` from the next step on.

        Call between two training steps, at the same step on every rank, with the same kind of algorithm
        on every rank. The previous algorithm is torn down first (its threads stopped, its buffers
        released); when it let the replicas drift apart (decentralized, async), the parameters are
        averaged over the group, so the next algorithm starts from identical replicas. Optimizers, the step
        count and the module's state carry over; nothing is broadcast.

        Args:
            algorithm: a fresh engine algorithm instance.
            plan: its bucket plan; None: the plan in use when both algorithms bucket gradients, else the
                default plan.
        """
        old = self.driver
        if old._in_backward:
            raise RuntimeError("switch_algorithm was called during backward; call it between training steps")
        if plan is None and algorithm.uses_gradient_buckets and old.algorithm.uses_gradient_buckets:
            plan = old.bucket_plan if not old.algorithm.plan_is_default else None
        drifted = not old.algorithm.keeps_replicas_identical
        old.teardown()
        if drifted:
            average_module_parameters(self.module, old.comm)
        self.driver = AlgorithmDriver(self.module, algorithm, old.comm, flatten=old.flatten,
                                      bucket_size=old.bucket_size, plan=plan, optimizers=old.optimizers,
                                      broadcast_state=False)
        self.driver.step = old.step

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        # Checkpoints hold the bare module's keys (as DDP's ``module.`` prefix would break them).
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)

