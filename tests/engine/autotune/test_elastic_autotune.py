"""The autotune controller of a fault-tolerant job (``engine/autotune/elastic.py``) through two shapes, against a
real autotune service process.

Two nodes of one rank each train real models (the engine's wrapper and driver) in two threads, in lockstep;
the sum across nodes that torchft's managed allreduce does in ``ElasticTraining`` is here a sum over the two
threads (the real torchft path: ``test_elastic_autotune_nodes.py``). Then node1 is lost: node0 re-registers
the job's new shape and starts on the plan another job shared for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_lightning.engine.autotune import AutotuneSettings
from bagua_lightning.engine.autotune.elastic import (
    ElasticAutotune,
    encode_buckets,
    encode_header,
    leader_decision,
)
from bagua_lightning.engine.autotune.plansync import BoundaryMessage
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
from bagua_lightning.engine.fault_tolerance import Membership
from bagua_lightning.engine.parameters import declare, trainable_parameters
from bagua_lightning.proto.plan import BucketPlan
from tests.procs import free_port, wait_until
from tests.services.conftest import FAST

MODEL = "elastic-net"
INTERVAL = 2


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


class _Node:
    """One node of one rank: a real wrapper (engine driver) and its ElasticAutotune."""

    def __init__(self, address: str, index: int, sum_across_nodes: Callable[[torch.Tensor], bool],
                 job_id: str | None) -> None:
        torch.manual_seed(index)
        self.module = _model()
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.01)
        self.wrapper = BaguaDistributedDataParallel(
            self.module, GradientAllReduceAlgorithm(), CommContext(rank=0, world_size=1, local_rank=0, local_size=1),
            optimizers=[self.optimizer])
        settings = AutotuneSettings(address=address, interval=INTERVAL, rpc_timeout_s=2.0, model_name=MODEL,
                                    job_id=job_id)
        self.sum = sum_across_nodes
        self.autotune = ElasticAutotune(settings, self.wrapper.driver, self.module, model_prefix="net",
                                        nproc_per_node=1, sum_across_nodes=lambda t: self.sum(t))
        self.autotune.setup()
        self.index = index
        self.last: Membership | None = None
        #: (step, fingerprint of the plan in use for that step) of every step run.
        self.ran: list[tuple[int, str]] = []

    def begin(self, step: int, nodes: tuple[str, ...]) -> Membership:
        m = Membership(index=self.index, count=len(nodes), step=step, nodes=nodes)
        if self.last is None or self.last.nodes != nodes:
            self.autotune.on_membership(self.last, m)
        self.last = m
        self.autotune.on_step(m, 4)
        plan = self.wrapper.driver.bucket_plan
        assert plan is not None
        self.ran.append((step, plan.fingerprint()))
        x = torch.randn(4, 8)
        self.wrapper(x).pow(2).mean().backward()
        return m

    def end(self, committed: bool) -> None:
        if committed:
            self.optimizer.step()
        self.optimizer.zero_grad()
        self.autotune.end_step(committed)

    def close(self) -> None:
        self.autotune.close()
        self.wrapper.driver.teardown()


class _TwoNodeSum:
    """The sum over two nodes' tensors (each node's thread calls it at the same point); the ``fail_at``-th sum
    fails on both, as a broken allreduce does (the step then commits nowhere and is redone)."""

    def __init__(self, fail_at: int) -> None:
        self.barrier = threading.Barrier(2, timeout=60)
        self.box: dict[int, torch.Tensor] = {}
        self.calls = 0
        self.fail_at = fail_at
        self.failed_step = False

    def of(self, node: int) -> Callable[[torch.Tensor], bool]:
        def run(t: torch.Tensor) -> bool:
            self.box[node] = t.clone()
            self.barrier.wait()
            total = self.box[0] + self.box[1]
            if node == 1:
                self.calls += 1
            self.barrier.wait()
            if self.calls == self.fail_at:  # a broken allreduce fails on every node taking part
                self.failed_step = True
                return False  # the tensor is left as it was
            t.copy_(total)
            return True
        return run


def _seed_shared_plan(client: AutotuneClient, tensors: list[Any]) -> BucketPlan:
    """Another job ("seed") measured one bucket per tensor on the 1-node shape: that shape's shared plan."""
    mine = BucketPlan(buckets=tuple((t,) for t in tensors), bucket_size=1024)
    client.register_job(MODEL, tensors, job_id="seed", world_size=1, nproc_per_node=1, resume=mine)
    client.report_metrics(MODEL, 0, 1, mine, 100.0, job_id="seed")
    client.ask_hyperparameters(MODEL, 0, 2, job_id="seed")
    wait_until(lambda: any(p.key.endswith("-w1-n1") and p.job_id == "seed" for p in client.list_jobs()[1]), 30,
               "the seed job's shared plan")
    return mine


def test_the_plan_follows_two_shapes_on_every_node_alike(start_service: Callable[..., Any]) -> None:
    tensors = declare(trainable_parameters(_model()))
    with start_service(*FAST, "--max-samples", "6") as (target, _), AutotuneClient(target=target) as client:
        seed = _seed_shared_plan(client, tensors)
        both = ("node0", "node1")
        summing = _TwoNodeSum(fail_at=3)
        nodes = [_Node(target, 0, summing.of(0), "ej"), _Node(target, 1, summing.of(1), None)]
        try:
            # At least 14 steps, and on until the service's second plan has been applied (how soon it comes
            # depends on the machine's load): node0 decides when to stop, and both nodes stop at the same step.
            min_steps, max_steps = 14, 400
            stop = [False]
            errors: list[BaseException] = []
            committed_steps: list[int] = []
            gate = threading.Barrier(2, timeout=60)

            def train(node: _Node) -> None:
                try:
                    step = 0
                    while not stop[0]:
                        node.begin(step, both)
                        if step == 0 and node.index == 0:  # bounded: the shape registers in the background
                            wait_until(lambda: node.autotune.worker is not None and node.autotune.worker.registered,
                                       30, "node0's registration")
                        gate.wait()
                        committed = not summing.failed_step  # a failed sum fails the step on every node
                        gate.wait()
                        if node.index == 0:
                            summing.failed_step = False
                            if committed:
                                committed_steps.append(step)
                        gate.wait()
                        node.end(committed)
                        step += 1 if committed else 0
                        gate.wait()
                        if node.index == 0:
                            stop[0] = step >= max_steps or (step >= min_steps and len(node.autotune.applied) >= 2)
                        gate.wait()
                except BaseException as exc:  # reported by the test
                    errors.append(exc)
                    gate.abort()
                    summing.barrier.abort()

            threads = [threading.Thread(target=train, args=(n,)) for n in nodes]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert not errors, errors
            assert not any(t.is_alive() for t in threads)
            node0, node1 = nodes
            # One node talks to the service; both ran every step on one plan, switching at the same steps.
            assert node0.autotune.leader and not node1.autotune.leader
            assert node1.autotune.worker is not None and not node1.autotune.worker.active
            assert node0.ran == node1.ran
            assert node0.autotune.applied == node1.autotune.applied and len(node0.autotune.applied) >= 2
            steps = len(committed_steps)
            assert min_steps <= steps < max_steps, steps
            assert len(node0.ran) == steps + 1  # one step redone
            assert node1.autotune.job_id == "ej"  # the leader's job id reached the other node

            # node1 is lost: node0 goes on alone; the 1-node shape starts from the plan "seed" shared for it.
            applied_before = len(node0.autotune.applied)
            node0.sum = lambda t: True  # a quorum of one: the sum is its own tensor
            node0.begin(steps, ("node0",))
            wait_until(lambda: node0.autotune.worker is not None and node0.autotune.worker.registered, 30,
                       "node0's registration of the new shape")
            node0.end(True)
            for step in range(steps + 1, steps + 1 + 2 * INTERVAL):
                node0.begin(step, ("node0",))
                node0.end(True)
            first_after = node0.autotune.applied[applied_before]
            assert first_after[2] == seed.fingerprint()
            assert node0.autotune.shapes == [(0, 2, 1), (steps, 1, 1)]

            described = client.describe_model(MODEL, "ej")
            assert described.summary.reshapes == 1 and described.summary.world_size == 1
            assert [(s.world_size, s.nproc_per_node, s.started_from) for s in described.shapes] == [
                (2, 1, "default"), (1, 1, "shared")]
            assert described.shapes[1].plan_version == first_after[1]
        finally:
            for n in nodes:
                n.close()


def test_no_service_never_stops_training_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bagua_lightning")
    node = _Node(f"127.0.0.1:{free_port()}", 0, lambda t: True, "down")  # nothing listens there
    try:
        before = node.wrapper.driver.bucket_plan
        for step in range(4 * INTERVAL):
            node.begin(step, ("node0",))
            node.end(True)
        wait_until(lambda: any("autotune" in r.getMessage() and r.levelno == logging.WARNING
                               for r in caplog.records), 30, "the outage warning")
        for step in range(4 * INTERVAL, 6 * INTERVAL):
            node.begin(step, ("node0",))
            node.end(True)
        assert node.wrapper.driver.bucket_plan == before and node.autotune.applied == []
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "autotune" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
    finally:
        node.close()


# ------------------------------------------------------------------ the exchange across nodes, as values


def test_every_node_decides_from_the_summed_values_alone() -> None:
    tensors = tuple(declare(trainable_parameters(_model())))
    plan = BucketPlan(buckets=((tensors[3], tensors[1]), (tensors[0], tensors[2], tensors[4], tensors[5])),
                      bucket_size=5000, is_hierarchical_reduce=True, version=2**40 + 7)
    index = {t.name: i for i, t in enumerate(tensors)}
    message = BoundaryMessage(registered=True, completed=False, iter_base=1_764_000_000_123_456,
                              plan=BoundaryMessage.pack(plan, index))

    def nodes_sum(contributions: list[torch.Tensor]) -> Callable[[torch.Tensor], bool]:
        def run(t: torch.Tensor) -> bool:
            t.copy_(sum(contributions[1:], contributions[0]) if t.numel() == contributions[0].numel()
                    else t)
            return True
        return run

    zeros = torch.zeros_like(encode_header(None, "job"))
    # The leader adds its decision; two other nodes add zeros: each node reads the leader's, exactly.
    header = encode_header(message, "job-7")
    payload = encode_buckets(message.plan[0] if message.plan else (), len(tensors))
    calls = iter([[header, zeros, zeros], [payload, torch.zeros_like(payload), torch.zeros_like(payload)]])

    def three(t: torch.Tensor) -> bool:
        return nodes_sum(next(calls))(t)

    decided = leader_decision(None, "other", tensors, sum_across_nodes=three)
    assert decided is not None and decided.plan == plan and decided.job_id == "job-7"
    assert decided.iter_base == message.iter_base and decided.registered and not decided.completed
    # Two nodes that both think they lead: no decision anywhere (each reads the same sum).
    assert leader_decision(None, "x", tensors, sum_across_nodes=nodes_sum([header, header])) is None
    # A failed sum: no decision on that node (its step does not commit).
    assert leader_decision(message, "job-7", tensors, sum_across_nodes=lambda t: False) is None
    # Buckets that are not every tensor once arrive as no plan, on every node alike.
    broken = payload.clone()
    broken[0] = broken[1]
    calls = iter([[header], [broken]])
    decided = leader_decision(None, "x", tensors, sum_across_nodes=three)
    assert decided is not None and decided.plan is None
