"""The trainer side of autotuning: service-planned buckets, re-planned in flight, identical on all ranks.

:class:`AutotuneController` is plain Python over ``torch.distributed``; it needs no
Lightning (``BaguaStrategy(autotune=True)`` drives it from its hooks, a hand-written
loop can call :meth:`AutotuneController.on_batch_start` itself). Protocol:

* **set-up** (a collective): every rank declares its trainable parameters (names,
  element counts, dtypes). Rank 0 registers them with the service under a model
  name stable across jobs (:func:`model_name_for`) and broadcasts the initial plan;
  every rank applies it. A second job of the same model thus starts from the best
  plan the service remembers. No service within ``connect_timeout_s``: the job trains
  on the strategy's default plan, with one warning, and rank 0 keeps trying to
  register in the background.
* **after the first step**: rank 0 reports the gradient-ready order it observed
  (``ReportTensorExecutionOrder``), so later plans cut buckets in that order.
* **every ``interval`` steps** (a step boundary: ``global_step % interval == 0``, the
  same on every rank): every rank queues its measurement of the interval (speed,
  per-bucket timings and backward time, means over the interval's steps) for a
  background thread to report; rank 0's thread then asks for hyperparameters. The
  answer is broadcast ``apply_delay`` steps later (default ``interval // 4``; 0: at the
  next boundary), where every rank applies it, and the next measurement starts there:
  a plan costs one interval. A slow or dead service never holds a step longer than
  that broadcast: an answer that is not there yet waits for the next apply point.
  After every broadcast one ``all_reduce`` compares (plan version, plan fingerprint, model
  fingerprint, apply failure) across ranks; any difference raises
  :class:`~bagua_lightning.errors.PlanMismatchError` on every rank instead of hanging.
* **faults**: RPCs have short deadlines and few retries; a failure leaves the current
  plan in place and warns once per outage. A service that lost the model (restarted
  without ``--state``) is registered again.

Speed is reported as **samples per second processed by the reporting rank** over
the interval (validation time excluded); a batch whose size cannot be found counts
as one sample. ``train_iter`` on the wire is ``iter_base + global_step``, where rank 0
picks ``iter_base`` (the job's start time in microseconds) so that a second job of
the same model, on a service still holding the first job's session, never replays
the first job's per-iteration decisions.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from bagua_lightning.errors import ConfigurationError, PlanMismatchError, ServiceUnavailableError
from bagua_lightning.proto.plan import (
    BucketPlan,
    BucketTimingRecord,
    StepTimings,
    TensorDeclaration,
    plan_from_proto,
    tensor_list_fingerprint,
)
from bagua_lightning.strategy.buckets import check_plan, declare, trainable_parameters

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 20  # steps between two step boundaries
DEFAULT_RPC_TIMEOUT_S = 1.0  # seconds: deadline of one RPC attempt
DEFAULT_CONNECT_TIMEOUT_S = 2.0  # seconds: how long set-up waits for the service
_HEADER = 6  # has_plan, registered, version, payload bytes, completed, iter_base


class PlanTarget(Protocol):
    """What the controller tunes (``BaguaDistributedDataParallel`` and ``BaguaStrategy`` qualify)."""

    @property
    def bucket_plan(self) -> BucketPlan | None: ...

    def apply_plan(self, plan: BucketPlan) -> None: ...

    def last_step_timings(self) -> StepTimings | None: ...


@dataclass(kw_only=True, slots=True)
class AutotuneSettings:
    """How a job talks to the autotune service.

    Attributes:
        address: ``host:port`` of the service (see
            :func:`bagua_lightning.services_file.resolve_autotune_address`).
        interval: steps between two step boundaries (report, ask, apply), >= 1.
        rpc_timeout_s: deadline of one RPC attempt, in seconds.
        rpc_retries: retries of an RPC that failed with UNAVAILABLE/DEADLINE_EXCEEDED.
        connect_timeout_s: how long set-up waits for the service before training on
            the default plan, in seconds.
        model_name: name under which the model is tuned; None: :func:`model_name_for`.
        apply_delay: steps after a boundary at which the service's answer to that
            boundary's report is broadcast and applied (0: at the next boundary, one
            interval later); None: ``interval // 4``. With a delay each plan is measured
            over the rest of the interval it was applied in, so a plan costs one interval
            instead of two; the service has ``apply_delay`` steps to answer (a later answer
            waits for the next apply point).
    """

    address: str
    interval: int = DEFAULT_INTERVAL
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
    rpc_retries: int = 1
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    model_name: str | None = None
    apply_delay: int | None = None

    @property
    def delay(self) -> int:
        """The effective :attr:`apply_delay`, in steps."""
        return self.interval // 4 if self.apply_delay is None else self.apply_delay

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or ":" not in self.address:
            raise ConfigurationError(
                f"autotune_service must be 'host:port', got {self.address!r}; or set "
                "BAGUA_LIGHTNING_AUTOTUNE_SERVICE")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ConfigurationError(f"autotune_interval must be a positive number of steps, got {self.interval!r}")
        for name in ("rpc_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.rpc_retries < 0:
            raise ConfigurationError(f"rpc_retries must be >= 0, got {self.rpc_retries}")
        if self.apply_delay is not None and (isinstance(self.apply_delay, bool) or not isinstance(
                self.apply_delay, int) or not 0 <= self.apply_delay < self.interval):
            raise ConfigurationError(
                f"apply_delay must be a whole number of steps in [0, autotune_interval={self.interval}), got "
                f"{self.apply_delay!r}; or None for interval // 4")


def model_name_for(prefix: str, tensors: Sequence[TensorDeclaration]) -> str:
    """``"{prefix}-{fingerprint}"``: the same for the same model (class name and tensor list) in every job."""
    return f"{prefix}-{tensor_list_fingerprint(tensors)}"


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of the first tensor in it (1 when it holds none)."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def _hash63(hex_digest: str) -> int:
    return int(hex_digest[:16], 16) >> 1  # fits int64 with room for negation


# ------------------------------------------------------------------ measuring one interval


@dataclass(slots=True)
class IntervalMeter:
    """Samples, busy time and per-step bucket timings between two step boundaries."""

    samples: int = 0
    started: float | None = None
    paused_at: float | None = None
    paused_s: float = 0.0
    steps: list[StepTimings] = field(default_factory=list)
    _last_key: tuple[float, ...] | None = None

    def count(self, samples: int, now: float) -> None:
        if self.started is None:
            self.started = now
        self.samples += samples

    def add_timings(self, timings: StepTimings | None, num_buckets: int) -> None:
        """Keep ``timings`` once (a step's timings can be read several times) when they fit the plan."""
        if timings is None or len(timings.buckets) != num_buckets:
            return
        key = (timings.backward_ms, *(b.comm_ms for b in timings.buckets), *(b.ready_ms for b in timings.buckets))
        if key != self._last_key:
            self._last_key = key
            self.steps.append(timings)

    def pause(self, now: float) -> None:
        if self.started is not None and self.paused_at is None:
            self.paused_at = now

    def resume(self, now: float) -> None:
        if self.paused_at is not None:
            self.paused_s += now - self.paused_at
            self.paused_at = None

    def close(self, now: float) -> tuple[float | None, list[BucketTimingRecord], float]:
        """(samples/s or None when nothing was measured, mean bucket timings, mean backward ms); resets."""
        self.resume(now)
        elapsed = 0.0 if self.started is None else now - self.started - self.paused_s
        speed = self.samples / elapsed if elapsed > 0 and self.samples > 0 else None
        timings: list[BucketTimingRecord] = []
        backward_ms = 0.0
        if self.steps:
            n = len(self.steps)
            backward_ms = sum(s.backward_ms for s in self.steps) / n
            for i in range(len(self.steps[0].buckets)):
                rows = [s.buckets[i] for s in self.steps]
                timings.append(BucketTimingRecord(
                    bucket_index=i, bytes=rows[0].bytes, ready_ms=sum(r.ready_ms for r in rows) / n,
                    comm_ms=sum(r.comm_ms for r in rows) / n, wait_ms=sum(r.wait_ms for r in rows) / n))
        # The next interval starts here (its first batch may begin after the boundary's collectives).
        self.samples, self.paused_at, self.paused_s = 0, None, 0.0
        self.started = now if self.started is not None else None
        self.steps, self._last_key = [], None
        return speed, timings, backward_ms


# ------------------------------------------------------------------ results


@dataclass(frozen=True, slots=True)
class BoundaryReport:
    """What happened at one step boundary (rank-local view; identical plan fields on every rank).

    Attributes:
        step: ``global_step`` of the boundary.
        samples_per_s: this rank's speed over the interval that ended here (None: not measured).
        plan: the plan in use from this step on (None: the algorithm has none).
        plan_version: its service version (-1: the strategy's own default plan).
        applied: True when a new plan was applied at this boundary.
        completed: whether the service finished tuning.
    """

    step: int
    samples_per_s: float | None
    plan: BucketPlan | None
    plan_version: int
    applied: bool
    completed: bool

    def metrics(self) -> dict[str, float]:
        """The ``autotune/*`` metrics logged through the trainer's loggers."""
        out: dict[str, float] = {"autotune/completed": float(self.completed),
                                 "autotune/plan_version": float(self.plan_version)}
        if self.samples_per_s is not None:
            out["autotune/samples_per_s"] = self.samples_per_s
        if self.plan is not None:
            out["autotune/bucket_size"] = float(self.plan.bucket_size)
            out["autotune/num_buckets"] = float(len(self.plan.buckets))
            out["autotune/hierarchical"] = float(self.plan.is_hierarchical_reduce)
        return out


@dataclass(frozen=True, slots=True)
class AutotuneSummary:
    """End-of-fit summary: the plan in use and this rank's speed before and after tuning.

    ``speed_before`` is the first measured interval (on the initial plan), ``speed_after``
    the last one; samples per second of this rank.
    """

    model_name: str
    service: str
    registered: bool
    plan_version: int
    num_buckets: int
    bucket_size: int
    hierarchical: bool
    completed: bool
    plans_applied: int
    speed_before: float | None
    speed_after: float | None

    def line(self) -> str:
        def fmt(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.1f}"

        ratio = (f" ({self.speed_after / self.speed_before:.2f}x)"
                 if self.speed_before and self.speed_after else "")
        source = (f"service plan v{self.plan_version}" if self.plan_version >= 0 else "default plan")
        return (f"autotune [{self.model_name} @ {self.service}]: {source}, {self.num_buckets} buckets, "
                f"bucket_size {self.bucket_size} B, {'hierarchical' if self.hierarchical else 'flat'}, "
                f"{'completed' if self.completed else 'not completed'}, {self.plans_applied} plans applied; "
                f"samples/s before {fmt(self.speed_before)} -> after {fmt(self.speed_after)}{ratio}"
                f"{'' if self.registered else '; the service was not reachable'}")


# ------------------------------------------------------------------ the controller


@dataclass(slots=True)
class _Pending:
    plan: BucketPlan
    completed: bool


class _Outage:
    """One warning per outage (from rank 0; other ranks log it at INFO), one INFO line when it ends."""

    def __init__(self, address: str, *, loud: bool) -> None:
        self.address = address
        self.level = logging.WARNING if loud else logging.INFO
        self.down = False

    def failed(self, what: str, exc: BaseException) -> None:
        if not self.down:
            self.down = True
            log.log(self.level, "autotune: %s failed (%s); the current bucket plan stays, retrying at later "
                    "step boundaries", what, _describe(exc))

    def ok(self) -> None:
        if self.down:
            self.down = False
            log.info("autotune: the service at %s answers again", self.address)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}"


class AutotuneController:
    """Drives one job's autotuning; every rank creates one and calls it at the same points.

    Args:
        settings: address, interval and deadlines.
        target: what applies plans and measures buckets (the module wrapper).
        module: the model whose trainable parameters are tuned.
        model_prefix: first part of the model name (e.g. the LightningModule's class name).
        nproc_per_node: ranks per node (hierarchical reduce is a choice with several nodes).
        device: where the control collectives' tensors live (CUDA for NCCL).
        group: the job's process group (None: the default group).
        client_factory: builds the client from the settings (default: an ``AutotuneClient`` with the
            settings' deadline and retries).
    """

    def __init__(self, settings: AutotuneSettings, target: PlanTarget, module: nn.Module, *, model_prefix: str,
                 nproc_per_node: int, device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                 client_factory: Callable[[AutotuneSettings], Any] | None = None) -> None:
        self.settings = settings
        self.target = target
        self.group = group
        self.device = device or torch.device("cpu")
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.nproc_per_node = nproc_per_node
        self._outage = _Outage(settings.address, loud=self.rank == 0)
        self.named = trainable_parameters(module)
        self.tensors = declare(self.named)
        self._index = {t.name: i for i, t in enumerate(self.tensors)}
        self.model_fingerprint = tensor_list_fingerprint(self.tensors)
        self.model_name = settings.model_name or model_name_for(model_prefix, self.tensors)
        self._client_factory = client_factory or _default_client
        self._client: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self._lock = threading.Lock()
        # Rank 0's view of the service, written by its worker thread:
        self._pending: _Pending | None = None
        self._registered_local = False
        # What every rank agrees on (from broadcasts):
        self.registered = False
        self.completed = False
        self.version = -1  # service version of the plan in use; -1: the strategy's default plan
        self.iter_base = 0
        self.last_boundary = -1
        self._apply_at: int | None = None  # the step of the next apply point (with a delay)
        self._measured: float | None = None  # the speed measured at the boundary it belongs to
        self.meter = IntervalMeter()
        self.speeds: list[float] = []
        #: (step, plan version, plan fingerprint) of every plan applied, for cross-rank comparisons.
        self.applied: list[tuple[int, int, str]] = []
        self._order: list[tuple[str, int]] = []
        self._order_hooks: list[Any] = []
        self._order_sent = False
        self._reconnect = False
        self._unexpected: set[str] = set()
        self.closed = False

    # ---------------------------------------------------------------- life cycle

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def setup(self) -> BoundaryReport:
        """Register (rank 0), broadcast and apply the initial plan; a collective on every rank."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagua-autotune")
        iter_base = 0
        if self.is_main:
            iter_base = time.time_ns() // 1000
            self._client = self._client_factory(self.settings)
            try:
                self._client.wait_until_ready(timeout_s=self.settings.connect_timeout_s)
                reachable = True
            except ServiceUnavailableError:
                reachable = False
            if reachable:
                self._register(self._client)
            else:
                self._outage.down = True
                log.warning("autotune: no autotune service answers at %s; training on the default bucket plan "
                            "(start one with `bagua-lightning autotune serve`, or set "
                            "BAGUA_LIGHTNING_AUTOTUNE_SERVICE); registration is retried in the background",
                            self.settings.address)
            self._watch_ready_order()
        elif self._client is None:
            self._client = self._client_factory(self.settings)
        return self._boundary(step=0, iter_base=iter_base, speed=None)

    def close(self) -> None:
        """Stop the worker (in-flight RPCs end at their deadline or when the channel closes); idempotent."""
        if self.closed:
            return
        self._remove_order_hooks()
        pool, self._pool = self._pool, None
        with self._lock:
            self.closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()  # cancels an RPC in flight
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # ---------------------------------------------------------------- per batch

    def pause(self) -> None:
        """Stop the interval's clock (e.g. during validation)."""
        self.meter.pause(time.monotonic())

    def resume(self) -> None:
        self.meter.resume(time.monotonic())

    def on_batch_start(self, global_step: int, batch_size: int = 1) -> BoundaryReport | None:
        """Call before every training batch (every micro-batch) on every rank.

        Returns the boundary's report when ``global_step`` is a new multiple of the
        interval (a collective then ran), else None.
        """
        if self.closed:
            return None
        now = time.monotonic()
        plan = self.target.bucket_plan
        self.meter.add_timings(self.target.last_step_timings(), len(plan.buckets) if plan else 0)
        if global_step >= 1 and self._order_hooks:
            self._remove_order_hooks()
        report = None
        delay = self.settings.delay
        if global_step % self.settings.interval == 0 and global_step > self.last_boundary and global_step > 0:
            speed, timings, backward_ms = self.meter.close(now)
            if speed is not None:
                self.speeds.append(speed)
            self._queue_report(global_step, speed, timings, backward_ms)
            if delay:
                # The answer is applied `delay` steps later (same step on every rank: it depends on
                # global_step alone), and the interval's measurement starts there.
                self.last_boundary, self._apply_at, self._measured = global_step, global_step + delay, speed
            else:
                report = self._boundary(step=global_step, iter_base=self.iter_base, speed=speed)
        elif self._apply_at is not None and global_step >= self._apply_at:
            self._apply_at = None
            report = self._boundary(step=global_step, iter_base=self.iter_base, speed=self._measured)
            self.meter.close(time.monotonic())  # the steps since the report ran the plan already measured
        if global_step >= 1:
            self.meter.count(batch_size, time.monotonic())
        return report

    def summary(self) -> AutotuneSummary:
        plan = self.target.bucket_plan
        return AutotuneSummary(
            model_name=self.model_name, service=self.settings.address, registered=self.registered,
            plan_version=self.version, num_buckets=len(plan.buckets) if plan else 0,
            bucket_size=plan.bucket_size if plan else 0,
            hierarchical=bool(plan and plan.is_hierarchical_reduce), completed=self.completed,
            plans_applied=len(self.applied), speed_before=self.speeds[0] if self.speeds else None,
            speed_after=self.speeds[-1] if self.speeds else None)

    # ---------------------------------------------------------------- the boundary collective

    def _boundary(self, *, step: int, iter_base: int, speed: float | None) -> BoundaryReport:
        self.last_boundary = step
        header = torch.zeros(_HEADER, dtype=torch.int64)
        payload = b""
        if self.is_main:
            with self._lock:
                pending, self._pending = self._pending, None
                registered = self._registered_local
            if pending is not None and not self._is_current(pending.plan):
                try:
                    check_plan(pending.plan, self.named)
                    payload = self._encode(pending.plan)
                except (PlanMismatchError, KeyError, ValueError) as exc:
                    log.warning("autotune: ignoring a plan from the service that does not fit the model: %s", exc)
                    payload = b""
            completed = pending.completed if pending is not None else self.completed
            header = torch.tensor([int(bool(payload)), int(registered), pending.plan.version if payload and
                                   pending else 0, len(payload), int(completed), iter_base], dtype=torch.int64)
        header = self._broadcast(header)
        has_plan, registered_flag, version, nbytes, completed_flag, base = (int(v) for v in header.tolist())
        if has_plan:
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            if self.is_main:
                buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            payload = bytes(self._broadcast(buf).tolist())
        self.registered, self.completed, self.iter_base = bool(registered_flag), bool(completed_flag), base
        failure = ""
        if has_plan:
            try:
                plan = self._decode(payload)
                if plan.version != version:
                    raise PlanMismatchError(f"broadcast plan version {plan.version} != header version {version}")
                self.target.apply_plan(plan)
                self.version = version
                self.applied.append((step, version, plan.fingerprint()))
            except Exception as exc:  # reported to every rank by the check below, then raised there
                failure = f"{type(exc).__name__}: {exc}"
                log.error("autotune: rank %d could not apply plan v%d at step %d: %s", self.rank, version, step,
                          failure)
        self._check_agreement(step, failure)
        return BoundaryReport(step=step, samples_per_s=speed, plan=self.target.bucket_plan,
                              plan_version=self.version, applied=bool(has_plan), completed=self.completed)

    def _is_current(self, plan: BucketPlan) -> bool:
        current = self.target.bucket_plan
        return current is not None and plan.version == self.version and plan.same_layout(current)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        t = tensor.to(self.device)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(t, src=src, group=self.group)
        return t.cpu()

    def _check_agreement(self, step: int, failure: str) -> None:
        plan = self.target.bucket_plan
        plan_hash = _hash63(plan.fingerprint()) if plan is not None else 0
        model_hash = _hash63(self.model_fingerprint)
        mine = [self.version, plan_hash, model_hash, int(bool(failure))]
        if self.world_size > 1:
            t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            values = t.cpu().tolist()
            highest, lowest = values[:4], [-v for v in values[4:]]
        else:
            highest = lowest = mine
        if highest != lowest:
            what = [name for name, hi, lo in zip(("plan version", "plan layout", "model (tensor list)",
                                                  "apply failure"), highest, lowest, strict=True) if hi != lo]
            raise PlanMismatchError(
                f"ranks disagree at step {step} on: {', '.join(what)} (this rank: plan v{self.version}, "
                f"fingerprint {plan.fingerprint() if plan else None}, model {self.model_fingerprint}"
                f"{', apply failed: ' + failure if failure else ''}); every rank must build the same model and "
                "apply the same plan at the same step boundary")

    def _encode(self, plan: BucketPlan) -> bytes:
        return json.dumps({"b": [[self._index[t.name] for t in bucket] for bucket in plan.buckets],
                           "s": plan.bucket_size, "h": plan.is_hierarchical_reduce, "v": plan.version}).encode()

    def _decode(self, payload: bytes) -> BucketPlan:
        data = json.loads(payload)
        return BucketPlan(buckets=tuple(tuple(self.tensors[i] for i in b) for b in data["b"]),
                          bucket_size=int(data["s"]), is_hierarchical_reduce=bool(data["h"]), version=int(data["v"]))

    # ---------------------------------------------------------------- background work

    def _queue_report(self, step: int, speed: float | None, timings: list[BucketTimingRecord],
                      backward_ms: float) -> None:
        if self._pool is None:
            return
        if self._future is not None and not self._future.done():
            return  # the service is slow: skip this interval rather than queue behind it
        train_iter = self.iter_base + step
        plan = self.target.bucket_plan
        report = (self.registered and not self.completed and speed is not None and plan is not None
                  and self.version >= 0)
        if not report and not self.is_main:
            return
        if self.is_main and self.completed and self.registered:
            return
        self._future = self._pool.submit(self._work, train_iter, plan if report else None, speed or 0.0,
                                         timings, backward_ms)

    def _work(self, train_iter: int, plan: BucketPlan | None, speed: float, timings: list[BucketTimingRecord],
              backward_ms: float) -> None:
        client = self._worker_client()
        if client is None:
            return
        try:
            if plan is not None:
                client.report_metrics(self.model_name, self.rank, train_iter, plan, speed, timings,
                                      backward_ms=backward_ms)
            if self.is_main:
                if not self._registered_local:
                    self._register(client)
                    return
                if self._order and not self._order_sent:
                    spans = [{"trace_id": 1, "action": "tensor_ready", "tensor_name": name, "start_time": t,
                              "end_time": t} for name, t in self._order]
                    client.report_tensor_execution_order(spans, model_name=self.model_name)
                    self._order_sent = True
                reply = client.ask_hyperparameters(self.model_name, 0, train_iter)
                with self._lock:
                    self._pending = _Pending(plan_from_proto(reply.recommended_hyperparameters),
                                             bool(reply.is_autotune_completed))
            self._outage.ok()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                # The service restarted without the model: register again at the next boundary.
                with self._lock:
                    self._registered_local = False
                self._order_sent = False
            self._outage.failed(f"autotune call to {self.settings.address}", exc)
        except ServiceUnavailableError as exc:
            self._reconnect = True
            self._outage.failed(f"autotune call to {self.settings.address}", exc)
        except ValueError as exc:  # a malformed plan from the service
            self._outage.failed(f"autotune call to {self.settings.address}", exc)
        except Exception as exc:  # a bug here must not stop training; say so loudly, once per kind
            if repr(exc) not in self._unexpected:
                self._unexpected.add(repr(exc))
                log.exception("autotune: unexpected error in the background worker; the current plan stays")

    def _worker_client(self) -> Any:
        """The client, replaced by a fresh one after an outage: a new channel connects at once, where the
        old one may still wait out gRPC's reconnect backoff."""
        with self._lock:
            if self.closed:
                return None
            if self._reconnect and self._client is not None:
                self._client.close()
                self._client = self._client_factory(self.settings)
                self._reconnect = False
            return self._client

    def _register(self, client: Any) -> None:
        """Rank 0: register the tensors; the answer becomes the pending plan. Failures are warned once."""
        try:
            reply = client.register_tensors(self.model_name, self.tensors, world_size=self.world_size,
                                                  nproc_per_node=self.nproc_per_node)
        except (grpc.RpcError, ServiceUnavailableError) as exc:
            self._reconnect = True
            self._outage.failed(f"registering model {self.model_name!r} with {self.settings.address}", exc)
            return
        plan = plan_from_proto(reply.recommended_hyperparameters)
        with self._lock:
            self._pending = _Pending(plan, False)
            self._registered_local = True
        self._outage.ok()
        log.info("autotune: registered %s (%d tensors) with %s; initial plan v%d, %d buckets",
                 self.model_name, len(self.tensors), self.settings.address, plan.version, len(plan.buckets))

    # ---------------------------------------------------------------- gradient-ready order (rank 0)

    def _watch_ready_order(self) -> None:
        seen: set[str] = set()

        def hook(name: str) -> Callable[[torch.Tensor], None]:
            def record(_: torch.Tensor) -> None:
                if name not in seen:
                    seen.add(name)
                    self._order.append((name, time.monotonic_ns()))
            return record

        self._order_hooks = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in self.named]

    def _remove_order_hooks(self) -> None:
        for h in self._order_hooks:
            h.remove()
        self._order_hooks = []


def _default_client(settings: AutotuneSettings) -> Any:
    from bagua_lightning.client.autotune import RETRYABLE_CODES, AutotuneClient
    from bagua_lightning.client.retry import ExponentialBackoff, Retry

    def retryable(exc: BaseException) -> bool:
        return isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE_CODES  # type: ignore[attr-defined]

    retry = Retry(backoff=ExponentialBackoff(base_s=0.05, cap_s=0.5), retries=settings.rpc_retries,
                  retryable=retryable, budget_s=2 * settings.rpc_timeout_s)
    return AutotuneClient(target=settings.address, timeout_s=settings.rpc_timeout_s, retry=retry)
