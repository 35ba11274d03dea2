"""Flat communication buckets built from a :class:`~bagua_lightning.proto.plan.BucketPlan`.

:class:`BucketEngine` is the machinery every gradient-bucket algorithm shares:

* one contiguous buffer per bucket (``flatten=True``): each parameter's gradient
  is re-pointed to a view of it, so the collective runs on the buffer with no copy
  (as DDP's ``gradient_as_bucket_view``). When ``zero_grad(set_to_none=True)`` left
  autograd a fresh gradient, the gradient hook copies it into its view once and
  re-points ``.grad``. :meth:`BucketEngine.close` hands each gradient back as a tensor of its own,
  so neither a teardown nor a switch to another algorithm leaves the module holding the old buffers;
* one shape of a bucket's communication, the *bucket step* (:data:`BucketStep`): a generator
  that issues the bucket's collectives and yields each asynchronous work it must see finished
  before it goes on. An algorithm is a :class:`BucketReducer`; the engine alone decides where a
  step runs and when it is resumed (the recipe is in docs/architecture.md, "Adding an algorithm");
* buckets are launched strictly in plan order as soon as they and every earlier
  bucket are complete, so collectives match on every rank whatever order autograd
  finishes gradients in;
* communication runs off the critical path: a step that is one asynchronous collective runs in
  autograd's thread and is waited at the end of backward (as DDP does); every other step runs
  on CUDA under a side stream (the host never waits), on CPU on one communication thread, where
  the next bucket's step starts before the previous one is resumed to its end;
* per-bucket timings (bytes, ready offset from backward start, communication time,
  exposed wait) from CUDA events read lazily, or ``time.monotonic`` on CPU;
* :meth:`BucketEngine.rebuild` applies a new plan between steps, keeping values.

Which parameters are communicated, and the default plan over them, are :mod:`.parameters`'.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..proto.plan import BucketPlan, StepTimings
from .parameters import (  # the names Bagua's torch_api imports from this module
    IGNORE_ATTRIBUTE,
    UNUSED_ATTRIBUTE,
    check_plan,
    default_plan,
    trainable_parameters,
)
from .runners import BucketTimer, CudaRunner, ThreadRunner

__all__ = ["IGNORE_ATTRIBUTE", "UNUSED_ATTRIBUTE", "Bucket", "BucketEngine", "BucketReducer", "BucketStep",
           "default_plan", "finish_step", "trainable_parameters"]

#: The one shape of a bucket's communication. A step reduces ``bucket.flat`` in place across ranks: it
#: issues its collectives in the same order on every rank and yields the work of each asynchronous one it
#: must see finished before going on (or None: a pause with nothing to wait for, e.g. between two stages
#: of a pipelined exchange). The engine waits a yielded work, then resumes the step; when the generator
#: returns, the bucket is reduced. A step that waits on its own collectives simply yields nothing.
BucketStep = Generator["dist.Work | None", None, None]


class BucketReducer(Protocol):
    """What a :class:`BucketEngine` communicates with: every gradient algorithm is one."""

    def bucket_step(self, bucket: Bucket) -> BucketStep:
        """The step that reduces ``bucket`` now (see :data:`BucketStep`)."""
        ...

    def one_collective(self) -> bool:
        """True when every step is one asynchronous collective, yielded at once and with nothing after it.

        The engine may then run steps in autograd's thread and wait their works at the end of backward.
        """
        ...


def finish_step(step: BucketStep, work: dist.Work | None) -> None:
    """Resume ``step`` (last yielded ``work``) to its end, waiting every work it yields."""
    while True:
        if work is not None:
            work.wait()  # NCCL: orders the current stream after it; Gloo: blocks until done
        try:
            work = next(step)
        except StopIteration:
            return


@dataclass(slots=True)
class Bucket:
    """One bucket: a flat buffer (padded to ``pad_multiple``) and a view of it per tensor.

    Attributes:
        index: position in the plan (launch order).
        names: tensor names, in buffer order.
        params: the parameters, in buffer order.
        flat: the contiguous buffer the collective runs on.
        views: one view of ``flat`` per parameter, shaped like it.
        numel: elements in use (``flat`` may be longer by padding, kept zero).
    """

    index: int
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    flat: torch.Tensor
    views: tuple[torch.Tensor, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()


def _make_bucket(index: int, names: Sequence[str], params: Sequence[nn.Parameter], pad_multiple: int) -> Bucket:
    numel = sum(p.numel() for p in params)
    padded = math.ceil(numel / pad_multiple) * pad_multiple
    first = params[0]
    flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return Bucket(index=index, names=tuple(names), params=tuple(params), flat=flat, views=tuple(views),
                  numel=numel)


class BucketEngine:
    """Flat buckets over a set of parameters, communicated in plan order as they become ready.

    Args:
        named_params: ``(name, parameter)`` pairs the plan refers to.
        plan: the bucket partition to build.
        reducer: makes each bucket's :data:`BucketStep` (asked for the bucket that is ready, in plan
            order). When ``reducer.one_collective()`` holds at the start of an unmeasured backward, the
            steps run in autograd's thread and their works are waited at the end of backward, with no
            thread or stream hop; otherwise they run under a side CUDA stream or on the communication
            thread, and a step still suspended when the next bucket starts is resumed to its end right
            after the next one's first stage (measured backwards resume each step to its end at once, so
            a bucket's communication time is its own).
        bind_grads: True: the buckets hold the parameters' gradients (``.grad`` becomes
            a view when ``flatten``). False: the caller owns what the views hold (e.g.
            optimizer state) and writes into :meth:`view` before :meth:`mark_ready`.
        flatten: gradients are views into the buffers (no copy). False: gradients stay
            separate tensors, copied into the buffer before and back after the collective.
        pad_multiple: buffer lengths are rounded up to a multiple of this (chunked collectives).
        timing_every: measure per-bucket timings on every n-th communicating backward
            (1: every one). Measured backwards always take the side-stream/thread path.
        plan_is_default: ``plan`` is the default cut, rebuilt in gradient-ready order after
            the first backward (:meth:`adopt_ready_order`); False keeps a chosen plan as given.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        plan: BucketPlan,
        *,
        reducer: BucketReducer,
        bind_grads: bool = True,
        flatten: bool = True,
        pad_multiple: int = 1,
        timing_every: int = 10,
        plan_is_default: bool = True,
    ) -> None:
        if not named_params:
            raise ValueError("BucketEngine needs at least one parameter")
        self.named_params = list(named_params)
        self.reducer = reducer
        if timing_every < 1:
            raise ValueError(f"timing_every must be >= 1 (backwards between measurements), got {timing_every}")
        self.timing_every = timing_every
        self._backwards = 0
        self._timed = True
        self._direct = False
        # Steps started but not finished, in plan order, with the work each last yielded. Touched by one
        # thread per backward: autograd's (direct) or the runner's.
        self._suspended: list[tuple[BucketStep, dist.Work | None]] = []
        self.bind_grads = bind_grads
        self.flatten = flatten or not bind_grads
        self.pad_multiple = max(1, pad_multiple)
        device = self.named_params[0][1].device
        self.device = device
        self._runner: CudaRunner | ThreadRunner = (
            CudaRunner(device) if device.type == "cuda" else ThreadRunner()
        )
        self._lock = threading.Lock()
        self.observed_order: list[str] = []
        self._observe = True
        self.plan_is_default = plan_is_default
        self._build(plan)

    # ---------------------------------------------------------------- building

    def _build(self, plan: BucketPlan) -> None:
        check_plan(plan, self.named_params)
        by_name = dict(self.named_params)
        self.plan = plan
        self.buckets = [
            _make_bucket(i, names, [by_name[n] for n in names], self.pad_multiple)
            for i, names in enumerate(plan.tensor_names)
        ]
        # id(param) -> (bucket index, position in bucket)
        self._slot = {
            id(p): (b.index, j) for b in self.buckets for j, p in enumerate(b.params)
        }
        self._sizes = [len(b.params) for b in self.buckets]
        self._nbytes = [b.nbytes for b in self.buckets]
        self._timer = BucketTimer(len(self.buckets), self.device)
        self._backwards = 0  # the first backward of a plan is measured
        self._active = False
        self._marked = [bytearray(n) for n in self._sizes]
        self._pending = list(self._sizes)
        self._next = 0
        self._any_ready = False
        if self.bind_grads and self.flatten:
            for b in self.buckets:
                for p, v in zip(b.params, b.views, strict=True):
                    if p.grad is not None:
                        v.copy_(p.grad)
                        p.grad = v

    def rebuild(self, plan: BucketPlan, *, is_default: bool = False) -> None:
        """Re-bucket with ``plan`` between steps; values held in the old buffers are kept."""
        if self._active:
            raise RuntimeError("cannot apply a bucket plan during backward; apply it between steps")
        old_views = {name: v for b in self.buckets for name, v in zip(b.names, b.views, strict=True)}
        self._runner.wait_all()
        self._build(plan)
        self.plan_is_default = is_default
        if not self.bind_grads:
            for b in self.buckets:
                for name, v in zip(b.names, b.views, strict=True):
                    v.copy_(old_views[name])

    def view(self, param: nn.Parameter) -> torch.Tensor:
        """The view of ``param``'s slot in its bucket buffer."""
        i, j = self._slot[id(param)]
        return self.buckets[i].views[j]

    def views_by_name(self) -> dict[str, torch.Tensor]:
        return {n: v for b in self.buckets for n, v in zip(b.names, b.views, strict=True)}

    # ---------------------------------------------------------------- per backward

    def begin(self) -> None:
        """Start of a communicating backward (idempotent within one backward)."""
        if self._active:
            return
        self._active = True
        self._any_ready = False
        for m in self._marked:
            m[:] = bytes(len(m))
        self._pending = list(self._sizes)
        self._next = 0
        self._timed = self._backwards % self.timing_every == 0
        self._backwards += 1
        self._direct = not self._timed and self.flatten and self.reducer.one_collective()
        if self._timed:
            self._timer.begin()

    def attach_grads(self) -> None:
        """Before a forward: point missing gradients (``zero_grad(set_to_none=True)``) at zeroed views.

        Autograd then accumulates straight into the buckets and :meth:`mark_ready` has
        nothing to copy (one fused zeroing instead of a copy per parameter).
        """
        if not (self.bind_grads and self.flatten) or self._active:
            return
        zero: list[torch.Tensor] = []
        for b in self.buckets:
            missing = [j for j, p in enumerate(b.params) if p.grad is None]
            if not missing:
                continue
            if len(missing) == len(b.params):
                zero.append(b.flat)
            else:
                zero.extend(b.views[j] for j in missing)
            for j in missing:
                b.params[j].grad = b.views[j]
        if zero:
            torch._foreach_zero_(zero)

    def mark_ready(self, param: nn.Parameter) -> None:
        """``param``'s tensor for this backward is final; launch every bucket that can go."""
        if not self._active:
            self.begin()
        slot = self._slot.get(id(param))
        if slot is None:
            return
        i, j = slot
        if self._marked[i][j]:
            return
        self._marked[i][j] = 1
        self._any_ready = True
        if self._observe:
            self.observed_order.append(self.buckets[i].names[j])
        if self.bind_grads and self.flatten:
            view = self.buckets[i].views[j]
            grad = param.grad
            if grad is not view:
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                param.grad = view
        self._pending[i] -= 1
        if self._pending[i] == 0:
            if self._timed:
                self._timer.ready(i)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            bucket = self.buckets[self._next]
            self._next += 1
            if self._direct:
                step = self.reducer.bucket_step(bucket)
                self._suspended.append((step, next(step, None)))
            else:
                self._runner.submit(self._job(bucket))

    def _step(self, bucket: Bucket, timed: bool) -> BucketStep:
        """The reducer's step for ``bucket``, with the engine's own work around it (timing, gathering)."""
        gather = self.bind_grads and not self.flatten
        if timed:
            self._timer.comm_start(bucket.index)
        if gather:
            for p, v in zip(bucket.params, bucket.views, strict=True):
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad)
        yield from self.reducer.bucket_step(bucket)
        if gather:
            for p, v in zip(bucket.params, bucket.views, strict=True):
                if p.grad is None:
                    p.grad = v.clone()
                else:
                    p.grad.copy_(v)
        if timed:
            self._timer.comm_end(bucket.index)

    def _job(self, bucket: Bucket) -> Callable[[], None]:
        timed = self._timed

        def run() -> None:
            step = self._step(bucket, timed)
            work = next(step, None)
            if timed:
                finish_step(step, work)
                return
            self._finish_suspended()  # the previous bucket's rest overlaps this one's first stage
            self._suspended.append((step, work))

        return run

    def _finish_suspended(self) -> None:
        suspended, self._suspended = self._suspended, []
        for step, work in suspended:
            finish_step(step, work)

    def finish(self) -> bool:
        """End of backward: launch what is left (unused parameters count as zero), wait for all.

        Returns False (and communicates nothing) when no tensor became ready in this
        backward, e.g. for ``torch.autograd.grad`` calls that accumulate no gradient.
        """
        if not self._active:
            return False
        self._active = False
        if self._observe and self._any_ready:
            self._observe = False
        if not self._any_ready:
            return False
        if self._timed:
            self._timer.backward_end()
        for b in self.buckets:
            if self._pending[b.index] == 0:
                continue
            for j, p in enumerate(b.params):
                if not self._marked[b.index][j]:
                    self._marked[b.index][j] = 1
                    if self.bind_grads and self.flatten:  # (caller-owned values stay as they are)
                        b.views[j].zero_() if p.grad is None else b.views[j].copy_(p.grad)
                        p.grad = b.views[j]
            self._pending[b.index] = 0
            if self._timed:
                self._timer.ready(b.index)
        self._launch_ready()
        try:
            if self._direct:
                self._finish_suspended()
            else:
                self._runner.submit(self._finish_suspended)
            self._runner.wait_all()
        finally:
            self._suspended = []  # after a failure: never resume a half-done step
        if self._timed:
            self._timer.finished(self._nbytes)
        return True

    # ---------------------------------------------------------------- plan from ready order

    @property
    def wants_ready_order_plan(self) -> bool:
        """True once the first communicating backward was observed and the plan is still the default."""
        return self.plan_is_default and not self._observe and bool(self.observed_order)

    def adopt_ready_order(self, group: dist.ProcessGroup | None = None) -> None:
        """Rebuild the default plan in rank 0's gradient-ready order (a collective: every rank calls it)."""
        order: list[object] = [self.observed_order]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.broadcast_object_list(order, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        names = [str(n) for n in order[0]]  # type: ignore[attr-defined]
        plan = default_plan(
            self.named_params,
            bucket_size=self.plan.bucket_size,
            hierarchical=self.plan.is_hierarchical_reduce,
            order=names,
        )
        self.observed_order = []
        if plan.same_layout(self.plan):
            self.plan_is_default = False  # nothing to change; stop asking
            return
        self.rebuild(plan, is_default=False)

    def last_step_timings(self) -> StepTimings | None:
        return self._timer.last()

    def close(self) -> None:
        """Stop the runner and hand the gradients back as the module had them: tensors of their own.

        Gradients bound to the buckets are views of the flat buffers; left so, they would keep
        every buffer alive and tie the module's gradients to a layout the next owner (another
        algorithm after a switch, or plain training) does not know. Values are kept.
        """
        self._runner.close()
        if not (self.bind_grads and self.flatten):
            return
        for b in self.buckets:
            storage = b.flat.untyped_storage().data_ptr()
            for p in b.params:
                grad = p.grad
                if grad is not None and grad.untyped_storage().data_ptr() == storage:
                    p.grad = grad.clone(memory_format=torch.contiguous_format)
