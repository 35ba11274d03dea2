"""Autotuning a fault-tolerant job: the plan follows the job's nodes, and every node runs the same one.

Under :class:`~bagua_lightning.engine.elastic.ElasticTraining` nodes come and go, so the job's shape (world
size = nodes x ranks per node) changes while it trains. :class:`ElasticAutotune` is the
:class:`~.controller.AutotuneController` for that case:

* **One node talks to the service**: the leader, the first node of the step's quorum. Its rank 0 reports
  its node's measurement for the job once per interval and asks for the plan; the other nodes call
  nothing. When the leader is lost, the next node of the quorum leads from that membership change on.
* **A membership change re-registers the shape** (:meth:`ElasticAutotune.on_membership`, a
  :meth:`~bagua_lightning.engine.fault_tolerance.ElasticSession.add_membership_listener` listener): the
  leader registers the job again with the new world size and ranks per node, in the background. The
  service starts that shape from the plan jobs share for it (else its default plan), plan versions going
  on, and records the reshape (``autotune show``, ``bagua_autotune_job_reshapes_total``). The interval
  that spans the change is not reported: it measured two shapes.
* **Every rank of every node switches at the same step.** At a boundary (``step % interval == 0``, the
  quorum's step, equal on every node of it) the leader's decision reaches its own ranks through the
  controller's broadcast (:mod:`.plansync`), then every node through the quorum's fault-tolerant
  allreduce: a sum to which only the leader adds (:func:`leader_decision`). A plan is applied only once
  the step that carried it committed on the node (:meth:`ElasticAutotune.end_step`). A node that did not
  commit that step is behind, so at the next step it heals from a live peer, which serves the plan it
  applied and this controller's state (:meth:`ElasticAutotune.state_dict`). The nodes of a quorum thus
  always run one plan, and each bucket's cross-node average pairs equal buckets. A node that cannot apply
  the plan raises and ends (it may rejoin and heal) rather than run the next step on another plan than
  its peers.

The service being down never stops training: calls have deadlines, run on the worker thread and warn once
per outage (:mod:`.worker`); the current plan stays.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError, PlanMismatchError
from ...proto.plan import BucketPlan, TensorDeclaration
from .controller import AutotuneController, AutotuneSettings, _ready_order
from .jobstate import MAX_JOB_ID_CHARS
from .measurement import BoundaryReport, reduce_over_ranks
from .plansync import BoundaryMessage, broadcast_from_main, broadcast_message, check_agreement
from .worker import AutotuneWorker, Job, Pending

if TYPE_CHECKING:  # pragma: no cover
    from ..ddp import BaguaDistributedDataParallel
    from ..fault_tolerance import ElasticSession, Membership

log = logging.getLogger(__name__)

#: Sums ``tensor`` in place over the quorum's nodes; False when that failed (the step then cannot commit).
SumAcrossNodes = Callable[[torch.Tensor], bool]

_SPLIT = 2**31  # integers up to 2**62 cross as two float64s, each exact
_HEADER = 12 + MAX_JOB_ID_CHARS


def _split(value: int) -> tuple[float, float]:
    high, low = divmod(int(value), _SPLIT)
    return float(high), float(low)


def _joined(high: float, low: float) -> int | None:
    if high != int(high) or low != int(low) or not 0 <= low < _SPLIT or high < 0:
        return None
    return int(high) * _SPLIT + int(low)


def encode_header(message: BoundaryMessage | None, job_id: str) -> torch.Tensor:
    """The leader's decision without its buckets, as float64s; zeros for ``None`` (a node that adds nothing)."""
    t = torch.zeros(_HEADER, dtype=torch.float64)
    if message is None:
        return t
    t[0], t[1], t[2] = 1.0, float(message.registered), float(message.completed)
    t[3], t[4] = _split(message.iter_base)
    if message.plan is not None:
        buckets, size, hierarchical, version = message.plan
        t[5], t[6] = 1.0, float(len(buckets))
        t[7], t[8] = _split(size)
        t[9] = float(hierarchical)
        t[10], t[11] = _split(version)
    codes = [float(ord(c)) for c in job_id[:MAX_JOB_ID_CHARS]]
    t[12:12 + len(codes)] = torch.tensor(codes, dtype=torch.float64)
    return t


def encode_buckets(buckets: tuple[tuple[int, ...], ...], num_tensors: int) -> torch.Tensor:
    """Tensor indices in bucket order, then each position's bucket number (both 1-based; 0: empty)."""
    t = torch.zeros(2 * num_tensors, dtype=torch.float64)
    position = 0
    for number, bucket in enumerate(buckets, start=1):
        for index in bucket:
            t[position], t[num_tensors + position] = float(index + 1), float(number)
            position += 1
    return t


def _decode_buckets(t: torch.Tensor, num_buckets: int) -> tuple[tuple[int, ...], ...] | None:
    """The buckets :func:`encode_buckets` wrote, or None when ``t`` is not such a list (every tensor once)."""
    n = t.numel() // 2
    values = t.tolist()
    indices, numbers = values[:n], values[n:]
    if sorted(indices) != [float(i + 1) for i in range(n)]:
        return None
    buckets: list[list[int]] = []
    for index, number in zip(indices, numbers, strict=True):
        if number == len(buckets) + 1:
            buckets.append([])
        elif number != len(buckets) or not buckets:
            return None
        buckets[-1].append(int(index) - 1)
    return tuple(tuple(b) for b in buckets) if len(buckets) == num_buckets else None


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What every node of the quorum got from the leader at a boundary (the same on each)."""

    registered: bool
    completed: bool
    iter_base: int
    job_id: str
    plan: BucketPlan | None


def leader_decision(message: BoundaryMessage | None, job_id: str, tensors: Sequence[TensorDeclaration], *,
                    sum_across_nodes: SumAcrossNodes) -> Decision | None:
    """The leader's ``message`` on every node: one sum over the nodes (two when it carries a plan), to which
    only the leader adds (the others pass None); every node decides from the summed values alone, so they
    all decide alike. None when a sum failed (the step then does not commit on this node) or no single
    leader added to it. A plan that does not fit ``tensors`` arrives as no plan, on every node alike."""
    header = encode_header(message, job_id)
    if not sum_across_nodes(header):
        return None
    h = header.tolist()
    iter_base = _joined(h[3], h[4])
    if h[0] != 1.0 or iter_base is None:
        return None
    codes = [int(c) for c in h[12:] if c > 0]
    decided = Decision(registered=h[1] == 1.0, completed=h[2] == 1.0, iter_base=iter_base,
                       job_id="".join(chr(c) for c in codes if c <= 0x10FFFF), plan=None)
    if h[5] != 1.0:
        return decided
    num_buckets = int(h[6])
    payload = (encode_buckets(message.plan[0], len(tensors)) if message is not None and message.plan is not None
               else torch.zeros(2 * len(tensors), dtype=torch.float64))
    if not sum_across_nodes(payload):
        return None
    buckets, size, version = _decode_buckets(payload, num_buckets), _joined(h[7], h[8]), _joined(h[10], h[11])
    if buckets is None or size is None or version is None:
        log.warning("autotune: the leader's plan did not arrive whole; every node keeps its current plan")
        return decided
    packed = BoundaryMessage(registered=decided.registered, completed=decided.completed, iter_base=iter_base,
                             plan=(buckets, size, h[9] == 1.0, version))
    try:
        plan = packed.unpack(tensors)
    except ValueError as exc:
        log.warning("autotune: ignoring the leader's plan, it does not fit the model (%s)", exc)
        return decided
    return dataclasses.replace(decided, plan=plan)


def manager_sum(session: ElasticSession) -> SumAcrossNodes:
    """:data:`SumAcrossNodes` over torchft's managed process group of ``session`` (fault tolerant: a failure
    is reported to the manager, and the step does not commit on this node)."""
    manager = session.manager

    def run(tensor: torch.Tensor) -> bool:
        if manager.errored() is not None:
            return False
        work = manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)
        return bool(work.wait()) and manager.errored() is None

    return run


class ElasticAutotune(AutotuneController):
    """One node's part in autotuning a fault-tolerant job (module docstring); every rank creates one.

    Args:
        settings: address, interval and deadlines (``aggregate_reports`` must stay True: one report per
            interval for the job, from the leader).
        target: the node's wrapper's driver (applies plans, measures buckets).
        module: the model.
        model_prefix: first part of the model name.
        nproc_per_node: ranks of this node (its process group).
        sum_across_nodes: sums a tensor over the quorum's nodes (:func:`manager_sum`).
        device: where the in-node control collectives' tensors live (CUDA for NCCL).
        group: the node's process group (None: the default group).
        client_factory: builds the client from the settings.
    """

    def __init__(self, settings: AutotuneSettings, target: Any, module: torch.nn.Module, *, model_prefix: str,
                 nproc_per_node: int, sum_across_nodes: SumAcrossNodes, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None,
                 client_factory: Callable[[AutotuneSettings], Any] | None = None) -> None:
        if not settings.aggregate_reports:
            raise ConfigurationError("ElasticTraining's autotune reports once per interval for the whole job "
                                     "(from the leader node); use AutotuneSettings(aggregate_reports=True)")
        super().__init__(settings, target, module, model_prefix=model_prefix, nproc_per_node=nproc_per_node,
                         device=device, group=group, client_factory=client_factory)
        self._sum = sum_across_nodes
        self.leader = False
        #: Ranks of the job now (nodes x ranks per node), from the latest membership.
        self.job_world_size = nproc_per_node
        #: (step, world size, ranks per node) at every membership change, oldest first.
        self.shapes: list[tuple[int, int, int]] = []
        self._reshaped = False  # the interval in progress spans a membership change: not reported
        self._staged: tuple[int, float | None, Decision | None] | None = None
        self._offered: Pending | None = None  # the leader's offer at the boundary in progress
        self._carry: Pending | None = None  # an offer whose step did not commit: offered again

    @classmethod
    def attach(cls, settings: AutotuneSettings | bool, wrapper: BaguaDistributedDataParallel,
               session: ElasticSession) -> ElasticAutotune:
        """The controller of ``wrapper``'s node, listening to ``session``'s membership and set up (``True``:
        the service at :func:`~bagua_lightning.core.services_file.resolve_autotune_address`)."""
        if settings is True:
            from ...core.services_file import resolve_autotune_address

            settings = AutotuneSettings(address=resolve_autotune_address())
        if not isinstance(settings, AutotuneSettings):
            raise ConfigurationError(f"autotune must be True or an AutotuneSettings, got {settings!r}")
        size = dist.get_world_size() if dist.is_initialized() else 1
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        device = next(wrapper.module.parameters()).device if nccl else torch.device("cpu")
        controller = cls(settings, wrapper.driver, wrapper.module, model_prefix=type(wrapper.module).__name__,
                         nproc_per_node=size, sum_across_nodes=manager_sum(session), device=device)
        controller.setup()
        session.add_membership_listener(controller.on_membership)
        return controller

    def setup(self) -> BoundaryReport:
        """Agree on the job id inside the node (a collective); rank 0 gets a worker, idle until its node
        leads. Nothing registers yet: the first membership tells the shape."""
        self.job_id = str(broadcast_from_main(self._pick_job_id() if self.is_main else None, group=self.group,
                                              device=self.device, world_size=self.world_size))
        if self.is_main:
            job = Job(address=self.settings.address, model_name=self.model_name, tensors=self.tensors, rank=0,
                      world_size=self.nproc_per_node, nproc_per_node=self.nproc_per_node, job_id=self.job_id)
            self.worker = AutotuneWorker(job, lambda: self._client_factory(self.settings))
            self.worker.active = False
            self.iter_base = time.time_ns() // 1000
        plan = self.target.bucket_plan
        return BoundaryReport(step=0, samples_per_s=None, plan=plan, plan_version=self.version, applied=False,
                              completed=False)

    # ---------------------------------------------------------------- the membership

    def on_membership(self, old: Membership | None, new: Membership) -> None:
        """The step's nodes changed (an :class:`ElasticSession` listener): the job has a new shape; the
        leader re-registers it. Never raises (autotuning must not stop training)."""
        try:
            world = new.count * self.nproc_per_node
            self.job_world_size, self.leader = world, new.index == 0
            self.shapes.append((new.step, world, self.nproc_per_node))
            self._reshaped = True
            self.meter.close(time.monotonic())
            self._carry = self._offered = None
            if self.worker is not None:
                self.worker.reshape(world_size=world, nproc_per_node=self.nproc_per_node, job_id=self.job_id,
                                    active=self.leader and not self.closed)
            if self.is_main:
                log.info("autotune: the job now runs %d node(s) x %d rank(s) (world size %d)%s", new.count,
                         self.nproc_per_node, world, "; this node leads and registers the shape" if self.leader
                         else "")
        except Exception:  # a bug here must not stop training
            log.exception("autotune: could not follow the membership change; the current plan stays")

    # ---------------------------------------------------------------- per step

    def on_step(self, membership: Membership, batch_size: int) -> None:
        """Call on every rank after ``begin_step``, before the step's forward: at a boundary, measures
        the interval, reports it (the leader) and receives the leader's decision (collectives in the node
        and across the nodes)."""
        if self.closed:
            return
        plan = self.target.bucket_plan
        num_buckets = len(plan.buckets) if plan else 0
        self.meter.add_timings(self.target.last_step_timings(), num_buckets)
        step = membership.step
        if step >= 1 and not self._order_taken and self.is_main and self.worker is not None:
            order = _ready_order(self.target)
            if order:
                self._order_taken = True
                self.worker.set_ready_order(order)
        if step > 0 and step % self.settings.interval == 0:
            measured = reduce_over_ranks(self.meter.close(time.monotonic()), num_buckets, group=self.group,
                                         device=self.device, world_size=self.world_size)
            if self._reshaped:
                self._reshaped = False
            elif step > self.last_boundary:  # a redone step's boundary is measured once
                if measured.timings:
                    self.last_measured = measured
                if measured.speed is not None:
                    self.speeds.append(measured.speed)
                    self._speed_by_version[self.version] = measured.speed
                self._queue_report(step, measured)
            self.last_boundary = max(self.last_boundary, step)
            self._staged = (step, measured.speed, self._exchange())
        self.meter.count(batch_size, time.monotonic())

    def _exchange(self) -> Decision | None:
        message = None
        if self.leader:
            if self.is_main:
                worker = self.worker
                pending = self._carry or (worker.take() if worker is not None else None)
                self._carry, self._offered = None, pending
                packed = None
                if pending is not None and not self._is_current(pending.plan):
                    try:
                        packed = BoundaryMessage.pack(pending.plan, self._index)
                    except KeyError as exc:
                        log.warning("autotune: ignoring a plan from the service that names tensor %s, not in the "
                                    "model", exc)
                message = BoundaryMessage(registered=bool(worker and worker.registered),
                                          completed=pending.completed if pending is not None else self.completed,
                                          iter_base=self.iter_base, plan=packed)
            message = broadcast_message(message, group=self.group, device=self.device, world_size=self.world_size)
        return leader_decision(message, self.job_id, self.tensors, sum_across_nodes=self._sum)

    def end_step(self, committed: bool) -> BoundaryReport | None:
        """Call on every rank after the step's commit (and optimizer step): a decision the step carried is
        applied when the step committed on this node; otherwise the leader offers it again."""
        staged, self._staged = self._staged, None
        if staged is None or self.closed:
            return None
        offered, self._offered = self._offered, None
        step, speed, decided = staged
        if not committed:
            self._carry = offered
            return None
        if decided is None:
            return None
        self.job_id, self.registered = decided.job_id or self.job_id, decided.registered
        self.completed, self.iter_base = decided.completed, decided.iter_base
        failure, applied, plan = "", False, decided.plan
        if plan is not None:
            try:
                self.target.apply_plan(plan)
                self.version = plan.version
                self.applied.append((step, plan.version, plan.fingerprint()))
                applied = True
            except Exception as exc:  # every rank of the node learns of it below
                failure = f"{type(exc).__name__}: {exc}"
        check_agreement(step=step, version=self.version, plan=self.target.bucket_plan,
                        model_fingerprint=self.model_fingerprint, failure=failure, group=self.group,
                        device=self.device, world_size=self.world_size)
        if failure:
            raise PlanMismatchError(
                f"this node could not apply plan v{plan.version if plan else -1} at step {step} ({failure}); it "
                "leaves the job instead of running the next step on another plan than its peers (started again, "
                "it heals from a live peer)")
        if applied and self.is_main:
            log.info("autotune: plan v%d (%d buckets) in use on every node from step %d", self.version,
                     len(plan.buckets) if plan else 0, step + 1)
        return BoundaryReport(step=step, samples_per_s=speed, plan=self.target.bucket_plan,
                              plan_version=self.version, applied=applied, completed=self.completed)

    # ---------------------------------------------------------------- what a healing node takes

    def state_dict(self) -> dict[str, Any]:
        """What a node that heals from this one takes with the plan (plain values)."""
        return {"job_id": self.job_id, "version": self.version, "completed": self.completed,
                "registered": self.registered, "iter_base": self.iter_base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.job_id = str(state["job_id"]) or self.job_id
        self.version, self.completed = int(state["version"]), bool(state["completed"])
        self.registered, self.iter_base = bool(state["registered"]), int(state["iter_base"])
        self._staged = self._offered = self._carry = None
