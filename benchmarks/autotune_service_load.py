"""The autotune service under big models: memory per model and health-check latency under DescribeModel load.

Starts the real service (``bagua-lightning autotune serve``) on a free port, registers
``--models`` models of ``--tensors`` tensors each, and reports the service's RSS growth
(psutil). Then ``--clients`` client processes loop ``DescribeModel`` over those models
while this process times ``--checks`` grpc.health.v1 Check calls; the same health loop
with no load, in the same run and against the same service, is the baseline.

Targets (issue: "Service"): 16 models x 100,000 tensors add < 1 GiB; health p99 < 50 ms
and max < 200 ms under the load.

    python benchmarks/autotune_service_load.py             # 16 x 100k tensors, 4 clients, 2000 checks
    python benchmarks/autotune_service_load.py --quick     # 4 x 100k tensors, 4 clients, 300 checks
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

GRPC_OPTIONS = [("grpc.max_receive_message_length", 256 * 1024**2),
                ("grpc.max_send_message_length", 256 * 1024**2)]
GiB = 1024**3


def _request(model: str, tensors: int) -> Any:
    from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb

    request = pb.RegisterTensorsRequest(model_name=model, whether_to_bucket=True)
    add = request.tensor_list.add
    for i in range(tensors):  # names as a transformer's: ~35 bytes
        add(name=f"{model}.layers.{i // 8}.block{i % 8}.weight", num_elements=(1 + i % 7) * 4096, dtype="f32")
    return request


def _describe_loop(target: str, models: list[str], stop_at: float) -> int:
    """Loop DescribeModel over ``models`` until ``stop_at`` (time.time()); returns the calls made."""
    import grpc

    from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
    from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc

    calls = 0
    with grpc.insecure_channel(target, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.AutotuneServiceStub(channel)
        while time.time() < stop_at:
            reply = stub.DescribeModel(pb.DescribeModelRequest(model_name=models[calls % len(models)]), timeout=60)
            if not reply.current.buckets:
                raise RuntimeError("DescribeModel answered without the current plan")
            calls += 1
    return calls


def _health_ms(stub: Any, checks: int) -> np.ndarray:
    from grpc_health.v1 import health_pb2

    out = np.empty(checks)
    request = health_pb2.HealthCheckRequest(service="")
    for i in range(checks):
        start = time.perf_counter()
        stub.Check(request, timeout=10)
        out[i] = (time.perf_counter() - start) * 1e3
        time.sleep(0.005)  # a probe every 5 ms, not a flood: the service's load is the clients'
    return out


def _line(name: str, ms: np.ndarray) -> str:
    return (f"  {name:28s} checks {len(ms):5d}  p50 {np.percentile(ms, 50):7.2f} ms  "
            f"p99 {np.percentile(ms, 99):7.2f} ms  max {ms.max():7.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 models, 300 health checks")
    parser.add_argument("--models", type=int, default=None, help="models to register (default 16; quick 4)")
    parser.add_argument("--tensors", type=int, default=100_000, help="tensors per model")
    parser.add_argument("--clients", type=int, default=4, help="processes looping DescribeModel")
    parser.add_argument("--checks", type=int, default=None, help="health checks per phase (default 2000; quick 300)")
    parser.add_argument("--server", choices=("aio", "threads"), default="aio", help="the service's --server")
    args = parser.parse_args()
    models_n = args.models or (4 if args.quick else 16)
    checks = args.checks or (300 if args.quick else 2000)

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import grpc
    import psutil
    from grpc_health.v1 import health_pb2_grpc

    from bagua_lightning.proto.autotune.v1 import autotune_pb2_grpc as pb_grpc
    from tests.procs import free_port, running, wait_until

    port = free_port()
    target = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "bagua_lightning.cli", "--log-level", "WARNING", "autotune", "serve", "--port",
           str(port), "--server", args.server, "--tuning-processes", "0", "--max-request-bytes", str(64 * 1024**2)]
    names = [f"model{k}" for k in range(models_n)]
    requests = [_request(name, args.tensors) for name in names]  # built before timing: client cost
    with running(cmd, env=dict(os.environ)) as proc, \
            grpc.insecure_channel(target, options=GRPC_OPTIONS) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = pb_grpc.AutotuneServiceStub(channel)

        def up() -> bool:
            try:
                return proc.poll() is None and bool(health.Check(_health_request(), timeout=0.5))
            except grpc.RpcError:
                return False

        wait_until(up, 60.0, "the autotune service")
        service = psutil.Process(proc.pid)
        rss0 = service.memory_info().rss
        register_s = []
        for request in requests:
            start = time.perf_counter()
            stub.RegisterTensors(request, timeout=300)
            register_s.append(time.perf_counter() - start)
        rss1 = service.memory_info().rss
        baseline = _health_ms(health, checks)
        with ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn")) as pool:
            # Long enough for the health loop at 5 ms a probe, plus the clients' start-up.
            stop_at = time.time() + 30 + checks * 0.02
            futures = [pool.submit(_describe_loop, target, names[i::args.clients] or names, stop_at)
                       for i in range(args.clients)]
            time.sleep(5)  # the clients' imports and first calls
            loaded = _health_ms(health, checks)
            describes = sum(f.result() for f in futures)
        rss2 = service.memory_info().rss
    grown = rss1 - rss0
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"autotune service load: {models_n} models x {args.tensors} tensors, --server {args.server}, "
          f"{args.clients} DescribeModel clients, {os.cpu_count()} CPUs, loadavg {load}")
    print(f"  registration: median {np.median(register_s):.2f} s, max {max(register_s):.2f} s per model")
    print(f"  RSS: {rss0 / 2**20:.0f} MiB at start, +{grown / 2**20:.0f} MiB after registering "
          f"({grown / models_n / 2**20:.1f} MiB a model), +{(rss2 - rss0) / 2**20:.0f} MiB after the load "
          f"(target: {models_n} x {args.tensors} add < {models_n / 16:g} GiB: "
          f"{'met' if grown < models_n / 16 * GiB else 'NOT met'})")
    print(_line("health, no load", baseline))
    print(_line(f"health, {args.clients} describe clients", loaded))
    p99, worst = float(np.percentile(loaded, 99)), float(loaded.max())
    print(f"  DescribeModel calls during the loaded phase: {describes}")
    print(f"  target p99 < 50 ms, max < 200 ms under load: {'met' if p99 < 50 and worst < 200 else 'NOT met'}")
    return 0


def _health_request() -> Any:
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckRequest(service="")


if __name__ == "__main__":
    raise SystemExit(main())
