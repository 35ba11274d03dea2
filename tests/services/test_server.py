"""Acceptance: the real service process on a free port, driven by OS processes acting as trainer ranks."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.client.autotune_records import PlanAnswer
from bagua_lightning.core.errors import AutotuneError
from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from bagua_lightning.services.autotune.samplelog import log_file_name
from tests.procs import free_port, running, wait_until
from tests.services import simulated_trainers
from tests.services.conftest import FAST, no_retry_client, raw_stub, rpc_code

MB = 1024**2


def _pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def _names(reply: BucketPlan | PlanAnswer) -> list[list[str]]:
    return (reply.plan if isinstance(reply, PlanAnswer) else reply).tensor_names


def test_health_and_reflection(shared_service: str) -> None:
    target = shared_service
    with AutotuneClient(target=target) as client:
        assert client.health_check() is True
        with grpc.insecure_channel(target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=5)
            names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"bagua_lightning.autotune.v1.AutotuneService", "grpc.health.v1.Health"} <= names


def test_every_rpc_in_the_proto_is_served(shared_service: str) -> None:
    """Each RPC the proto descriptor declares reaches a servicer method (never UNIMPLEMENTED): the servers
    take their table from the descriptor, so a new RPC needs no list of its own."""
    service = pb.DESCRIPTOR.services_by_name["AutotuneService"]
    answered = {}
    with grpc.insecure_channel(shared_service) as channel:
        for method in service.methods:
            call = channel.unary_unary(f"/{service.full_name}/{method.name}",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=lambda b: b)
            try:
                call(getattr(pb, method.input_type.name)(), timeout=10)
                answered[method.name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                answered[method.name] = exc.code()
    assert len(answered) == len(service.methods) >= 8
    assert grpc.StatusCode.UNIMPLEMENTED not in answered.values(), answered


def test_abcde_partition_under_a_score_peaking_at_20mb(start_service) -> None:
    """Speed-only ranks in two processes; the Bayesian search lands on buckets cut at ~20 MB: [A,B,C], [D,E]."""
    with start_service(*FAST, "--max-samples", "12") as (target, _):
        with AutotuneClient(target=target) as client:
            first = client.register_tensors("abcde", [t.to_dict() for t in simulated_trainers.abcde()], world_size=4,
                                            nproc_per_node=2)
        assert _names(first) == [["A", "B"], ["C"], ["D"], ["E"]]  # the default plan: 10 MiB cuts
        with _pool(2) as pool:
            outs = [f.result(timeout=120) for f in
                    [pool.submit(simulated_trainers.speed_only_rank, target, "abcde", rs, 200) for rs in ([0, 1], [2, 3])]]
        with AutotuneClient(target=target) as client:
            final = client.ask_hyperparameters("abcde", 0, 10_000)
    assert final.completed
    assert _names(final) == [["A", "B", "C"], ["D", "E"]]
    assert not final.plan.is_hierarchical_reduce
    assert 16 * MB < final.plan.bucket_size <= 24 * MB
    # Every rank saw the same plan at every iteration.
    by_iter: dict[int, set[str]] = defaultdict(set)
    for out in outs:
        for seen in out["results"].values():
            for it, fingerprint, _, _ in seen:
                by_iter[it].add(fingerprint)
    assert by_iter and all(len(v) == 1 for v in by_iter.values())


def test_mixed_dtypes_are_cut_per_dtype(shared_service: str) -> None:
    tensors = [{"name": f"w{i}", "num_elements": 5 * MB // 4, "dtype": "f16" if i % 2 else "f32"} for i in range(8)]
    with AutotuneClient(target=shared_service) as c:
        plan = c.register_tensors("mixed", tensors)
    # f32 first (first seen), each bucket one dtype, closed at the default 10 MiB: 2 f32 (5 MiB) or
    # 4 f16 (2.5 MiB) tensors per bucket.
    assert plan.tensor_names == [["w0", "w2"], ["w4", "w6"], ["w1", "w3", "w5", "w7"]]
    assert [{t.dtype for t in b} for b in plan.buckets] == [{"f32"}, {"f32"}, {"f16"}]


def test_execution_order_changes_the_cut_order(shared_service: str) -> None:
    with AutotuneClient(target=shared_service) as client:
        first = client.register_tensors("order", [t.to_dict() for t in simulated_trainers.abcde()])
        assert _names(first) == [["A", "B"], ["C"], ["D"], ["E"]]  # registration order, closed at 10 MiB
        spans = [{"trace_id": 7, "action": "tensor_ready", "tensor_name": n, "start_time": 100 * i,
                  "end_time": 100 * i + 5} for i, n in enumerate("EDCBA")]
        client.report_tensor_execution_order(spans)  # no model_name: found by its tensor names
        after = client.ask_hyperparameters("order", 0, 1)
    assert _names(after) == [["E"], ["D"], ["C"], ["B", "A"]]
    assert after.plan.version > first.version


def test_64_ranks_over_4_models_lose_no_report(start_service, tmp_path: Path) -> None:
    """4 processes, each acting as 4 ranks of each of 4 models (16 ranks per model): no error, no lost report."""
    models = [f"model{i}" for i in range(4)]
    logs = tmp_path / "samples"
    with start_service(*FAST, "--max-samples", "6", "--log-dir", str(logs)) as (target, _):
        with _pool(4) as pool:
            futures = [pool.submit(simulated_trainers.timed_ranks, target, models, list(range(p * 4, p * 4 + 4)), 16, 8)
                       for p in range(4)]
            outs = [f.result(timeout=180) for f in futures]
        with AutotuneClient(target=target) as client:
            finals = {m: client.ask_hyperparameters(m, 0, 10_000) for m in models}
        # The sample log is written behind the answers, by the service's writer thread: wait for it while the
        # service runs (a loaded machine may not let it finish within the stop's grace period).
        wait_until(lambda: all((logs / log_file_name(m)).exists() for m in models), 60, "every model's sample log")
    errors = [e for o in outs for e in o["errors"]]
    assert errors == []
    accepted = [a for o in outs for a in o["accepted"]]
    assert len(accepted) == 4 * 16 * 8 and all(accepted)  # every report recorded ...
    assert not any(d for o in outs for d in o["duplicates"])  # ... exactly once: the resend is ignored
    plans: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    for o in outs:
        for model, it, _, fingerprint, version in o["plans"]:
            plans[(model, it)].add((fingerprint, version))
    assert len(plans) == 4 * 8 and all(len(v) == 1 for v in plans.values())  # identical plans per train_iter
    assert all(f.completed for f in finals.values())
    for model in models:
        lines = [json.loads(line) for line in (logs / log_file_name(model)).read_text().splitlines()]
        assert lines and {"train_iter", "buckets", "score"} <= set(lines[0])


@pytest.mark.parametrize("state", ["dir", "redis"])
def test_best_plan_survives_a_restart(start_service, tmp_path: Path, state: str) -> None:
    if state == "redis":
        redis_port = free_port()
        ctx = running(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no",
                       "--dir", str(tmp_path)])
        location = f"redis://127.0.0.1:{redis_port}/0"
    else:
        ctx = running(["true"])
        location = str(tmp_path / "plans")
    job = simulated_trainers.sim_job(0)
    tensors = [t.to_dict() for t in job.tensors]
    with ctx:
        if state == "redis":
            import redis
            wait_until(lambda: redis.Redis(port=redis_port, socket_timeout=1).ping(), 20, "redis-server")
        args = (*FAST, "--max-samples", "4", "--state", location)
        with start_service(*args) as (target, _), AutotuneClient(target=target) as client:
            client.register_tensors("persisted", tensors, world_size=4, nproc_per_node=2)
            for it in range(10):
                reply = client.ask_hyperparameters("persisted", 0, it)
                if reply.completed:
                    break
                speed, timings, backward_ms = job.measure(reply.plan)
                client.report_metrics("persisted", 0, it, reply.plan, speed, timings, backward_ms=backward_ms)
            assert reply.completed
            best = reply.plan
        # A new process, a new job of the same model shape (another name): the best plan comes back, as the
        # plan it starts from (it measures it itself before it counts as tuned).
        with start_service(*args) as (target, _), AutotuneClient(target=target) as client:
            again = client.register_tensors("persisted-job2", tensors, world_size=4, nproc_per_node=2)
            assert again.same_layout(best)
            assert not client.ask_hyperparameters("persisted-job2", 0, 0).completed
            # Another placement is another key: the default plan.
            other = client.register_tensors("persisted-job3", tensors, world_size=8, nproc_per_node=8)
            assert not other.same_layout(best)


def _register(client: AutotuneClient, name: str = "bad", **kwargs: object) -> object:
    return client.register_tensors(name, kwargs.pop("tensors", [t.to_dict() for t in simulated_trainers.abcde()]), **kwargs)


def _decl(name: str, n: int, dtype: str) -> pb.TensorDeclaration:
    return pb.TensorDeclaration(name=name, num_elements=n, dtype=dtype)


BAD_REGISTRATIONS = [
    ("empty list", {"tensors": []}, grpc.StatusCode.INVALID_ARGUMENT, "tensor_list is empty"),
    ("duplicate", {"tensors": [_decl("w", 4, "f32"), _decl("w", 4, "f32")]}, grpc.StatusCode.INVALID_ARGUMENT,
     "tensor_list[1].name 'w' is a duplicate"),
    ("zero elements", {"tensors": [_decl("w", 0, "f32")]}, grpc.StatusCode.INVALID_ARGUMENT,
     "num_elements of tensor 'w' must be > 0"),
    ("negative elements", {"tensors": [_decl("w", -3, "f32")]}, grpc.StatusCode.INVALID_ARGUMENT, "got -3"),
    ("unknown dtype", {"tensors": [_decl("w", 4, "f128")]}, grpc.StatusCode.INVALID_ARGUMENT, "'f128'"),
    ("too many tensors", {"tensors": [_decl(f"w{i}", 4, "f32") for i in range(65)]},
     grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-tensors"),
    ("oversized message", {"tensors": [_decl("w" * 70_000, 4, "f32")]}, grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ("world size", {"world_size": 2, "nproc_per_node": 3}, grpc.StatusCode.INVALID_ARGUMENT, "nproc_per_node"),
]


@pytest.mark.parametrize(("case", "kwargs", "code", "message"), BAD_REGISTRATIONS, ids=[c[0] for c in BAD_REGISTRATIONS])
def test_bad_registrations(shared_service: str, case: str, kwargs: dict[str, object], code: grpc.StatusCode,
                           message: str) -> None:
    channel, stub = raw_stub(shared_service)
    with channel, no_retry_client(shared_service) as client:
        request = pb.RegisterTensorsRequest(
            model_name=f"bad-{case}", tensor_list=kwargs.get("tensors", [_decl(t.name, t.num_elements, t.dtype)
                                                                          for t in simulated_trainers.abcde()]),
            world_size=kwargs.get("world_size", 0), nproc_per_node=kwargs.get("nproc_per_node", 0))
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.RegisterTensors(request, timeout=10)
        assert excinfo.value.code() == code  # type: ignore[attr-defined]
        assert message in excinfo.value.details()  # type: ignore[attr-defined]
        assert client.health_check()  # the service keeps serving


def test_bad_reports_asks_and_orders(shared_service: str) -> None:
    with no_retry_client(shared_service) as client:
        plan = _register(client, "target")
        cases = [
            (lambda: client.ask_hyperparameters("nobody", 0, 0), grpc.StatusCode.NOT_FOUND, "'nobody'"),
            (lambda: client.report_metrics("nobody", 0, 0, plan, 1.0), grpc.StatusCode.NOT_FOUND, "RegisterTensors"),
            (lambda: client.ask_hyperparameters("target", 4, 0), grpc.StatusCode.INVALID_ARGUMENT, "rank"),
            (lambda: client.ask_hyperparameters("target", -1, 0), grpc.StatusCode.INVALID_ARGUMENT, "got -1"),
            (lambda: client.ask_hyperparameters("target", 0, -5), grpc.StatusCode.INVALID_ARGUMENT, "train_iter"),
            (lambda: client.report_metrics("target", 0, 1, plan, math.nan), grpc.StatusCode.INVALID_ARGUMENT,
             "speed"),
            (lambda: client.report_metrics("target", 0, 1, plan, -2.0), grpc.StatusCode.INVALID_ARGUMENT, "-2.0"),
            (lambda: client.report_metrics("target", 0, 1, plan, 1.0, [{"bucket_index": 9, "bytes": 1}]),
             grpc.StatusCode.INVALID_ARGUMENT, "bucket_timings[0].bucket_index"),
            (lambda: client.report_metrics("target", 0, 1, plan, 1.0, [{"bucket_index": 0, "comm_ms": -1.0}]),
             grpc.StatusCode.INVALID_ARGUMENT, "bucket_timings[0].comm_ms"),
            (lambda: client.report_metrics("target", 0, 1, {"buckets": [[{"name": "Z", "num_elements": 1}]]}, 1.0),
             grpc.StatusCode.INVALID_ARGUMENT, "hyperparameters.buckets"),
            (lambda: client.register_tensors("target", [{"name": "A", "num_elements": 1, "dtype": "f32"}]),
             grpc.StatusCode.FAILED_PRECONDITION, "different tensor_list"),
            (lambda: client.report_tensor_execution_order([]), grpc.StatusCode.INVALID_ARGUMENT, "spans is empty"),
            (lambda: client.report_tensor_execution_order([{"tensor_name": "Q"}], model_name="target"),
             grpc.StatusCode.INVALID_ARGUMENT, "'Q'"),
            (lambda: client.report_tensor_execution_order([{"tensor_name": "Q"}]), grpc.StatusCode.NOT_FOUND,
             "set model_name"),
        ]
        for call, code, message in cases:
            with pytest.raises(AutotuneError) as excinfo:
                call()
            assert (rpc_code(excinfo), message in str(excinfo.value)) == (code, True), str(excinfo.value)
        # Still serving, and a good report is accepted once.
        assert client.report_metrics("target", 0, 1, plan, 10.0)
        assert not client.report_metrics("target", 0, 1, plan, 10.0)


def test_sigterm_shuts_down_gracefully(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "service.log"
    cmd = [sys.executable, "-m", "bagua_lightning.cli", "autotune", "serve", "--port", str(port)]
    with running(cmd, env=dict(os.environ), log_path=str(log)) as proc, AutotuneClient(target=f"127.0.0.1:{port}") as client:
        wait_until(lambda: client.health_check(timeout_s=0.5), 30.0, "the autotune service")
        client.register_tensors("m", [TensorDeclaration("w", 4).to_dict()])
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not client.health_check(timeout_s=0.5)
    text = log.read_text()
    assert "event=shutting_down" in text and "event=stopped" in text


def test_tls_service_serves_clients_trusting_its_cert_and_refuses_plaintext(start_service, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True,
                   timeout=60)
    with start_service("--tls-cert", str(cert), "--tls-key", str(key), tls_root_cert=cert) as (target, _):
        with AutotuneClient(target=target, root_certificates=cert) as client:
            assert _names(client.register_tensors("tls", [t.to_dict() for t in simulated_trainers.abcde()]))
        with AutotuneClient(target=target) as plaintext:
            assert plaintext.health_check(timeout_s=1.0) is False


def test_cli_help_lists_the_options() -> None:
    out = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "autotune", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env=dict(os.environ)).stdout
    for flag in ("--world-size", "--autotune-level", "--max-samples", "--warmup-time-s",
                 "--sampling-confidence-time-s", "--default-bucket-size", "--state", "--log-dir", "--tls-cert"):
        assert flag in out


def test_tuning_defaults_from_the_environment(tmp_path: Path) -> None:
    """`autotune serve` takes unset tuning options from BAGUA_LIGHTNING_AUTOTUNE_* (as `up` and compose pass them)."""
    port = free_port()
    env = {**os.environ, "BAGUA_LIGHTNING_AUTOTUNE_WARMUP_TIME_S": "0",
           "BAGUA_LIGHTNING_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S": "0", "BAGUA_LIGHTNING_AUTOTUNE_MAX_SAMPLES": "1"}
    cmd = [sys.executable, "-m", "bagua_lightning.cli", "autotune", "serve", "--port", str(port)]
    with running(cmd, env=env, log_path=str(tmp_path / "service.log")), \
            AutotuneClient(target=f"127.0.0.1:{port}") as client:
        wait_until(lambda: client.health_check(timeout_s=0.5), 30.0, "the autotune service")
        plan = client.register_tensors("env", [t.to_dict() for t in simulated_trainers.abcde()], world_size=1)
        assert client.report_metrics("env", 0, 1, plan, 10.0)
        # No warm-up, no hold, one sample: the first report completes tuning (the built-in 30 s warm-up would not).
        assert client.ask_hyperparameters("env", 0, 2).completed
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         env={**env, "BAGUA_LIGHTNING_AUTOTUNE_WARMUP_TIME_S": "soon"})
    assert bad.returncode != 0
    assert "BAGUA_LIGHTNING_AUTOTUNE_WARMUP_TIME_S must be a number of seconds, got 'soon'" in bad.stderr


def test_jobs_over_grpc_and_autotune_ls(start_service) -> None:
    """Job ids and resume plans travel over gRPC; ``autotune ls`` lists jobs and the shared best plan."""
    job = simulated_trainers.sim_job(0)
    tensors = [t.to_dict() for t in job.tensors]
    with start_service(*FAST, "--max-samples", "3") as (target, _), AutotuneClient(target=target) as client:
        first = client.register_job("net", tensors, job_id="run-1", world_size=2)
        assert first.plan.version == 0 and not first.completed
        answer = client.ask_hyperparameters("net", 0, 0, job_id="run-1")
        answer = simulated_trainers.tune_to_completion(client, job, "net", answer, job_id="run-1")
        assert answer.completed
        # Another job of the model: its own session, starting on run-1's final plan, not final for it.
        second = client.register_job("net", tensors, job_id="run-2", world_size=2)
        assert not second.completed and second.plan.same_layout(answer.plan)
        with pytest.raises(AutotuneError, match="under job_id 'run-3'"):
            client.ask_hyperparameters("net", 0, 0, job_id="run-3")
        # A resumed job on its own plan and version.
        resumed = client.register_job("net", tensors, job_id="run-4", world_size=2,
                                      resume=dataclasses.replace(first.plan, version=9))
        assert resumed.plan.version == 9 and resumed.plan.same_layout(first.plan)
        models, shared = client.list_jobs()
        assert [(m.job_id, m.samples > 0) for m in models] == [("run-1", True), ("run-2", False), ("run-4", False)]
        assert len({m.fingerprint for m in models}) == 1
        assert [(p.job_id, p.completed, p.world_size) for p in shared] == [("run-1", True, 2)]
        ls = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "autotune", "ls", "--target", target],
                            capture_output=True, text=True, timeout=120)
        assert ls.returncode == 0, ls.stderr
        lines = ls.stdout.splitlines()
        assert sum(line.startswith("net ") for line in lines) == 3 and "run-4" in ls.stdout
        assert any(line.startswith(f"{models[0].fingerprint}-w2-n2") and "run-1" in line for line in lines)
