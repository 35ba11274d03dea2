"""Asynchronous model averaging (Bagua's ``async``).

For the first ``warmup_steps`` optimizer steps gradients are allreduced
(synchronous data parallel, with :class:`GradientAllReduceAlgorithm`'s buckets).
After that, training never waits for the network: a background thread averages
the weights with every rank every ``sync_interval_ms`` milliseconds, on a process
group of its own, while each rank trains at its own pace. One averaging round::

    vote    allreduce(MIN) of a "continue" flag on the async group; stop if any rank votes 0
    lock    snapshot s = copy of the weights
    unlock  a = allreduce(s) / world_size           (training continues meanwhile)
    lock    weights += a - s                         (keeps the local progress made during the allreduce)

The weights lock is held by training from ``on_forward_start`` until
``on_optimizer_step_end``, so a round never lands inside forward/backward or the
optimizer step, and the thread never holds it during a collective (no deadlock
with collectives the training thread makes). With gradient accumulation the wrapper
calls ``on_forward_start`` only for the micro-batch that ends the accumulation, so a
round may land between earlier micro-batches (their gradients then belong to
slightly different weights, as with any asynchronous update). On CUDA the thread
works on its own stream and synchronises with the training stream under the lock.

NCCL: the async group is a *Gloo* group and rounds average a host copy of the
weights. Two NCCL communicators driven concurrently from two threads (training's
collectives and the averaging rounds) are not ordered with each other, and on the
NCCL machine this hung jobs (an averaging round and a collective of the training
thread each waiting for the other rank); Gloo rounds run on the host and cannot
block the GPU's collectives. The cost is a device-host copy per round, off the
training stream.

Stopping: every round starts with the vote, so all threads run the same sequence
of collectives. A rank that stops (:meth:`abort`, :meth:`teardown`) votes 0 in the
next round and every thread leaves the loop after that same vote: ranks may have
run different numbers of training steps, but no rank is left inside a collective.
``abort()`` and ``resume()`` must be called on every rank (like any collective);
``teardown()`` waits for the thread with a timeout.

Parameters differ between ranks (``keeps_replicas_identical = False``).
Checkpoints: Lightning writes global rank 0's weights; resuming loads them on every
rank (the algorithm keeps no other state). The module wrapper counts steps from the
start of each fit, so a resumed fit runs its ``warmup_steps`` of synchronous
allreduce again before averaging restarts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError
from .base import Algorithm, register_algorithm
from .gradient_allreduce import GradientAllReduceAlgorithm
from .weights import WeightBuckets

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...proto.plan import BucketPlan
    from ..comm import CommContext

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0  # seconds teardown/abort wait for the averaging thread to leave its loop


@register_algorithm(
    name="async",
    description="weights averaged by a background thread, training never waits",
    bagua_name="AsyncModelAverageAlgorithm",
    module_methods=("abort", "resume"),
)
class AsyncModelAverageAlgorithm(Algorithm):
    """Gradient allreduce during warm-up, then background weight averaging every ``sync_interval_ms``.

    Args:
        peer_selection_mode: only ``"all"`` (average with every rank), as in Bagua.
        sync_interval_ms: milliseconds between the start of two averaging rounds (> 0).
        warmup_steps: optimizer steps of synchronous gradient allreduce before
            averaging starts (>= 0; 0 disables warm-up).
    """

    keeps_replicas_identical: ClassVar[bool] = False
    fault_tolerance_refusal: ClassVar[str | None] = (
        "it averages weights in a background thread, between the step boundaries at which the nodes agree on "
        "a quorum and commit: an average in flight when a node is lost cannot be undone or redone; use "
        "decentralized (weights averaged across the nodes each step, applied on commit) or gradient_allreduce"
    )

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0) -> None:
        if peer_selection_mode != "all":
            raise ConfigurationError(
                f'async supports peer_selection_mode="all" only, got {peer_selection_mode!r}'
            )
        if isinstance(sync_interval_ms, bool) or not isinstance(sync_interval_ms, int | float) or sync_interval_ms <= 0:
            raise ConfigurationError(
                f"sync_interval_ms must be a number of milliseconds > 0, got {sync_interval_ms!r}"
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigurationError(
                f"warmup_steps must be an int >= 0 (0 disables warm-up), got {warmup_steps!r}"
            )
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        self._buckets: WeightBuckets | None = None
        self._warmup: GradientAllReduceAlgorithm | None = None
        self._warmup_step = False
        self._comm: CommContext | None = None
        self._group: dist.ProcessGroup | None = None
        self._lock = threading.Lock()
        self._lock_held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._aborted = False
        self._started = False
        self._rounds = 0

    # --- life cycle ------------------------------------------------------------------------------

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        self._module = module
        self._comm = comm
        self._buckets = WeightBuckets(module, plan)
        self._warmup = None
        if self.warmup_steps > 0 and comm.world_size > 1:
            self._warmup = GradientAllReduceAlgorithm(hierarchical=False, average=True)
            self._warmup.flatten = self.flatten
            self._warmup.setup(module, comm, plan)
        # Created by every member here, in the same order, kept with the context. Gloo on every backend
        # (see the module docstring: concurrent NCCL communicators from two threads can deadlock).
        self._group = comm.side_context("async", backend="gloo").group if comm.world_size > 1 else None
        self._aborted = False
        self._started = False
        self._error = None
        self._rounds = 0

    def teardown(self) -> None:
        self._end_warmup()
        self._stop_thread()
        self._release_lock()
        if self._thread is None or not self._thread.is_alive():
            self._group = None  # the context keeps the group (see CommContext.side_context)
        self._buckets = None

    def abort(self, module: nn.Module | None = None) -> None:
        """Stop background averaging (call on every rank). ``module`` is accepted for Bagua compatibility."""
        self._aborted = True
        self._stop_thread()

    def resume(self, module: nn.Module | None = None) -> None:
        """Restart background averaging stopped by :meth:`abort` (call on every rank)."""
        self._aborted = False
        self._stop_thread()  # a thread the other ranks' vote ended must be joined before a new one starts
        if self._started:
            self._start_thread()

    @property
    def is_averaging(self) -> bool:
        """True while the background averaging thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def averaging_rounds(self) -> int:
        """Number of completed averaging rounds since setup (rounds run on every rank alike)."""
        return self._rounds

    # --- hooks -----------------------------------------------------------------------------------

    def on_forward_start(self, step: int) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"asynchronous model averaging failed: {error}") from error
        if step >= self.warmup_steps and not self._started and not self._aborted:
            self._started = True
            self._start_thread()
        if not self._lock_held:
            self._lock.acquire()
            self._lock_held = True
        self._warmup_step = self._warmup is not None and step < self.warmup_steps
        if self._warmup is not None and self._warmup_step:
            self._warmup.on_forward_start(step)

    def on_backward_start(self, step: int) -> None:
        self._warmup_step = self._warmup is not None and step < self.warmup_steps
        if self._warmup is not None and self._warmup_step:
            self._warmup.on_backward_start(step)

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self._warmup is not None and self._warmup_step:
            self._warmup.on_grad_ready(param)

    def on_backward_end(self, step: int) -> None:
        if self._warmup is not None and step < self.warmup_steps:
            self._warmup.on_backward_end(step)

    def on_optimizer_step_end(self, step: int) -> None:
        self._release_lock()
        if step + 1 >= self.warmup_steps:
            self._end_warmup()

    def apply_plan(self, plan: BucketPlan) -> None:
        if self._warmup is not None:
            self._warmup.apply_plan(plan)
        # The thread reads the buckets under the lock; swap them under it too.
        with self._lock_guard():
            self._buckets = WeightBuckets(self._module, plan)

    def state_dict(self) -> dict[str, Any]:
        return {}

    # --- warm-up ---------------------------------------------------------------------------------

    def _end_warmup(self) -> None:
        """Release the warm-up allreduce machinery (its communication thread and buffers)."""
        warmup, self._warmup = self._warmup, None
        self._warmup_step = False
        if warmup is not None:
            warmup.teardown()

    # --- background thread -----------------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._require_comm().world_size == 1 or self.is_averaging:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bagua-async-model-average", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        # The thread may wait for the weights lock; let it through so it can reach the vote.
        held = self._lock_held
        self._release_lock()
        thread.join(timeout=STOP_TIMEOUT_S + self.sync_interval_ms / 1000)
        if thread.is_alive():
            log.warning(
                "the asynchronous averaging thread did not stop within %.0f s; another rank probably did "
                "not call abort()/resume()/teardown() alike",
                STOP_TIMEOUT_S,
            )
        else:
            self._thread = None
        if held:
            self._lock.acquire()
            self._lock_held = True

    def _run(self) -> None:
        device = self._require_buckets().device
        stream = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device=device)  # own stream: never queue behind the training kernels
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while True:
                    self._stop.wait(self.sync_interval_ms / 1000)
                    if not self._vote_continue(device):
                        return
                    self._average_once(stream)
        except BaseException as exc:  # surfaced to the training thread at the next forward
            log.error("asynchronous model averaging stopped: %s", exc)
            self._error = exc

    def _vote_continue(self, device: torch.device) -> bool:
        flag = torch.tensor([0 if self._stop.is_set() else 1], dtype=torch.int32)  # Gloo group: host tensor
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item() == 1)

    def _average_once(self, stream: torch.cuda.Stream | None) -> None:
        with self._lock:
            buckets = self._require_buckets()
            if stream is not None:
                stream.wait_stream(torch.cuda.default_stream(stream.device))
            snapshot = buckets.flatten()
            if stream is not None:
                stream.synchronize()  # the copy must finish before training may touch the weights again
        averaged = [s.to("cpu", copy=True) for s in snapshot]  # the async group is a Gloo group
        for a in averaged:
            dist.all_reduce(a, group=self._group)
        world_size = self._require_comm().world_size
        with self._lock:
            if stream is not None:
                # The optimizer step that released the lock may still be queued on the training stream.
                stream.wait_stream(torch.cuda.default_stream(stream.device))
            averaged = [a.to(s.device, non_blocking=False) for a, s in zip(averaged, snapshot, strict=True)]
            for a, s in zip(averaged, snapshot, strict=True):
                a.div_(world_size).sub_(s)
            buckets.add_in(averaged)
            if stream is not None:
                stream.synchronize()
        self._rounds += 1

    # --- helpers ---------------------------------------------------------------------------------

    def _release_lock(self) -> None:
        if self._lock_held:
            self._lock_held = False
            self._lock.release()

    def _lock_guard(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self._lock_held else self._lock

    def _require_comm(self) -> CommContext:
        return self._set_up(self._comm)

    def _require_buckets(self) -> WeightBuckets:
        return self._set_up(self._buckets)

