"""RPC latency of the autotune service under many concurrent jobs (p50/p99 per call, ratio to a no-op floor).

Starts the real service (``bagua-lightning autotune serve``) on a free port and
drives it with ``--jobs`` jobs of ``--ranks-per-job`` ranks each, as threads spread
over ``--processes`` OS processes (the load generator never shares the service's
process). Two protocols:

* ``aggregated`` (this project's trainer): per job, rank 0 alone talks to the
  service: every ``--interval-ms`` (jittered) ONE report for the whole job (means
  over its ranks with their spread), then an ask. The load is constant in the
  number of ranks.
* ``per-rank`` (Bagua's protocol): every rank reports every interval; rank 0 of each
  job then asks.

Every client registers its job first (timed as RegisterTensors). A sample of
``grpc.health.v1`` Check calls under the same load is the no-op floor: the ratio
shows what the service's own logic adds.

    python benchmarks/autotune_latency.py --protocol aggregated --jobs 64 --ranks-per-job 64
    python benchmarks/autotune_latency.py --protocol per-rank --jobs 4 --ranks-per-job 64
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
from typing import Any

import numpy as np

RPCS = ("RegisterTensors", "ReportMetrics", "AskHyperparameters", "HealthCheck")


def _tensors() -> list[dict[str, object]]:
    return [{"name": f"layer{i}.weight", "num_elements": (1 + i % 7) * 65536, "dtype": "f32"} for i in range(120)]


def _worker(target: str, clients: list[tuple[str, int]], world: int, aggregated: bool, seconds: float,
            interval_ms: float) -> dict[str, list[float]]:
    """Threads, one per (job, rank) that talks to the service; returns latencies in seconds per RPC."""
    from grpc_health.v1 import health_pb2

    from bagua_lightning.client import AutotuneClient

    lat: dict[str, list[float]] = {k: [] for k in RPCS}
    lock = threading.Lock()
    ready = threading.Barrier(len(clients))  # time only once every client of this process is connected
    start: dict[str, float] = {}

    def timings_of(plan: Any) -> list[dict[str, float]]:
        return [{"bucket_index": i, "bytes": b, "ready_ms": 2.0 * i, "comm_ms": 0.5 + b / 1e7, "wait_ms": 0.0,
                 "comm_ms_max": 0.6 + b / 1e7, "wait_ms_max": 0.1} for i, b in enumerate(plan.bucket_bytes)]

    def rank_loop(model: str, rank: int) -> None:
        rng = random.Random(hash((model, rank)))
        mine: dict[str, list[float]] = {k: [] for k in RPCS}
        with AutotuneClient(target=target) as client:
            time.sleep(rng.random() * 0.5)
            t0 = time.perf_counter()
            plan = client.register_tensors(model, _tensors(), world_size=world, nproc_per_node=max(1, world // 8))
            mine["RegisterTensors"].append(time.perf_counter() - t0)
            timings = timings_of(plan)
            if ready.wait() == 0:
                start["at"] = time.monotonic() + 0.5
            ready.wait()
            start_at = start["at"]
            time.sleep(max(0.0, start_at - time.monotonic()) + rng.random() * interval_ms / 1e3)
            it = 0
            end = start_at + seconds
            while time.monotonic() < end:
                it += 1
                speed = 100.0 + rng.random()
                t0 = time.perf_counter()
                if aggregated:
                    client.report_metrics(model, 0, it, plan, speed, timings, backward_ms=20.0, ranks=world,
                                          speed_min=speed - 3, speed_max=speed + 3, speed_stddev=1.5)
                else:
                    client.report_metrics(model, rank, it, plan, speed, timings, backward_ms=20.0)
                mine["ReportMetrics"].append(time.perf_counter() - t0)
                if rank == 0:
                    t0 = time.perf_counter()
                    plan = client.ask_hyperparameters(model, 0, it).plan
                    mine["AskHyperparameters"].append(time.perf_counter() - t0)
                    timings = timings_of(plan)
                if aggregated or rank % 8 == 1:  # a sample of no-op calls under the same load
                    t0 = time.perf_counter()
                    client._health.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                    mine["HealthCheck"].append(time.perf_counter() - t0)
                time.sleep(interval_ms / 1e3 * (0.5 + rng.random()))
        with lock:
            for k, v in mine.items():
                lat[k] += v

    threads = [threading.Thread(target=rank_loop, args=c) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def handler_cost_us(world: int, calls: int = 3000) -> dict[str, float]:
    """CPU time of the service's own handling per call (no network), in microseconds, single thread."""
    from bagua_lightning.client.autotune_records import timing_to_proto
    from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
    from bagua_lightning.proto.plan import plan_from_proto, plan_to_proto
    from bagua_lightning.services.autotune.config import ServiceConfig
    from bagua_lightning.services.autotune.service import AutotuneService
    from bagua_lightning.services.autotune.servicer import AutotuneServicer

    service = AutotuneService(ServiceConfig(world_size=world, warmup_time_s=0, sampling_confidence_time_s=1e9))
    servicer = AutotuneServicer(service)
    reg = servicer.RegisterTensors(pb.RegisterTensorsRequest(
        model_name="m", tensor_list=[pb.TensorDeclaration(**t) for t in _tensors()]), None)  # type: ignore[arg-type]
    if isinstance(reg, bytes):  # the servicer hands back encoded responses (services/autotune/wire.py)
        reg = pb.RegisterTensorsResponse.FromString(reg)
    plan = plan_to_proto(plan_from_proto(reg.recommended_hyperparameters))
    timings = [timing_to_proto({"bucket_index": i, "bytes": 1, "ready_ms": 1.0, "comm_ms": 1.0, "wait_ms": 0.0})
               for i in range(len(plan.buckets))]
    out = {}
    requests = [pb.ReportMetricsRequest(model_name="m", rank=i % world, train_iter=i, hyperparameters=plan,
                                        speed=1.0, bucket_timings=timings, backward_ms=1.0) for i in range(calls)]
    t0 = time.perf_counter()
    for request in requests:
        servicer.ReportMetrics(request, None)
    out["ReportMetrics"] = (time.perf_counter() - t0) / calls * 1e6
    t0 = time.perf_counter()
    for i in range(calls):
        servicer.AskHyperparameters(pb.AskHyperparametersRequest(model_name="m", rank=0, train_iter=calls + i),
                                    None)
    out["AskHyperparameters"] = (time.perf_counter() - t0) / calls * 1e6
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=("aggregated", "per-rank"), default="aggregated")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--ranks-per-job", type=int, default=64)
    parser.add_argument("--server", choices=("aio", "threads"), default="aio", help="the service's --server")
    parser.add_argument("--server-workers", type=int, default=8, help="the service's --max-workers (threads)")
    parser.add_argument("--processes", type=int, default=4, help="load-generator processes")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval-ms", type=float, default=1000.0,
                        help="mean time between two reports of a client (a trainer reports every K steps: seconds)")
    args = parser.parse_args()

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bagua_lightning.client import AutotuneClient
    from tests.procs import free_port, running, wait_until

    aggregated = args.protocol == "aggregated"
    world = args.ranks_per_job
    port = free_port()
    target = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "bagua_lightning.cli", "--log-level", "WARNING", "autotune", "serve", "--port",
           str(port), "--world-size", str(world), "--warmup-time-s", "0", "--sampling-confidence-time-s", "1",
           "--max-samples", "20", "--max-workers", str(args.server_workers), "--server", args.server]
    with running(cmd, env=dict(os.environ)) as proc, AutotuneClient(target=target) as client:
        wait_until(lambda: proc.poll() is None and client.health_check(0.5), 30.0, "the autotune service")
        ranks = range(1) if aggregated else range(world)
        clients = [(f"job{j}", r) for j in range(args.jobs) for r in ranks]
        shards = [clients[i::args.processes] for i in range(args.processes)]
        with ProcessPoolExecutor(args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_worker, target, s, world, aggregated, args.seconds, args.interval_ms)
                       for s in shards if s]
            results = [f.result() for f in futures]
        load = subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout.split()[:3]
    merged: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.items():
            merged.setdefault(k, []).extend(v)
    print(f"{args.protocol}: {args.jobs} jobs x {world} ranks = {args.jobs * world} ranks, {len(clients)} clients "
          f"in {args.processes} processes, {args.seconds:g} s, one report per client every ~{args.interval_ms:g} ms; "
          f"service: 1 process, --server {args.server}"
          f"{f' with {args.server_workers} threads' if args.server == 'threads' else ''}; {os.cpu_count()} CPUs")
    arrays = {k: np.array(merged[k]) * 1e3 for k in RPCS if merged.get(k)}
    p99 = {k: float(np.percentile(ms, 99)) for k, ms in arrays.items()}
    floor = p99.get("HealthCheck", float("nan"))
    for k, ms in arrays.items():
        print(f"  {k:20s} calls {len(ms):6d}  p50 {np.percentile(ms, 50):6.2f} ms  p99 {p99[k]:6.2f} ms  "
              f"max {ms.max():7.2f} ms  p99/floor {p99[k] / floor:5.2f}x")
    cost = handler_cost_us(world)
    print("service handling per call, in process, one thread (no network): "
          + ", ".join(f"{k} {v:.0f} us" for k, v in cost.items()))
    worst = max(p99.values())
    print(f"worst p99 {worst:.2f} ms (goal < 10 ms: {'met' if worst < 10 else 'NOT met'}); "
          f"no-op floor p99 {p99.get('HealthCheck', float('nan')):.2f} ms; loadavg {' '.join(load)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
