"""``bagua-lightning autotune ls | show MODEL | forget MODEL|SHAPE|JOB | plot MODEL -o FILE.png``.

``ls`` and ``show`` ask a running service what it holds (ListModels, DescribeModel); ``forget``
removes shared best plans (ForgetPlans); ``plot``
draws a model's tuning history (speed of each measured plan, and its bucket
layout) from the service, or from a sample log file with ``--log-file`` when the
service is gone. The plot needs matplotlib (the ``demo`` extra).
"""

from __future__ import annotations

import argparse
import datetime
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .samplelog import read_records

MIB = 1024.0**2


def register_inspection(sub: Any) -> None:
    """Add ``ls``, ``forget``, ``show`` and ``plot`` to the ``autotune`` subcommands."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default=None,
                       help="host:port of the service (default: $BAGUA_LIGHTNING_AUTOTUNE_SERVICE, the services "
                            "file, else 127.0.0.1:29600)")
        p.add_argument("--tls-root-cert", type=Path, default=None, help="PEM of the CA of the service (TLS)")
        p.add_argument("--timeout-s", type=float, default=5.0, help="deadline of the call, seconds (default 5)")

    ls = sub.add_parser("ls", help="list the jobs and models a running service tunes, and the best plan per "
                                   "model shape that new jobs start from")
    common(ls)
    ls.set_defaults(func=_ls)
    forget = sub.add_parser("forget", help="remove the shared best plans of a model, a shape or a job, so that new "
                                           "jobs of those shapes start from the default plan")
    common(forget)
    forget.add_argument("match", metavar="MODEL|SHAPE|JOB",
                        help="a model name, a shape key (the KEY column of `autotune ls`) or a job id")
    forget.set_defaults(func=_forget)
    show = sub.add_parser("show", help="one model's plans and measured samples")
    common(show)
    show.add_argument("model", help="model name (see `autotune ls`)")
    show.add_argument("--job", default="", help="the job's id when several jobs tune the model (see `autotune ls`)")
    show.set_defaults(func=_show)
    plot = sub.add_parser("plot", help="plot a model's speed per measured plan and its bucket layouts")
    common(plot)
    plot.add_argument("model", help="model name (see `autotune ls`)")
    plot.add_argument("--job", default="", help="the job's id when several jobs tune the model (see `autotune ls`)")
    plot.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    plot.add_argument("--log-file", type=Path, default=None,
                      help="read this sample log (serve --log-dir) instead of asking the service")
    plot.set_defaults(func=_plot)


def _one_line_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Service errors (unknown model, no token, unreachable) end the command with their message, no traceback."""
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from ...core.errors import AutotuneError, ServiceUnavailableError

        try:
            return command(args)
        except (AutotuneError, ServiceUnavailableError, ValueError) as exc:
            raise SystemExit(f"autotune {args.autotune_command}: {exc}") from None
    return run


def _client(args: argparse.Namespace) -> Any:
    from ...client.autotune import AutotuneClient, quick_retry
    from ...core.services_file import resolve_autotune_address

    return AutotuneClient(target=resolve_autotune_address(args.target), timeout_s=args.timeout_s,
                          retry=quick_retry(1, args.timeout_s), root_certificates=args.tls_root_cert)


@_one_line_errors
def _ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        models, shared = client.list_jobs()
    if not models:
        print("no jobs")
    else:
        print(f"{'MODEL':32s} {'JOB':24s} {'TENSORS':>7s} {'MiB':>8s} {'RANKS':>5s} {'PLAN':>5s} {'SAMPLES':>7s} "
              f"{'REPORTS':>7s} {'BEST':>10s} {'IDLE_S':>7s} STATE")
        for m in models:
            best = "-" if m.best_score is None else f"{m.best_score:.4g}"
            print(f"{m.model_name[:32]:32s} {(m.job_id or '-')[:24]:24s} {m.tensors:7d} {m.total_bytes / MIB:8.1f} "
                  f"{m.world_size:5d} v{m.plan_version:<4d} {m.samples:7d} {m.reports_accepted:7d} {best:>10s} "
                  f"{m.idle_s:7.0f} {'completed' if m.completed else 'tuning'}")
    if shared:
        print("\nbest plan per model shape (where a new job starts; it measures the plan itself before it counts "
              "as tuned):")
        print(f"{'KEY':40s} {'MODEL':32s} {'FROM_JOB':24s} {'SAVED (UTC)':19s} {'SCORE':>10s} {'REPORTS':>7s} "
              f"{'PLANS':>5s} {'BUCKETS':>7s} STATE")
        for p in shared:
            print(f"{p.key[:40]:40s} {p.model_name[:32]:32s} {(p.job_id or '-')[:24]:24s} {_utc(p.saved_at):19s} "
                  f"{p.score:10.4g} {p.reports:7d} {p.samples:5d} {p.buckets:7d} "
                  f"{'completed' if p.completed else 'tuning'}")
    return 0


def _utc(unix_s: float) -> str:
    if unix_s <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


@_one_line_errors
def _forget(args: argparse.Namespace) -> int:
    from ...core.errors import ModelNotRegisteredError

    try:
        with _client(args) as client:
            removed, warning = client.forget_plans(args.match)
    except ModelNotRegisteredError:
        raise SystemExit(f"autotune forget: no shared plan has the model name, shape key or job id "
                         f"{args.match!r:.200}; see `bagua-lightning autotune ls`") from None
    for p in removed:
        print(f"forgot {p.key} (model {p.model_name or '-'}, job {p.job_id or '-'}, saved {_utc(p.saved_at)} UTC, "
              f"score {p.score:.4g}, {p.reports} reports, {'completed' if p.completed else 'tuning'})")
    if warning:
        raise SystemExit(f"autotune forget: {warning}")
    return 0


@_one_line_errors
def _show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        d = client.describe_model(args.model, args.job)
    m = d.summary
    print(f"model {m.model_name}{f' (job {m.job_id})' if m.job_id else ''}: {m.tensors} tensors, {m.total_bytes / MIB:.1f} MiB, world size {m.world_size} "
          f"({m.nproc_per_node} per node), tuner {m.tuner or '-'}, "
          f"{'completed' if m.completed else 'tuning'}")
    print(f"reports: {m.reports_accepted} accepted, {m.reports_ignored} duplicates ignored; "
          f"{m.layouts_tracked} layouts measured")
    for label, plan in (("current", d.current), ("best", d.best)):
        if plan is not None:
            mib = [b / MIB for b in plan.bucket_bytes]
            print(f"{label} plan v{plan.version}: {len(plan.buckets)} buckets ({min(mib):.1f}..{max(mib):.1f} MiB), "
                  f"bucket_size {plan.bucket_size} B, {'hierarchical' if plan.is_hierarchical_reduce else 'flat'}")
    if len(d.shapes) > 1 or m.reshapes:
        print(f"shapes: {m.reshapes} reshape(s)")
        for shape in d.shapes:
            origin = f"shared plan {shape.shared_key}" if shape.started_from == "shared" else \
                f"{shape.started_from} plan"
            print(f"  {_utc(shape.registered_at)} UTC  world size {shape.world_size:4d} ({shape.nproc_per_node} per "
                  f"node, {shape.world_size // max(1, shape.nproc_per_node)} node(s)): started on v"
                  f"{shape.plan_version} ({origin})")
    if d.selection is not None:
        a = d.selection
        source = "" if a.job_id == m.job_id else f", measured by job {a.job_id or '-'}"
        print(f"algorithm: {a.chosen} (algorithm='auto', chosen at step {a.step}{source})")
        best = dict(a.step_ms)[a.chosen]
        for name, ms in sorted(a.step_ms, key=lambda kv: kv[1]):
            print(f"  {name:28s} {ms:10.2f} ms/step  {ms / best:5.2f}x{'  (kept)' if name == a.chosen else ''}")
        if a.reason:
            print(f"  reason: {a.reason}")
    if d.samples:
        print(f"{'#':>3s} {'PLAN':>5s} {'BUCKETS':>7s} {'SIZE_MiB':>8s} {'HIER':>4s} {'SAMPLES/S':>10s} "
              f"{'SCORE':>10s} {'EXPOSED_MS':>10s} {'REPORTS':>7s}")
        for s in d.samples:
            print(f"{s.index:3d} v{s.plan_version:<4d} {len(s.bucket_bytes):7d} {s.bucket_size / MIB:8.2f} "
                  f"{'yes' if s.is_hierarchical_reduce else 'no':>4s} {s.speed:10.1f} {s.score:10.4g} "
                  f"{s.exposed_ms:10.3f} {s.reports:7d}")
    return 0


def history_from_log(path: Path, model: str) -> list[dict[str, Any]]:
    """The samples of ``model`` in a sample log, as plot rows."""
    rows: list[dict[str, Any]] = []
    for record in read_records(path):
        if record.get("model_name") != model or "speed" not in record:
            continue
        rows.append({"index": int(record.get("sample", len(rows) + 1)), "speed": float(record["speed"]),
                     "score": float(record.get("score", 0.0)), "plan_version": int(record.get("plan_version", 0)),
                     "bucket_bytes": [int(b) for b in record.get("bucket_bytes", [])]})
    return rows


@_one_line_errors
def _plot(args: argparse.Namespace) -> int:
    from .plot import plot_history

    if args.log_file is not None:
        rows = history_from_log(args.log_file, args.model)
        if not rows:
            raise SystemExit(f"{args.log_file} holds no samples of model {args.model!r}")
    else:
        with _client(args) as client:
            d = client.describe_model(args.model, args.job)
        rows = [{"index": s.index, "speed": s.speed, "score": s.score, "plan_version": s.plan_version,
                 "bucket_bytes": list(s.bucket_bytes)} for s in d.samples]
        if not rows:
            raise SystemExit(f"model {args.model!r} has no measured plan yet; plot it once it reported")
    plot_history(args.model, rows, args.output)
    print(f"wrote {args.output} ({len(rows)} measured plans)")
    return 0
