"""RPC latency of the autotune service under 256 concurrent simulated ranks (p50/p99 per call).

Starts the real service (``bagua-lightning autotune serve``) on a free port,
registers 4 models of 64 ranks each, then runs 256 rank threads spread over
several OS processes. Every rank behaves as the trainer will: every
``--interval-ms`` (jittered) it reports its metrics with per-bucket timings, and
rank 0 of each model then asks for the plan. The same load also times the
``grpc.health.v1`` Check, a no-op RPC, as the floor: the ratio shows what the
service's own logic adds.

    python benchmarks/autotune_latency.py [--ranks 256] [--processes 4] [--seconds 10] [--interval-ms 1000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

MODELS = 4


def _tensors() -> list[dict[str, object]]:
    return [{"name": f"layer{i}.weight", "num_elements": (1 + i % 7) * 65536, "dtype": "f32"} for i in range(120)]


def _worker(target: str, ranks: list[tuple[str, int]], seconds: float, interval_ms: float) -> dict[str, list[float]]:
    from grpc_health.v1 import health_pb2

    from bagua_lightning.client import AutotuneClient
    from bagua_lightning.proto.plan import plan_from_proto

    lat: dict[str, list[float]] = {"ReportMetrics": [], "AskHyperparameters": [], "HealthCheck": []}
    lock = threading.Lock()
    ready = threading.Barrier(len(ranks))  # time only once every rank of this process is connected
    start: dict[str, float] = {}

    def rank_loop(model: str, rank: int) -> None:
        rng = random.Random(hash((model, rank)))
        with AutotuneClient(target=target) as client:
            def timings_of(message: object) -> list[dict[str, float]]:
                plan = plan_from_proto(message)
                return [{"bucket_index": i, "bytes": b, "ready_ms": 2.0 * i, "comm_ms": 0.5 + b / 1e7,
                         "wait_ms": 0.0} for i, b in enumerate(plan.bucket_bytes)]

            plan_msg = client.ask_hyperparameters(model, rank, 0).recommended_hyperparameters
            timings = timings_of(plan_msg)
            if ready.wait() == 0:
                start["at"] = time.monotonic() + 0.5
            ready.wait()
            start_at = start["at"]
            time.sleep(max(0.0, start_at - time.monotonic()) + rng.random() * interval_ms / 1e3)
            it = 0
            mine: dict[str, list[float]] = {k: [] for k in lat}
            end = start_at + seconds
            while time.monotonic() < end:
                it += 1
                t0 = time.perf_counter()
                client.report_metrics(model, rank, it, plan_msg, 100.0 + rng.random(), timings, backward_ms=20.0)
                mine["ReportMetrics"].append(time.perf_counter() - t0)
                if rank == 0:
                    t0 = time.perf_counter()
                    plan_msg = client.ask_hyperparameters(model, rank, it).recommended_hyperparameters
                    mine["AskHyperparameters"].append(time.perf_counter() - t0)
                    timings = timings_of(plan_msg)
                if rank % 8 == 1:  # a sample of no-op calls under the same load
                    t0 = time.perf_counter()
                    client._health.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                    mine["HealthCheck"].append(time.perf_counter() - t0)
                time.sleep(interval_ms / 1e3 * (0.5 + rng.random()))
        with lock:
            for k, v in mine.items():
                lat[k] += v

    threads = [threading.Thread(target=rank_loop, args=r) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def handler_cost_us(world: int, calls: int = 3000) -> dict[str, float]:
    """CPU time of the service's own handling per call (no network), in microseconds, single thread."""
    from bagua_lightning.client.autotune import hyperparameters_to_proto, timing_to_proto
    from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
    from bagua_lightning.services.autotune.config import ServiceConfig
    from bagua_lightning.services.autotune.service import AutotuneService
    from bagua_lightning.services.autotune.servicer import AutotuneServicer

    service = AutotuneService(ServiceConfig(world_size=world, warmup_time_s=0, sampling_confidence_time_s=1e9))
    servicer = AutotuneServicer(service)
    reg = servicer.RegisterTensors(pb.RegisterTensorsRequest(
        model_name="m", tensor_list=[pb.TensorDeclaration(**t) for t in _tensors()]), None)  # type: ignore[arg-type]
    plan = hyperparameters_to_proto(reg)
    timings = [timing_to_proto({"bucket_index": i, "bytes": 1, "ready_ms": 1.0, "comm_ms": 1.0, "wait_ms": 0.0})
               for i in range(len(plan.buckets))]
    out = {}
    requests = [pb.ReportMetricsRequest(model_name="m", rank=i % world, train_iter=i, hyperparameters=plan,
                                        speed=1.0, bucket_timings=timings, backward_ms=1.0) for i in range(calls)]
    t0 = time.perf_counter()
    for request in requests:
        servicer.ReportMetrics(request, None)  # type: ignore[arg-type]
    out["ReportMetrics"] = (time.perf_counter() - t0) / calls * 1e6
    t0 = time.perf_counter()
    for i in range(calls):
        servicer.AskHyperparameters(pb.AskHyperparametersRequest(model_name="m", rank=0, train_iter=calls + i),
                                    None)  # type: ignore[arg-type]
    out["AskHyperparameters"] = (time.perf_counter() - t0) / calls * 1e6
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--server-workers", type=int, default=8, help="the service's --max-workers")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval-ms", type=float, default=1000.0,
                        help="mean time between a rank's reports (a trainer reports every K steps: seconds)")
    args = parser.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bagua_lightning.client import AutotuneClient
    from tests.procs import free_port, running, wait_until

    env = dict(os.environ)
    port = free_port()
    target = f"127.0.0.1:{port}"
    world = args.ranks // MODELS
    cmd = [sys.executable, "-m", "bagua_lightning.cli", "--log-level", "WARNING", "autotune", "serve", "--port",
           str(port), "--world-size", str(world), "--warmup-time-s", "0", "--sampling-confidence-time-s", "1",
           "--max-samples", "20", "--max-workers", str(args.server_workers)]
    with running(cmd, env=env) as proc, AutotuneClient(target=target) as client:
        wait_until(lambda: proc.poll() is None and client.health_check(0.5), 30.0, "the autotune service")
        for m in range(MODELS):
            client.register_tensors(f"model{m}", _tensors(), world_size=world, nproc_per_node=max(1, world // 8))
        ranks = [(f"model{m}", r) for m in range(MODELS) for r in range(world)]
        shards = [ranks[i::args.processes] for i in range(args.processes)]
        with ProcessPoolExecutor(args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = [f.result() for f in [pool.submit(_worker, target, s, args.seconds, args.interval_ms)
                                            for s in shards]]
        load = subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout.split()[:3]
    merged: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.items():
            merged.setdefault(k, []).extend(v)
    print(f"{args.ranks} ranks ({MODELS} models x {world}) in {args.processes} processes, {args.seconds:g} s, "
          f"one report per rank every ~{args.interval_ms:g} ms; service: 1 process, {args.server_workers} threads")
    p99 = {}
    for k, v in merged.items():
        ms = np.array(v) * 1e3
        p99[k] = float(np.percentile(ms, 99))
        print(f"  {k:20s} calls {len(ms):6d}  rate {len(ms) / args.seconds:7.0f}/s  p50 {np.percentile(ms, 50):6.2f} ms"
              f"  p99 {p99[k]:6.2f} ms  max {ms.max():7.2f} ms")
    cost = handler_cost_us(world)
    print("service handling per call, in process, one thread (no network): "
          + ", ".join(f"{k} {v:.0f} us" for k, v in cost.items()))
    print(f"ratio p99 ReportMetrics / p99 health Check (no-op floor): "
          f"{p99['ReportMetrics'] / p99['HealthCheck']:.2f}x   goal: p99 < 10 ms   loadavg {' '.join(load)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
