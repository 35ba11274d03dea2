"""The service's cache of encoded plans counts in --max-memory, and serving health cannot be starved.

Real gRPC servers in this process on free ports, so the test can look at the encoded plans' cache and the
service's accounting.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from bagua_lightning.proto.plan import plan_from_proto
from bagua_lightning.services.autotune import wire
from bagua_lightning.services.autotune.config import ServiceConfig
from bagua_lightning.services.autotune.memory import registration_bytes, session_bytes
from bagua_lightning.services.autotune.readiness import SERVICE_NAME
from bagua_lightning.services.autotune.server import create_server
from bagua_lightning.services.autotune.service import AutotuneService
from bagua_lightning.services.autotune.servicer import AutotuneServicer

DEADLINE_S = 20.0
FAST = {"warmup_time_s": 0.0, "sampling_confidence_time_s": 0.0}
TENSORS = 300
MODELS = 12
NAME = "x" * 200  # long names: each model's encoded plan is ~60 KiB


def _tensors(model: str) -> list[Any]:
    return [pb.TensorDeclaration(name=f"{model}.{NAME}.{i}", num_elements=1 + i, dtype="f32")
            for i in range(TENSORS)]


@contextlib.contextmanager
def _serving(servicer: AutotuneServicer) -> Iterator[Any]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    wire.add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.AutotuneServiceStub(channel)
    finally:
        server.stop(grace=None).wait()
        servicer.service.close()


def _cached_models(service: AutotuneService) -> set[tuple[str, str]]:
    return {key[:2] for key, _ in service.plans.items()}


def test_cached_encodings_count_in_the_budget_and_go_with_evicted_models() -> None:
    one = registration_bytes(TENSORS, sum(len(t.name) for t in _tensors("m0")))
    budget = int(3.5 * one)
    service = AutotuneService(ServiceConfig(max_memory=budget, max_samples=3, **FAST))
    servicer = AutotuneServicer(service)
    encoded_total = 0
    with _serving(servicer) as stub:
        for m in range(MODELS):
            model = f"m{m}"
            reply = stub.RegisterTensors(pb.RegisterTensorsRequest(model_name=model, tensor_list=_tensors(model),
                                                                   whether_to_bucket=True), timeout=DEADLINE_S)
            encoded_total += len(reply.recommended_hyperparameters.SerializeToString())
            # A second plan version per model (a report, then an ask): two encodings cached for it.
            stub.ReportMetrics(pb.ReportMetricsRequest(model_name=model, rank=0, train_iter=0, speed=1.0),
                               timeout=DEADLINE_S)
            ask = stub.AskHyperparameters(pb.AskHyperparametersRequest(model_name=model, rank=0, train_iter=1),
                                          timeout=DEADLINE_S)
            encoded_total += len(ask.recommended_hyperparameters.SerializeToString())
            held = service.session(model)
            # Answers are the session's plan, decoded from the cached bytes.
            assert plan_from_proto(ask.recommended_hyperparameters) == held.current_plan
            assert held.current_plan.version >= 1
            assert service.plans.cached_bytes() <= service.memory.total <= budget
        assert encoded_total > budget  # what was encoded does not fit: the cache must have let go
        assert 0 < service.evicted < MODELS
        held_models = {("", name) for name in service.model_names}
        assert _cached_models(service) <= held_models  # evicted models' encodings are gone
        assert service.plans.cached_bytes() == service.memory.cached_total > 0
        for _, name in held_models:
            # Each held model's share: its session's estimate plus its cached encodings.
            session = service.session(name)
            own = sum(len(v.encoded) + 256 for k, v in service.plans.items() if k[:2] == ("", name))
            names = sum(len(t.name) for t in session.registration.tensors)
            assert service.memory.bytes_of(("", name)) == session_bytes(session, names) + own
            described = stub.DescribeModel(pb.DescribeModelRequest(model_name=name), timeout=DEADLINE_S)
            assert plan_from_proto(described.current) == session.current_plan
        evicted = sorted({f"m{m}" for m in range(MODELS)} - {name for _, name in held_models})
        assert evicted and all(("", name) not in _cached_models(service) for name in evicted)


class _BlockingService(AutotuneService):
    """Describes block until released: each in-flight one holds a server thread."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def describe(self, model_name: str, job_id: str = "") -> Any:
        self.entered.release()
        if not self.release.wait(DEADLINE_S):
            raise TimeoutError("the test never released the describes")
        return super().describe(model_name, job_id)


def test_threaded_server_answers_health_while_every_worker_holds_a_big_request() -> None:
    workers = 2
    service = _BlockingService(ServiceConfig(**FAST))
    server, port = create_server("127.0.0.1:0", service, max_workers=workers)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.AutotuneServiceStub(channel)
            stub.RegisterTensors(pb.RegisterTensorsRequest(model_name="big", tensor_list=_tensors("big")),
                                 timeout=DEADLINE_S)
            pending = [stub.DescribeModel.future(pb.DescribeModelRequest(model_name="big"), timeout=DEADLINE_S)
                       for _ in range(workers + 1)]  # one more than there are workers: it queues
            for _ in range(workers):
                assert service.entered.acquire(timeout=DEADLINE_S), "a describe never reached the service"
            # Every worker now waits for `release`, set only after health answered: were health checks
            # served by those workers, this call would hit its deadline.
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE_NAME):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=DEADLINE_S / 2)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert not any(f.done() for f in pending)
            service.release.set()
            for f in pending:
                assert f.result(timeout=DEADLINE_S).summary.tensors == TENSORS
    finally:
        service.release.set()
        server.stop(grace=None).wait()
        service.close()
