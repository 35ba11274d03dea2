"""``bagua-lightning autotune serve | simulate``.

``serve`` runs the service (options match Bagua's autotune service);
``simulate`` starts one in-process (or uses ``--target``) and drives it with
simulated ranks of a few simulated models through :class:`AutotuneClient`,
printing every plan handed back as it tunes.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.args import bind_port_arg
from ...core.errors import ConfigurationError
from ...core.services_file import ENV_AUTOTUNE_TOKEN, env_secret
from ...proto.plan import DEFAULT_BUCKET_SIZE, BucketPlan, TensorDeclaration
from .config import TUNERS, ServiceConfig
from .server import DEFAULT_PORT, SERVER_KINDS, TlsFiles, read_token_file, serve


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("autotune", help="the autotuning gRPC service")
    sub = parser.add_subparsers(dest="autotune_command", metavar="ACTION", required=True)

    s = sub.add_parser("serve", help="run the autotune service until SIGTERM")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=bind_port_arg, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks one)")
    _add_tuning_options(s, warmup_time_s=None, sampling_confidence_time_s=None, max_samples=None)
    s.add_argument("--state", action="append", default=None,
                   help="where best plans persist: a directory, or a redis:// URL (default: memory only); give it "
                        "twice (a Redis URL and a directory) to keep every plan in both, so that losing either "
                        "loses none")
    s.add_argument("--log-dir", default=None, help="directory for one JSONL sample log per model")
    s.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain (enables TLS, with --tls-key)")
    s.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    s.add_argument("--max-workers", type=int, default=8,
                   help="server threads (default 8: handlers take ~40 us, and more threads only contend for the GIL)")
    s.add_argument("--server", choices=SERVER_KINDS, default="aio",
                   help="aio: handlers on grpc.aio's event loop (default; lower tail latency); threads: grpc's "
                        "thread-pool server with --max-workers threads")
    s.add_argument("--tuning-processes", type=int, default=1,
                   help="worker processes computing the tuners' proposals, so no request waits for one "
                        "(default 1; 0: in the request)")
    s.add_argument("--token-file", type=Path, default=None,
                   help="file holding the bearer token every call must carry (default: "
                        "$BAGUA_LIGHTNING_AUTOTUNE_TOKEN, else no token); health checks stay open")
    s.add_argument("--metrics-port", type=bind_port_arg, default=None,
                   help="serve Prometheus metrics over HTTP on this port (default: off; 0 picks one)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default 127.0.0.1)")
    s.set_defaults(func=_serve)

    from .inspection import register_inspection

    register_inspection(sub)

    m = sub.add_parser("simulate", help="drive the service with simulated ranks and print the plans it hands back")
    m.add_argument("--target", default=None, help="use this running service (host:port) instead of starting one")
    m.add_argument("--ranks", type=int, default=4, help="simulated ranks per model (default 4)")
    m.add_argument("--reports", type=int, default=12, help="report rounds per model (default 12)")
    m.add_argument("--steps-per-report", type=int, default=50, help="train_iter advance per round (default 50)")
    m.add_argument("--speed-only", action="store_true", help="report speed only: the Bayesian baseline tunes")
    m.add_argument("--service-logs", action="store_true", help="also show the service's own log lines")
    _add_tuning_options(m, warmup_time_s=0.0, sampling_confidence_time_s=0.0, max_samples=10)
    m.set_defaults(func=_simulate)


# ``serve`` options whose default an environment variable can set (containers, ``bagua-lightning up``):
# option dest -> (variable, type, default).
ENV_DEFAULTS: dict[str, tuple[str, Callable[[str], float], float]] = {
    "max_samples": ("BAGUA_LIGHTNING_AUTOTUNE_MAX_SAMPLES", int, 60),
    "warmup_time_s": ("BAGUA_LIGHTNING_AUTOTUNE_WARMUP_TIME_S", float, 30.0),
    "sampling_confidence_time_s": ("BAGUA_LIGHTNING_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S", float, 5.0),
}


def _default_text(dest: str, value: float | None) -> str:
    if value is not None:
        return f"default {value:g}"
    variable, _, fallback = ENV_DEFAULTS[dest]
    return f"default ${variable}, else {fallback:g}"


def _add_tuning_options(p: argparse.ArgumentParser, *, warmup_time_s: float | None,
                        sampling_confidence_time_s: float | None, max_samples: int | None) -> None:
    """The tuning options; a default of None is taken from :data:`ENV_DEFAULTS` when the command runs."""
    p.add_argument("--world-size", type=int, default=1, help="ranks per job when a registration leaves it 0")
    p.add_argument("--autotune-level", type=int, default=1, choices=(0, 1), help="0: default plan only; 1: tune")
    p.add_argument("--max-samples", type=int, default=max_samples,
                   help=f"plans measured before tuning completes ({_default_text('max_samples', max_samples)})")
    p.add_argument("--warmup-time-s", type=float, default=warmup_time_s,
                   help=f"seconds of reports ignored after registration "
                        f"({_default_text('warmup_time_s', warmup_time_s)})")
    p.add_argument("--sampling-confidence-time-s", type=float, default=sampling_confidence_time_s,
                   help=f"seconds each plan is held at least "
                        f"({_default_text('sampling_confidence_time_s', sampling_confidence_time_s)})")
    p.add_argument("--default-bucket-size", type=int, default=DEFAULT_BUCKET_SIZE,
                   help=f"bucket size of the initial plan, bytes (default {DEFAULT_BUCKET_SIZE})")
    p.add_argument("--tuner", choices=TUNERS, default="auto",
                   help="auto: model-based planner when reports carry bucket timings, else Bayesian")
    p.add_argument("--no-early-stop", action="store_true", help="always measure --max-samples plans")
    p.add_argument("--max-tensors", type=int, default=100_000, help="tensors per model / spans per request")
    p.add_argument("--max-models", type=int, default=1024,
                   help="models held at once; one more evicts the least recently used (default 1024)")
    p.add_argument("--max-memory", type=_size_arg, default=2 * 1024**3,
                   help="bytes of model state held at once, e.g. 2GiB, 512MiB (0: no budget); past it the least "
                        "recently used models are evicted, their best plans kept in the store (default 2GiB)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024**2, help="largest gRPC message, bytes")
    p.add_argument("--max-name-bytes", type=int, default=1024, help="longest model or tensor name, bytes")
    p.add_argument("--max-layouts", type=int, default=64, help="measured layouts kept per model")
    p.add_argument("--store-timeout-s", type=float, default=1.0, help="deadline of one --state operation, s")


def _size_arg(text: str) -> int:
    from ...core.procs import parse_bytes

    try:
        return parse_bytes(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fill_env_defaults(args: argparse.Namespace) -> None:
    """Options left unset take their environment variable, else the built-in default."""
    for dest, (variable, kind, fallback) in ENV_DEFAULTS.items():
        if getattr(args, dest) is not None:
            continue
        text = os.environ.get(variable, "").strip()
        if not text:
            setattr(args, dest, fallback)
            continue
        try:
            setattr(args, dest, kind(text))
        except ValueError:
            what = "a whole number" if kind is int else "a number of seconds"
            raise SystemExit(f"{variable} must be {what}, got {text!r}; fix it, unset it (default {fallback:g}) "
                             f"or pass --{dest.replace('_', '-')}") from None


def _config(args: argparse.Namespace) -> ServiceConfig:
    _fill_env_defaults(args)
    return ServiceConfig(
        world_size=args.world_size, autotune_level=args.autotune_level, max_samples=args.max_samples,
        warmup_time_s=args.warmup_time_s, sampling_confidence_time_s=args.sampling_confidence_time_s,
        default_bucket_size=args.default_bucket_size, tuner=args.tuner, early_stop=not args.no_early_stop,
        max_tensors=args.max_tensors, max_models=args.max_models, max_memory=args.max_memory, max_request_bytes=args.max_request_bytes,
        max_name_bytes=args.max_name_bytes, max_layouts=args.max_layouts, store_timeout_s=args.store_timeout_s,
        tuning_processes=getattr(args, "tuning_processes", 0))


def _serve(args: argparse.Namespace) -> int:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("--tls-cert and --tls-key go together: give both to enable TLS, or neither")
    tls = TlsFiles(cert=args.tls_cert, key=args.tls_key) if args.tls_cert else None
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise SystemExit(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if args.token_file is not None:
        try:
            token: str | None = read_token_file(args.token_file)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    else:
        token = (env_secret(ENV_AUTOTUNE_TOKEN) or "").strip() or None  # $..._TOKEN, else $..._TOKEN_FILE's
    return serve(_config(args), host=args.host, port=args.port, state=args.state, log_dir=args.log_dir, tls=tls,
                 max_workers=args.max_workers, token=token, metrics_port=args.metrics_port,
                 metrics_host=args.metrics_host, kind=args.server)


# -- simulate ------------------------------------------------------------------------------------------

@dataclass
class _SimModel:
    name: str
    description: str
    job: Any  # SimulatedJob
    world_size: int
    nproc_per_node: int


def _sim_models(seed: int) -> list[_SimModel]:
    from .simulator import (
        SimulatedJob,
        bandwidth_scenario,
        compute_proportional,
        resnet_like,
        transformer_like,
    )

    tf = transformer_like(layers=12, hidden=768)
    flat, _ = bandwidth_scenario(1.25, 0.3)
    rn = resnet_like()
    flat2, hier2 = bandwidth_scenario(3.0, 0.2, nodes=2)
    return [
        _SimModel("gpt-small", "transformer 12x768 (f32, 390 MB), 1 node, 10 Gb/s",
                  SimulatedJob(tensors=tf, compute_ms=compute_proportional(tf, 150.0), flat=flat, seed=seed),
                  world_size=4, nproc_per_node=4),
        _SimModel("resnet", "resnet-like (f32, 95 MB), 2 nodes, 24 Gb/s, hierarchical possible",
                  SimulatedJob(tensors=rn, compute_ms=compute_proportional(rn, 40.0), flat=flat2,
                               hierarchical=hier2, forward_ms=15.0, seed=seed + 1),
                  world_size=4, nproc_per_node=2),
    ]


def _describe(plan: BucketPlan) -> str:
    mib = sorted(b / 1024**2 for b in plan.bucket_bytes)
    return (f"{len(plan.buckets):3d} buckets  {mib[0]:6.1f} / {mib[len(mib) // 2]:6.1f} / {mib[-1]:6.1f} MiB"
            f"  {'hier' if plan.is_hierarchical_reduce else 'flat'}")


def _drive(client: Any, model: _SimModel, args: argparse.Namespace, lock: threading.Lock) -> None:
    from .simulator import oracle_plan

    job = model.job
    tensors: list[TensorDeclaration] = list(job.tensors)
    best_ms = job.step_ms(oracle_plan(job))
    client.register_tensors(model.name, [t.to_dict() for t in tensors], world_size=model.world_size,
                            nproc_per_node=model.nproc_per_node)
    order = job.ready_order
    client.report_tensor_execution_order(
        [{"trace_id": 1, "action": "tensor_ready", "tensor_name": t.name, "start_time": i, "end_time": i}
         for i, t in enumerate(order)], model_name=model.name)
    with lock:
        print(f"[{model.name}] {model.description}; best possible step {best_ms:.1f} ms")
    for round_ in range(args.reports):
        train_iter = round_ * args.steps_per_report
        reply = client.ask_hyperparameters(model.name, rank=0, train_iter=train_iter)
        plan = reply.plan
        step = job.step_ms(plan)
        with lock:
            print(f"[{model.name}] iter {train_iter:5d}  v{plan.version:<2d} {_describe(plan)}  step {step:6.1f} ms"
                  f"  (+{100 * (step / best_ms - 1):4.1f}% vs best)"
                  f"{'  completed' if reply.completed else ''}")
        if reply.completed:
            break
        for rank in range(model.world_size):
            speed, timings, backward_ms = job.measure(plan)
            client.report_metrics(model.name, rank, train_iter, plan, speed,
                                  None if args.speed_only else timings, backward_ms=backward_ms)


def _simulate(args: argparse.Namespace) -> int:
    from ...client.autotune import AutotuneClient
    from .server import create_server
    from .service import AutotuneService

    if not args.service_logs:
        logging.getLogger("bagua_lightning.services").setLevel(logging.WARNING)
    server = None
    target = args.target
    if target is None:
        server, port = create_server("127.0.0.1:0", AutotuneService(_config(args)))
        server.start()
        target = f"127.0.0.1:{port}"
        print(f"started an autotune service on {target} (max_samples={args.max_samples}, tuner={args.tuner})")
    lock = threading.Lock()
    models = _sim_models(seed=0)
    try:
        with AutotuneClient(target=target) as client, ThreadPoolExecutor(len(models)) as pool:
            client.wait_until_ready(timeout_s=30.0)
            for future in [pool.submit(_drive, client, m, args, lock) for m in models]:
                future.result()
    finally:
        if server is not None:
            server.stop(grace=1.0).wait()
    return 0
