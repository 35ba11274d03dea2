"""``BaguaDistributedDataParallel``: the module wrapper that drives an :class:`Algorithm`'s hooks.

It works with or without Lightning (``BaguaStrategy`` installs it; a plain training
loop can use it directly, as Bagua's ``with_bagua`` did):

* construction broadcasts parameters and buffers from rank 0, builds the initial
  bucket plan and calls ``algorithm.setup``;
* one ``register_post_accumulate_grad_hook`` per trainable parameter calls
  ``on_grad_ready``; the first hook of a backward (or a hook on the forward's output,
  which fires earlier) calls ``on_backward_start`` and queues ``on_backward_end`` on
  autograd's engine, as DDP does, so communication is finished before ``backward()``
  returns;
* a step post-hook on each optimizer calls ``on_optimizer_step_end`` and counts steps;
* :meth:`no_sync` skips communication for gradient accumulation (the backward of a
  forward run inside it accumulates locally).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from bagua_lightning.proto.plan import DEFAULT_BUCKET_SIZE, BucketPlan, StepTimings
from bagua_lightning.strategy.algorithms.base import Algorithm
from bagua_lightning.strategy.buckets import check_plan, default_plan, trainable_parameters
from bagua_lightning.strategy.comm import CommContext


def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup | None = None, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (one broadcast per dtype/device)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    tensors = [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class BaguaDistributedDataParallel(nn.Module):
    """Wraps ``module`` so that ``algorithm`` communicates during its training steps.

    Args:
        module: the model (already on its device).
        algorithm: an :class:`Algorithm` instance (not set up yet).
        comm: process groups (:meth:`CommContext.build`).
        flatten: buckets as flat buffers with gradients as views.
        bucket_size: bytes per bucket of the default plan.
        plan: initial bucket plan; None builds the default one.
        optimizers: optimizers to hook now (or later with :meth:`attach_optimizers`).
        broadcast_state: copy rank 0's parameters and buffers to every rank first.
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
        self.algorithm = algorithm
        self.comm = comm
        self.step = 0
        self._sync = True
        self._sync_this_backward = True
        self._in_backward = False
        self._hooks: list[Any] = []
        self._step_hooks: list[Any] = []
        if broadcast_state:
            broadcast_module_state(module, comm.group, src=dist.get_global_rank(comm.group, 0)
                                   if comm.group is not None else 0)
        named = trainable_parameters(module)
        algorithm.plan_is_default = plan is None  # a given plan is kept; the default one is re-cut in ready order
        if plan is None:
            plan = default_plan(named, bucket_size=bucket_size,
                                hierarchical=bool(getattr(algorithm, "hierarchical", False)))
        else:
            check_plan(plan, named)
        algorithm.flatten = flatten
        algorithm.setup(module, comm, plan)
        for _, p in named:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        if optimizers:
            self.attach_optimizers(optimizers)

    # ------------------------------------------------------------------ forward / backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        communicating = torch.is_grad_enabled() and self.module.training and self._sync
        self._sync_this_backward = communicating
        if communicating:
            self.algorithm.on_forward_start(self.step)
        out = self.module(*args, **kwargs)
        if communicating:
            # The gradient of the output is the first thing backward computes: mark the start there.
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._on_output_grad)
        return out

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._sync_this_backward:
            self._begin_backward()

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.algorithm.on_backward_start(self.step)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_this_backward:
            return
        if not self._in_backward:
            self._begin_backward()
        self.algorithm.on_grad_ready(param)  # type: ignore[arg-type]

    def _end_backward(self) -> None:
        self._in_backward = False
        self.algorithm.on_backward_end(self.step)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients locally, without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ------------------------------------------------------------------ optimizers and plans

    def attach_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Hook ``optimizers``' ``step`` and hand them to the algorithm (replaces earlier ones)."""
        for h in self._step_hooks:
            h.remove()
        self._step_hooks = [opt.register_step_post_hook(self._after_optimizer_step) for opt in optimizers]
        self.algorithm.bind_optimizers(list(optimizers))

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.algorithm.on_optimizer_step_end(self.step)
        self.step += 1

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """The plan in use (None for algorithms that do not bucket gradients)."""
        return getattr(self.algorithm, "plan", None) if self.algorithm.uses_gradient_buckets else None

    def apply_plan(self, plan: BucketPlan) -> None:
        """Re-bucket with ``plan``; call between steps, at the same step on every rank."""
        if self._in_backward:
            raise RuntimeError("apply_plan was called during backward; call it between training steps")
        check_plan(plan, trainable_parameters(self.module))
        self.algorithm.apply_plan(plan)

    def last_step_timings(self) -> StepTimings | None:
        """Per-bucket timings of the latest communicating step whose timings are available."""
        return self.algorithm.last_step_timings()

    def teardown(self) -> None:
        """Remove every hook and tear the algorithm down; idempotent."""
        for h in self._hooks + self._step_hooks:
            h.remove()
        self._hooks, self._step_hooks = [], []
        self.algorithm.teardown()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        # Checkpoints hold the bare module's keys (as DDP's ``module.`` prefix would break them).
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.module.load_state_dict(*args, **kwargs)
