"""The service under big requests: a byte budget with LRU eviction, names refused, health never waits.

Every test runs a real gRPC server (threaded or grpc.aio) in this process on a free port,
so the test can reach into the service (the store, an event inside a registration).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
from bagua_lightning.services.autotune.aio_server import create_aio_server
from bagua_lightning.services.autotune.cli import _size_arg
from bagua_lightning.services.autotune.config import ServiceConfig
from bagua_lightning.services.autotune.errors import InvalidArgumentError, ResourceExhaustedError
from bagua_lightning.services.autotune.memory import Held, choose_evictions, registration_bytes
from bagua_lightning.services.autotune.metrics import ServiceCollector
from bagua_lightning.services.autotune.mirror import open_store
from bagua_lightning.services.autotune.server import create_server
from bagua_lightning.services.autotune.service import AutotuneService
from bagua_lightning.services.autotune.validation import check_name
from tests.procs import wait_until

DEADLINE_S = 20.0
FAST = {"warmup_time_s": 0.0, "sampling_confidence_time_s": 0.0}


def _tensors(prefix: str, n: int) -> list[Any]:
    return [pb.TensorDeclaration(name=f"{prefix}.w{i}", num_elements=1024 * (1 + i % 3), dtype="f32")
            for i in range(n)]


@contextlib.contextmanager
def _threaded(service: AutotuneService) -> Iterator[str]:
    server, port = create_server("127.0.0.1:0", service)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait()
        service.close()


@contextlib.contextmanager
def _aio(service: AutotuneService) -> Iterator[str]:
    """A grpc.aio server on its own event loop thread."""
    ready: dict[str, Any] = {}
    started, stop = threading.Event(), threading.Event()

    async def main() -> None:
        server, port, _ = create_aio_server("127.0.0.1:0", service)
        await server.start()
        ready["target"] = f"127.0.0.1:{port}"
        started.set()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, stop.wait)
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        assert started.wait(DEADLINE_S), "the aio server did not start"
        yield ready["target"]
    finally:
        stop.set()
        thread.join(DEADLINE_S)
        service.close()


SERVERS: dict[str, Callable[[AutotuneService], contextlib.AbstractContextManager[str]]] = {
    "threads": _threaded, "aio": _aio}


@contextlib.contextmanager
def _stub(target: str) -> Iterator[Any]:
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.AutotuneServiceStub(channel)


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as excinfo:
        call()
    return excinfo.value.code(), excinfo.value.details()


def _tune_to_completion(stub: Any, model: str) -> None:
    """One measured plan (max_samples=1): the session completes and persists its best plan."""
    stub.ReportMetrics(pb.ReportMetricsRequest(model_name=model, rank=0, train_iter=0, speed=10.0),
                       timeout=DEADLINE_S)
    assert stub.AskHyperparameters(pb.AskHyperparametersRequest(model_name=model, rank=0, train_iter=1),
                                   timeout=DEADLINE_S).is_autotune_completed


@pytest.mark.parametrize("kind", ["threads", "aio"])
def test_byte_budget_evicts_the_least_recently_used_and_keeps_its_best_plan(tmp_path: Path, kind: str) -> None:
    n = 200
    one = registration_bytes(n, sum(len(t.name) for t in _tensors("a", n)))
    ticks = itertools.count()
    store = open_store(str(tmp_path / "plans"))
    service = AutotuneService(ServiceConfig(max_memory=int(2.5 * one), max_samples=1, **FAST), store=store,
                              clock=lambda: float(next(ticks)))
    with SERVERS[kind](service) as target, _stub(target) as stub:
        register = pb.RegisterTensorsRequest(model_name="b", tensor_list=_tensors("b", n), whether_to_bucket=True)
        stub.RegisterTensors(register, timeout=DEADLINE_S)
        _tune_to_completion(stub, "b")
        stub.RegisterTensors(pb.RegisterTensorsRequest(model_name="a", tensor_list=_tensors("a", n)),
                             timeout=DEADLINE_S)
        assert sorted(service.model_names) == ["a", "b"]  # two fit
        stub.AskHyperparameters(pb.AskHyperparametersRequest(model_name="a", rank=0, train_iter=5),
                                timeout=DEADLINE_S)  # "a" used after "b": "b" is the least recently used
        stub.RegisterTensors(pb.RegisterTensorsRequest(model_name="c", tensor_list=_tensors("c", n)),
                             timeout=DEADLINE_S)
        assert sorted(service.model_names) == ["a", "c"]
        assert service.memory.evicted_for_bytes == 1
        assert 0 < service.memory.total <= service.config.max_memory
        code, details = _code(lambda: stub.DescribeModel(pb.DescribeModelRequest(model_name="b"),
                                                         timeout=DEADLINE_S))
        assert code == grpc.StatusCode.NOT_FOUND and "evicted" in details
        # The evicted model's best plan is in the store, and a new registration starts from it.
        def stored_best() -> list[Any]:
            stored = [store.load(k) for k in _store_keys(tmp_path / "plans")]  # type: ignore[union-attr]
            return [s for s in stored if s is not None and s.model_name == "b" and s.completed]

        wait_until(lambda: bool(stored_best()), DEADLINE_S, "the evicted model's best plan in the store")
        best = stored_best()
        assert len(best) == 1
        again = stub.RegisterTensors(register, timeout=DEADLINE_S).recommended_hyperparameters
        assert [[t.name for t in b.tensors] for b in again.buckets] == best[0].plan.tensor_names


def _store_keys(directory: Path) -> list[str]:
    return [p.stem for p in directory.iterdir() if p.suffix == ".json"]


@pytest.mark.parametrize("kind", ["threads", "aio"])
def test_a_registration_larger_than_the_budget_is_resource_exhausted(kind: str) -> None:
    service = AutotuneService(ServiceConfig(max_memory=64 * 1024, **FAST))
    with SERVERS[kind](service) as target, _stub(target) as stub:
        code, details = _code(lambda: stub.RegisterTensors(
            pb.RegisterTensorsRequest(model_name="huge", tensor_list=_tensors("h", 1000)), timeout=DEADLINE_S))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-memory" in details and "64.0 KiB" in details and "'huge'" in details
        assert service.model_names == []


BAD_NAMES = {"newline": "m\nforged line", "nul": "m\x00", "tab": "m\tx", "format": "m\u200bx",
             "line separator": "m\u2028x"}


@pytest.mark.parametrize("bad", sorted(BAD_NAMES))
def test_names_with_control_characters_are_invalid_argument(bad: str) -> None:
    name = BAD_NAMES[bad]
    service = AutotuneService(ServiceConfig(**FAST))
    with SERVERS["aio"](service) as target, _stub(target) as stub:
        stub.RegisterTensors(pb.RegisterTensorsRequest(model_name="ok", tensor_list=_tensors("ok", 3)),
                             timeout=DEADLINE_S)
        calls = {
            "register": lambda: stub.RegisterTensors(
                pb.RegisterTensorsRequest(model_name=name, tensor_list=_tensors("x", 3)), timeout=DEADLINE_S),
            "register tensor": lambda: stub.RegisterTensors(pb.RegisterTensorsRequest(
                model_name="fine", tensor_list=[pb.TensorDeclaration(name=name, num_elements=4, dtype="f32")]),
                timeout=DEADLINE_S),
            "report": lambda: stub.ReportMetrics(
                pb.ReportMetricsRequest(model_name=name, rank=0, train_iter=0, speed=1.0), timeout=DEADLINE_S),
            "ask": lambda: stub.AskHyperparameters(
                pb.AskHyperparametersRequest(model_name=name, rank=0, train_iter=0), timeout=DEADLINE_S),
            "describe": lambda: stub.DescribeModel(pb.DescribeModelRequest(model_name=name), timeout=DEADLINE_S),
        }
        for what, call in calls.items():
            code, details = _code(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
            assert "control character" in details and f"U+{ord(name[1]):04X}" in details, (what, details)
        assert service.model_names == ["ok"]


class _GatedService(AutotuneService):
    """A service whose registrations wait, once inside, until the test lets them finish."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.release = threading.Event(), threading.Event()

    def register_session(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        if not self.release.wait(DEADLINE_S):
            raise TimeoutError("the test never released the registration")
        return super().register_session(*args, **kwargs)


@pytest.mark.parametrize("kind", ["threads", "aio"])
def test_health_answers_while_a_large_registration_is_in_flight(kind: str) -> None:
    service = _GatedService(ServiceConfig(**FAST))
    order: list[str] = []
    with SERVERS[kind](service) as target, grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AutotuneServiceStub(channel)
        request = pb.RegisterTensorsRequest(model_name="big", tensor_list=_tensors("big", 20_000))
        future = stub.RegisterTensors.future(request, timeout=DEADLINE_S)
        assert service.entered.wait(DEADLINE_S), "the registration never reached the service"
        health = health_pb2_grpc.HealthStub(channel)
        # Were health queued behind the registration, this call would hit its deadline: the registration
        # waits for `release`, which is set only after health answered.
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=DEADLINE_S / 2)
        order.append("health")
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert not future.done()
        service.release.set()
        plan = future.result(timeout=DEADLINE_S).recommended_hyperparameters
        order.append("register")
        assert sum(len(b.tensors) for b in plan.buckets) == 20_000
        # Small requests, too, answer while no big one blocks.
        assert stub.DescribeModel(pb.DescribeModelRequest(model_name="big"),
                                  timeout=DEADLINE_S).summary.tensors == 20_000
    assert order == ["health", "register"]


def test_eviction_order_and_budget_arithmetic() -> None:
    held = [Held("old", 1.0, 40), Held("mid", 2.0, 40), Held("new", 3.0, 40)]
    assert choose_evictions(held, budget=120, keep="new") == []
    assert choose_evictions(held, budget=100, keep="new") == ["old"]
    assert choose_evictions(held, budget=50, keep="old") == ["mid", "new"]  # the one just used stays
    assert choose_evictions(held, budget=0, keep="new") == []  # 0: no budget


def test_check_name_refuses_each_category_and_accepts_printable_unicode() -> None:
    check_name("model_name", "résumé-模型.layer0 weight", 1024)  # printable, non-ASCII, a space: fine
    for bad, category in (("a\nb", "Cc"), ("a\x00", "Cc"), ("a\u200eb", "Cf"), ("a\u2029", "Zp")):
        with pytest.raises(InvalidArgumentError, match=f"category {category}"):
            check_name("model_name", bad, 1024)
    with pytest.raises(InvalidArgumentError, match="model_name is empty"):
        check_name("model_name", "", 1024)
    with pytest.raises(ResourceExhaustedError, match="--max-name-bytes"):
        check_name("model_name", "x" * 300, 256)


def test_max_memory_is_parsed_validated_and_exported() -> None:
    assert _size_arg("2GiB") == 2 * 1024**3 and _size_arg("512mb") == 512 * 1024**2
    with pytest.raises(argparse.ArgumentTypeError, match="not bytes"):
        _size_arg("lots")
    with pytest.raises(ConfigurationError, match="max_memory"):
        ServiceConfig(max_memory=-1)
    service = AutotuneService(ServiceConfig(max_memory=123_456_789, **FAST))
    try:
        service.register("m", [("w", 4, "f32")], True)
        families = {m.name: m.samples[0].value for m in ServiceCollector(service).collect() if m.samples}
    finally:
        service.close()
    assert families["bagua_autotune_memory_budget_bytes"] == 123_456_789
    assert families["bagua_autotune_memory_accounted_bytes"] == service.memory.total > 0
    assert families["bagua_autotune_models_evicted_for_memory"] == 0
