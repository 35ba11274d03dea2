"""AutotuneClient against a real in-process gRPC server: typed results, project errors, dict inputs, deadlines,
retries, health, tokens and address validation."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from bagua_lightning.client import AutotuneClient
from bagua_lightning.client.autotune_records import PlanAnswer
from bagua_lightning.client.retry import ExponentialBackoff, Retry
from bagua_lightning.core.errors import (
    AutotuneAuthenticationError,
    AutotuneRequestRejectedError,
    ModelNotRegisteredError,
    ServiceUnavailableError,
)
from bagua_lightning.proto.plan import BucketPlan, BucketTimingRecord
from bagua_lightning.services.autotune import wire
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


def test_typed_results_and_dicts_in_baguas_shape(server_target: str) -> None:
    with AutotuneClient(target=server_target) as client:
        plan = client.register_tensors("m", TENSORS)
        assert isinstance(plan, BucketPlan) and plan.tensor_names == [["A", "B"], ["C"], ["D"], ["E"]]
        as_dict = plan.to_dict()  # {"buckets": [[{name, num_elements, dtype}]], "bucket_size", ...}
        timings = [{"bucket_index": i, "bytes": b, "ready_ms": 1.0 + i, "comm_ms": 0.5, "wait_ms": 0.0}
                   for i, b in enumerate(plan.bucket_bytes)]
        assert client.report_metrics("m", 0, 0, as_dict, 100.0, timings, backward_ms=5.0) is True
        assert client.report_metrics("m", 1, 0, plan, 100.0,
                                     [BucketTimingRecord(**t) for t in timings]) is True  # dataclasses too
        assert client.report_metrics("m", 0, 1, None, 90.0) is True  # None: the plan handed back for the iter
        assert client.report_metrics("m", 0, 1, plan, 90.0) is False  # a duplicate
        spans = [{"trace_id": 1, "action": "tensor_ready", "tensor_name": n, "start_time": i, "end_time": i}
                 for i, n in enumerate("EDCBA")]
        client.report_tensor_execution_order(spans, model_name="m")
        asked = client.ask_hyperparameters("m", 0, 2)
        assert isinstance(asked, PlanAnswer) and isinstance(asked.plan, BucketPlan) and asked.completed is False
        with pytest.raises(ValueError, match="unknown keys"):
            client.register_tensors("m", [{"name": "A", "elements": 3}])
        with pytest.raises(TypeError, match="BucketPlan or a dict"):
            client.report_metrics("m", 0, 3, [plan], 1.0)  # type: ignore[arg-type]


def test_refusals_raise_the_projects_errors(server_target: str) -> None:
    with AutotuneClient(target=server_target, retry=Retry(ExponentialBackoff(), 0, lambda e: False)) as client:
        with pytest.raises(ModelNotRegisteredError, match="'nobody'") as missing:
            client.ask_hyperparameters("nobody", 0, 0)
        assert missing.value.code == "NOT_FOUND" and isinstance(missing.value, LookupError)
        plan = client.register_tensors("m", TENSORS)
        with pytest.raises(AutotuneRequestRejectedError, match="speed") as bad:
            client.report_metrics("m", 0, 0, plan, -1.0)
        assert bad.value.code == "INVALID_ARGUMENT" and isinstance(bad.value, ValueError)
        with pytest.raises(AutotuneRequestRejectedError, match="different tensor_list"):
            client.register_tensors("m", TENSORS[:2])


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"host": "127.0.0.1", "port": 95136}, "95136"),
    ({"host": "127.0.0.1", "port": 0}, "port 0 is not a TCP port"),
    ({"host": "127.0.0.1", "port": True}, "True"),
    ({"host": "not a host", "port": 29600}, "'not a host'"),
    ({"target": "127.0.0.1:99999"}, "'127.0.0.1:99999'"),
    ({"target": "localhost"}, "'localhost'"),
])
def test_bad_addresses_name_the_value(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        AutotuneClient(**kwargs)


def test_token_required_and_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BAGUA_LIGHTNING_AUTOTUNE_TOKEN", raising=False)
    server, port = create_server("127.0.0.1:0", _service(), token="s3cret-token")
    server.start()
    try:
        no_retry = Retry(ExponentialBackoff(), 0, lambda e: False)
        with AutotuneClient(port=port, retry=no_retry) as anonymous:
            assert anonymous.health_check() is True  # probes need no token
            with pytest.raises(AutotuneAuthenticationError, match="requires a token"):
                anonymous.register_tensors("m", TENSORS)
        with AutotuneClient(port=port, token="wrong", retry=no_retry) as wrong:
            with pytest.raises(AutotuneAuthenticationError) as excinfo:
                wrong.list_models()
            assert excinfo.value.code == "UNAUTHENTICATED"
        with AutotuneClient(port=port, token="s3cret-token") as good:
            assert good.register_tensors("m", TENSORS).version == 0
        monkeypatch.setenv("BAGUA_LIGHTNING_AUTOTUNE_TOKEN", "s3cret-token")
        with AutotuneClient(port=port) as from_env:  # the token defaults from the environment
            assert [m.model_name for m in from_env.list_models()] == ["m"]
    finally:
        server.stop(grace=None)


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
            plan = client.register_tensors("m", TENSORS)
        assert len(plan.buckets) == 4
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
    wire.add_to_server(_SlowServicer(_service()), server)  # its replies are pre-encoded bytes
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
