"""The controller: service-planned buckets, re-planned in flight, identical on all ranks.

:class:`AutotuneController` is plain Python over ``torch.distributed``; it needs no
Lightning (``BaguaStrategy(autotune=True)`` drives it from its hooks, a hand-written
loop can call :meth:`AutotuneController.on_batch_start` itself). Protocol:

* **set-up** (collectives): rank 0 picks the job id (:mod:`.jobstate`: the launcher's
  run id, else a resumed checkpoint's, else a new one) and broadcasts it. Every rank
  declares its trainable parameters. Rank 0 registers them with the service under the
  job id and a model name stable across jobs (:func:`model_name_for`, or the one the
  user gave): the job gets its own tuning session, which starts from the best plan any
  job of the same model and shape reached (or from the plan a resumed job saved), and
  rank 0 broadcasts that initial plan; every rank applies it.
  No service within ``connect_timeout_s``: the job trains on the strategy's default
  plan, with one warning, and rank 0 keeps trying to register in the background.
* **after the first step**: rank 0 sends the gradient-ready order the bucket engine
  observed in the first backward, so later plans cut buckets in that order.
* **every ``interval`` steps** (``global_step % interval == 0``, the same on every rank):
  with aggregated reports (the default) the ranks' measurements of the interval are
  reduced with one ``all_gather`` and rank 0's worker sends ONE report for the job
  (means over ranks with their spread), then asks for the plan; per-rank reports
  (``aggregate_reports=False``, Bagua's protocol) have every rank report its own. The
  answer is broadcast ``apply_delay`` steps later (default ``interval // 4``; 0: at the
  next boundary) and applied on every rank; the next measurement starts there. A slow
  or dead service never holds a step longer than that broadcast. After every broadcast
  the ranks check they agree (:mod:`.plansync`).
* **faults**: RPCs have short deadlines and few retries; a failure leaves the current
  plan in place and warns once per outage (:mod:`.worker`).

Speed is **samples per second per rank** over the interval (validation time
excluded); a batch whose size cannot be found counts as one sample. ``train_iter``
on the wire is ``iter_base + global_step``, where rank 0 picks ``iter_base`` (the
job's start time in microseconds) so that a second job of the same model never
replays the first job's per-iteration decisions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from ...core.errors import ConfigurationError, ServiceUnavailableError
from ...proto.plan import BucketPlan, StepTimings, TensorDeclaration, tensor_list_fingerprint
from ..parameters import declare, trainable_parameters
from .jobstate import (
    MAX_JOB_ID_CHARS,
    MAX_MODEL_NAME_CHARS,
    AutotuneState,
    check_name,
    launcher_job_id,
    new_job_id,
)
from .measurement import AutotuneSummary, BoundaryReport, IntervalMeter, Measurement, reduce_over_ranks
from .plansync import BoundaryMessage, broadcast_from_main, broadcast_message, check_agreement
from .selection import Selection
from .worker import AutotuneWorker, Job, Pending

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 20  # steps between two step boundaries
DEFAULT_RPC_TIMEOUT_S = 1.0  # seconds: deadline of one RPC attempt
DEFAULT_CONNECT_TIMEOUT_S = 2.0  # seconds: how long set-up waits for the service


class PlanTarget(Protocol):
    """What the controller tunes: an :class:`~bagua_lightning.engine.ddp.AlgorithmDriver` (a
    ``BaguaDistributedDataParallel``'s ``driver``; what ``BaguaStrategy`` hands it) or ``BaguaStrategy``."""

    @property
    def bucket_plan(self) -> BucketPlan | None: ...

    def apply_plan(self, plan: BucketPlan) -> None: ...

    def last_step_timings(self) -> StepTimings | None: ...


@dataclass(kw_only=True, slots=True)
class AutotuneSettings:
    """How a job talks to the autotune service.

    Attributes:
        address: ``host:port`` of the service (see
            :func:`bagua_lightning.core.services_file.resolve_autotune_address`).
        interval: steps between two step boundaries (report, ask, apply), >= 1.
        rpc_timeout_s: deadline of one RPC attempt, in seconds.
        rpc_retries: retries of an RPC that failed with UNAVAILABLE/DEADLINE_EXCEEDED.
        connect_timeout_s: how long set-up waits for the service before training on
            the default plan, in seconds.
        model_name: name under which the model is tuned (printable, at most 200 characters);
            None: :func:`model_name_for`.
        job_id: the job's id on the service (printable, at most 128 characters); None: the
            launcher's run id, else a resumed checkpoint's, else a new random one
            (:func:`~.jobstate.launcher_job_id`).
        apply_delay: steps after a boundary at which the service's answer is applied
            (0: at the next boundary); None: ``interval // 4``.
        aggregate_reports: True: one report per interval for the whole job (rank 0,
            after an ``all_gather``); False: every rank reports its own (Bagua's protocol).
        token: bearer token for the service; None: ``BAGUA_LIGHTNING_AUTOTUNE_TOKEN``, or the services
            file's token when ``address`` is the service that file records (no token otherwise).
        tls: connect over TLS.
        root_certificates: PEM file of the CA of the service's certificate (implies TLS).
    """

    address: str
    interval: int = DEFAULT_INTERVAL
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
    rpc_retries: int = 1
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    model_name: str | None = None
    job_id: str | None = None
    apply_delay: int | None = None
    aggregate_reports: bool = True
    token: str | None = None
    tls: bool = False
    root_certificates: str | Path | None = None

    @property
    def delay(self) -> int:
        """The effective :attr:`apply_delay`, in steps."""
        return self.interval // 4 if self.apply_delay is None else self.apply_delay

    def __post_init__(self) -> None:
        from ...core.addresses import parse_address

        try:
            parse_address(self.address, "the autotune service address")
        except ValueError as exc:
            raise ConfigurationError(f"autotune_service {self.address!r} is not 'host:port' with a port in "
                                     f"1..65535 ({exc}); fix it or set BAGUA_LIGHTNING_AUTOTUNE_SERVICE") from None
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
        if self.model_name is not None:
            check_name("autotune_model_name", self.model_name, MAX_MODEL_NAME_CHARS)
        if self.job_id is not None:
            check_name("autotune job_id", self.job_id, MAX_JOB_ID_CHARS)
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ConfigurationError("autotune_token must be a non-empty string, or None to read "
                                     "BAGUA_LIGHTNING_AUTOTUNE_TOKEN")
        if not isinstance(self.tls, bool):
            raise ConfigurationError(f"autotune_tls must be a bool, got {self.tls!r}")
        if self.root_certificates is not None and not Path(self.root_certificates).is_file():
            raise ConfigurationError(f"autotune root certificates file {str(self.root_certificates)!r} does not "
                                     "exist; give the PEM of the CA that signed the service's certificate")


def model_name_for(prefix: str, tensors: Sequence[TensorDeclaration]) -> str:
    """``"{prefix}-{fingerprint}"``: the same for the same model (class name and tensor list) in every job."""
    return f"{prefix}-{tensor_list_fingerprint(tensors)}"


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of the first tensor in it (1 when it holds none)."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def default_client(settings: AutotuneSettings) -> Any:
    """An ``AutotuneClient`` with the settings' deadline, quick retries, token and TLS."""
    from ...client.autotune import AutotuneClient, quick_retry

    return AutotuneClient(target=settings.address, timeout_s=settings.rpc_timeout_s,
                          retry=quick_retry(settings.rpc_retries, settings.rpc_timeout_s), token=settings.token,
                          tls=settings.tls, root_certificates=settings.root_certificates)


def _ready_order(target: Any) -> list[str]:
    """The gradient-ready order the target's bucket engine observed in its first backward (may be empty)."""
    engine = getattr(getattr(target, "algorithm", None), "engine", None)
    return [str(n) for n in getattr(engine, "observed_order", [])]


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
        client_factory: builds the client from the settings (default: :func:`default_client`).
        resume: the state a checkpoint saved (:meth:`state`); the job starts on its plan and,
            unless the launcher names the job otherwise, continues its job id. Ignored (with a
            warning) when it belongs to another model.
        selection: what ``algorithm="auto"`` measured and kept; rank 0 reports it to the service with the
            registration (``autotune show``, the service's metrics).
    """

    def __init__(self, settings: AutotuneSettings, target: PlanTarget, module: nn.Module, *, model_prefix: str,
                 nproc_per_node: int, device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                 client_factory: Callable[[AutotuneSettings], Any] | None = None,
                 resume: AutotuneState | None = None, selection: Selection | None = None) -> None:
        self.settings = settings
        self.target = target
        self.group = group
        self.device = device or torch.device("cpu")
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.nproc_per_node = nproc_per_node
        self.named = trainable_parameters(module)
        self.tensors = declare(self.named)
        self._index = {t.name: i for i, t in enumerate(self.tensors)}
        self.model_fingerprint = tensor_list_fingerprint(self.tensors)
        self.model_name = settings.model_name or model_name_for(model_prefix, self.tensors)
        self._client_factory = client_factory or default_client
        self.selection = selection
        self.worker: AutotuneWorker | None = None
        # What every rank agrees on (from broadcasts):
        self.registered = False
        self.completed = False
        self.version = -1  # service version of the plan in use; -1: the strategy's default plan
        self.first_version = -1
        self.iter_base = 0
        self.last_boundary = -1
        self._apply_at: int | None = None  # the step of the next apply point (with a delay)
        self._measured: float | None = None  # the speed measured at the boundary it belongs to
        self.meter = IntervalMeter()
        self.speeds: list[float] = []
        #: The job's view of the last interval that measured bucket timings (for the end-of-fit advice).
        self.last_measured: Measurement | None = None
        self._speed_by_version: dict[int, float] = {}
        #: (step, plan version, plan fingerprint) of every plan applied, for cross-rank comparisons.
        self.applied: list[tuple[int, int, str]] = []
        self._order_taken = False
        self.closed = False
        self.job_id = ""  # agreed at set-up
        self._resume: AutotuneState | None = None
        self._resume_plan: BucketPlan | None = None
        if resume is not None:
            try:
                if resume.model_fingerprint != self.model_fingerprint:
                    raise ValueError(f"it was saved for model {resume.model_name!r} (fingerprint "
                                     f"{resume.model_fingerprint}), this is {self.model_fingerprint}")
                self._resume_plan = resume.bucket_plan(self.tensors)
                self._resume = resume
            except ValueError as exc:
                log.warning("autotune: not resuming the checkpoint's tuning state: %s", exc)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def _talks_to_service(self) -> bool:
        return self.is_main or not self.settings.aggregate_reports

    # ---------------------------------------------------------------- life cycle

    def _pick_job_id(self) -> str:
        """Rank 0: the settings' id, the launcher's, the resumed checkpoint's, else a new one."""
        resumed = self._resume.job_id if self._resume is not None else None
        return self.settings.job_id or launcher_job_id() or resumed or new_job_id()

    def setup(self) -> BoundaryReport:
        """Agree on the job id, register (rank 0), broadcast and apply the initial plan; collectives on every
        rank."""
        iter_base = 0
        self.job_id = str(broadcast_from_main(self._pick_job_id() if self.is_main else None, group=self.group,
                                              device=self.device, world_size=self.world_size))
        if self._talks_to_service:
            resume = self._resume
            job = Job(address=self.settings.address, model_name=self.model_name, tensors=self.tensors,
                      rank=self.rank, world_size=self.world_size, nproc_per_node=self.nproc_per_node,
                      job_id=self.job_id, resume=self._resume_plan,
                      resume_completed=bool(resume and resume.completed), selection=self.selection)
            self.worker = AutotuneWorker(job, lambda: self._client_factory(self.settings))
        if self.is_main:
            assert self.worker is not None
            iter_base = time.time_ns() // 1000
            try:
                self.worker.client.wait_until_ready(timeout_s=self.settings.connect_timeout_s)
                self.worker.register_now()
            except ServiceUnavailableError:
                self.worker.outage.down = True
                log.warning("autotune: no autotune service answers at %s; training on the default bucket plan "
                            "(start one with `bagua-lightning autotune serve`, or set "
                            "BAGUA_LIGHTNING_AUTOTUNE_SERVICE); registration is retried in the background",
                            self.settings.address)
        report = self._boundary(step=0, iter_base=iter_base, speed=None)
        self.first_version = self.version
        return report

    def close(self) -> None:
        """Stop the worker (in-flight RPCs end at their deadline or when the channel closes); idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.worker is not None:
            self.worker.close()

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
        num_buckets = len(plan.buckets) if plan else 0
        self.meter.add_timings(self.target.last_step_timings(), num_buckets)
        if global_step >= 1 and not self._order_taken and self.is_main and self.worker is not None:
            order = _ready_order(self.target)  # empty until a backward ran in this process (a resumed fit)
            if order:
                self._order_taken = True
                self.worker.set_ready_order(order)
        report = None
        delay = self.settings.delay
        if global_step % self.settings.interval == 0 and global_step > self.last_boundary and global_step > 0:
            measured = self.meter.close(now)
            if self.settings.aggregate_reports:
                measured = reduce_over_ranks(measured, num_buckets, group=self.group, device=self.device,
                                             world_size=self.world_size)
            if measured.timings:
                self.last_measured = measured
            if measured.speed is not None:
                self.speeds.append(measured.speed)
                self._speed_by_version[self.version] = measured.speed
            self._queue_report(global_step, measured)
            if delay:
                # The answer is applied `delay` steps later (same step on every rank: it depends on
                # global_step alone), and the interval's measurement starts there.
                self.last_boundary, self._apply_at, self._measured = global_step, global_step + delay, measured.speed
            else:
                report = self._boundary(step=global_step, iter_base=self.iter_base, speed=measured.speed)
        elif self._apply_at is not None and global_step >= self._apply_at:
            self._apply_at = None
            report = self._boundary(step=global_step, iter_base=self.iter_base, speed=self._measured)
            self.meter.close(time.monotonic())  # the steps since the report ran the plan already measured
        if global_step >= 1:
            self.meter.count(batch_size, time.monotonic())
        return report

    @property
    def earlier_selection(self) -> Selection | None:
        """Rank 0: what ``algorithm="auto"`` measured for this model and placement, as the service knows it
        (a job of the same shape, or this one); None on other ranks or when none was measured."""
        return self.worker.earlier_selection if self.worker is not None and self.is_main else None

    def state(self) -> AutotuneState:
        """What a checkpoint keeps (the same on every rank)."""
        before = self._resume.plans_applied if self._resume is not None else 0
        return AutotuneState.of(job_id=self.job_id, model_name=self.model_name,
                                model_fingerprint=self.model_fingerprint, plan=self.target.bucket_plan,
                                version=self.version, completed=self.completed,
                                plans_applied=before + len(self.applied))

    def summary(self) -> AutotuneSummary:
        plan = self.target.bucket_plan
        return AutotuneSummary(
            model_name=self.model_name, service=self.settings.address, registered=self.registered,
            plan_version=self.version, num_buckets=len(plan.buckets) if plan else 0,
            bucket_size=plan.bucket_size if plan else 0,
            hierarchical=bool(plan and plan.is_hierarchical_reduce), completed=self.completed,
            plans_applied=len(self.applied), speed_before=self._speed_by_version.get(self.first_version),
            speed_after=self._speed_by_version.get(self.version), job_id=self.job_id)

    # ---------------------------------------------------------------- the boundary collective

    def _boundary(self, *, step: int, iter_base: int, speed: float | None) -> BoundaryReport:
        self.last_boundary = step
        message = None
        if self.is_main:
            worker = self.worker
            pending = worker.take() if worker is not None else None
            if pending is None and self._resume_plan is not None and step == 0:
                # No answer from the service at set-up: the resumed job still starts on its saved plan.
                pending = Pending(self._resume_plan, bool(self._resume and self._resume.completed))
            packed = None
            if pending is not None and not self._is_current(pending.plan):
                try:
                    packed = BoundaryMessage.pack(pending.plan, self._index)
                except KeyError as exc:
                    log.warning("autotune: ignoring a plan from the service that names tensor %s, not in the "
                                "model", exc)
            completed = pending.completed if pending is not None else self.completed
            message = BoundaryMessage(registered=bool(worker and worker.registered), completed=completed,
                                      iter_base=iter_base, plan=packed)
        message = broadcast_message(message, group=self.group, device=self.device, world_size=self.world_size)
        self.registered, self.completed, self.iter_base = message.registered, message.completed, message.iter_base
        failure = ""
        applied = False
        if message.plan is not None:
            version = message.plan[3]
            try:
                plan = message.unpack(self.tensors)
                assert plan is not None
                # The plan is checked against the model once, where the buckets are built from it.
                self.target.apply_plan(plan)
                self.version = version
                self.applied.append((step, version, plan.fingerprint()))
                applied = True
            except Exception as exc:  # reported to every rank by the check below, then raised there
                failure = f"{type(exc).__name__}: {exc}"
                log.error("autotune: rank %d could not apply plan v%d at step %d: %s", self.rank, version, step,
                          failure)
        check_agreement(step=step, version=self.version, plan=self.target.bucket_plan,
                        model_fingerprint=self.model_fingerprint, failure=failure, group=self.group,
                        device=self.device, world_size=self.world_size)
        return BoundaryReport(step=step, samples_per_s=speed, plan=self.target.bucket_plan,
                              plan_version=self.version, applied=applied, completed=self.completed)

    def _is_current(self, plan: BucketPlan) -> bool:
        current = self.target.bucket_plan
        return current is not None and plan.version == self.version and plan.same_layout(current)

    def _queue_report(self, step: int, measured: Measurement) -> None:
        worker = self.worker
        if worker is None:
            return
        plan = self.target.bucket_plan
        reportable = (self.registered and not self.completed and measured.speed is not None and plan is not None
                      and self.version >= 0)
        if not reportable and not self.is_main:
            return
        if self.is_main and self.completed and self.registered:
            return
        worker.submit(self.iter_base + step, plan if reportable else None, measured)
