"""AutotuneClient against a real in-process gRPC server: dict inputs, deadlines, retries, health."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from bagua_lightning.client import AutotuneClient
from bagua_lightning.client.retry import ExponentialBackoff, Retry
from bagua_lightning.errors import ServiceUnavailableError
from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from bagua_lightning.proto.plan import BucketPlan, BucketTimingRecord, plan_from_proto
from bagua_lightning.services.autotune.config import ServiceConfig
from bagua_lightning.services.autotune.server import create_server
from bagua_lightning.services.autotune.service import AutotuneService
from bagua_lightning.services.autotune.servicer import AutotuneServicer
from tests.procs import free_port

MB = 1024**2
TENSORS = [{"name": n, "num_elements": s * MB // 4, "dtype": "f32"} for n, s in zip("ABCDE", [4, 8, 12, 16, 20],
                                                                                      strict=True)]


def _service() -> AutotuneService:
    return AutotuneService(ServiceConfig(warmup_time_s=0, sampling_confidence_time_s=0, world_size=2))


@pytest.fixture
def server_target() -> Iterator[str]:
    server, port = create_server("127.0.0.1:0", _service())
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_plain_dicts_in_baguas_shape(server_target: str) -> None:
    with AutotuneClient(target=server_target) as client:
        reply = client.register_tensors("m", TENSORS)
        plan = plan_from_proto(reply.recommended_hyperparameters)
        as_dict = plan.to_dict()  # {"buckets": [[{name, num_elements, dtype}]], "bucket_size", ...}
        timings = [{"bucket_index": i, "bytes": b, "ready_ms": 1.0 + i, "comm_ms": 0.5, "wait_ms": 0.0}
                   for i, b in enumerate(plan.bucket_bytes)]
        assert client.report_metrics("m", 0, 0, as_dict, 100.0, timings, backward_ms=5.0).accepted
        assert client.report_metrics("m", 1, 0, plan, 100.0,
                                     [BucketTimingRecord(**t) for t in timings]).accepted  # dataclasses too
        assert client.report_metrics("m", 0, 1, {"recommended_hyperparameters": as_dict}, 90.0).accepted
        assert not client.report_metrics("m", 0, 1, reply, 90.0).accepted  # a response message; duplicate
        spans = [{"trace_id": 1, "action": "tensor_ready", "tensor_name": n, "start_time": i, "end_time": i}
                 for i, n in enumerate("EDCBA")]
        client.report_tensor_execution_order(spans, model_name="m")
        asked = client.ask_hyperparameters("m", 0, 2)
        assert isinstance(plan_from_proto(asked.recommended_hyperparameters), BucketPlan)
        with pytest.raises(ValueError, match="unknown keys"):
            client.register_tensors("m", [{"name": "A", "elements": 3}])


def test_retries_until_the_service_comes_up() -> None:
    port = free_port()
    holder: dict[str, Any] = {}

    def start_later() -> None:
        time.sleep(0.7)
        server, _ = create_server(f"127.0.0.1:{port}", _service())
        server.start()
        holder["server"] = server

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        retry = Retry(backoff=ExponentialBackoff(base_s=0.1, cap_s=0.5), retries=20,
                      retryable=lambda e: isinstance(e, grpc.RpcError)
                      and e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))
        with AutotuneClient(target=f"127.0.0.1:{port}", timeout_s=1.0, retry=retry) as client:
            reply = client.register_tensors("m", TENSORS)
        assert len(reply.recommended_hyperparameters.buckets) == 4
    finally:
        thread.join()
        if "server" in holder:
            holder["server"].stop(grace=None)


def test_gives_up_with_a_clear_error_and_health_is_false(caplog: pytest.LogCaptureFixture) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    retry = Retry(backoff=ExponentialBackoff(base_s=0.01, cap_s=0.02), retries=3,
                  retryable=lambda e: isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE)
    with AutotuneClient(target=target, timeout_s=0.5, retry=retry) as client, \
            caplog.at_level(logging.DEBUG, logger="bagua_lightning.client.autotune"):
        with pytest.raises(ServiceUnavailableError, match="did not answer AskHyperparameters"):
            client.ask_hyperparameters("m", 0, 0)
        assert sum("retry" in r.getMessage() for r in caplog.records) == 3
        assert client.health_check(timeout_s=0.2) is False  # never raises
        with pytest.raises(ServiceUnavailableError, match="not reachable"):
            client.wait_until_ready(timeout_s=0.3)


class _SlowServicer(AutotuneServicer):
    def AskHyperparameters(self, request: Any, context: grpc.ServicerContext) -> Any:
        time.sleep(1.0)
        return super().AskHyperparameters(request, context)


def test_every_call_has_a_deadline() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_AutotuneServiceServicer_to_server(_SlowServicer(_service()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        retry = Retry(backoff=ExponentialBackoff(base_s=0.01, cap_s=0.02), retries=1,
                      retryable=lambda e: isinstance(e, grpc.RpcError)
                      and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
        with AutotuneClient(target=f"127.0.0.1:{port}", timeout_s=0.2, retry=retry) as client:
            client.register_tensors("m", TENSORS)
            with pytest.raises(ServiceUnavailableError, match="DEADLINE_EXCEEDED") as excinfo:
                client.ask_hyperparameters("m", 0, 0)
            assert excinfo.value.__cause__.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[union-attr]
    finally:
        server.stop(grace=None)


def test_backoff_grows_and_is_capped() -> None:
    backoff = ExponentialBackoff(base_s=0.1, cap_s=0.4)
    assert [backoff.compute(n) <= w for n, w in [(1, 0.1), (2, 0.2), (3, 0.4), (10, 0.4)]] == [True] * 4
    assert backoff.compute(10) >= 0.2
    with pytest.raises(ValueError, match="base_s"):
        ExponentialBackoff(base_s=1.0, cap_s=0.5)
