"""``bagua-lightning demo``: the main job in one command.

1. Finds the services (``BAGUA_LIGHTNING_AUTOTUNE_SERVICE``/``BAGUA_LIGHTNING_REDIS_HOSTS``, else the
   services file, else ``--autotune-port``/``--redis-port`` or the default ports on this machine, e.g.
   ``docker compose up``); when none answer and none are named in the environment, starts them like
   ``bagua-lightning up`` (on free ports when none are named: another deployment on the default ports is
   no obstacle) and leaves them running (``bagua-lightning down`` stops them).
2. Removes the samples earlier demo runs cached (unless ``--keep-cache``), so that the first job computes
   every sample and the second one shows the cache at work.
3. Runs :mod:`bagua_lightning.examples.demo` ``--jobs`` times, one job after the other (2 CPU processes,
   or every GPU), each printing its summary.
4. Prints what the later jobs gained, and writes ``OUT/autotune.png`` (the autotune trajectory of all
   jobs), ``OUT/summary.txt`` and ``OUT/<job>.json``.

No torch is imported here: the jobs run in their own processes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagua_lightning.core.addresses import format_address
from bagua_lightning.core.errors import ConfigurationError, ServiceUnavailableError
from bagua_lightning.core.services_file import (
    ENV_AUTOTUNE,
    ENV_AUTOTUNE_TOKEN,
    ENV_CACHE_KEY,
    ENV_REDIS_HOSTS,
    ENV_REDIS_PASSWORD,
    FILE_SUFFIX,
    read_services_file,
    resolve_autotune_address,
    resolve_autotune_token,
    resolve_cache_key,
    resolve_redis_hosts,
    resolve_redis_password,
)

DEFAULT_OUT = "bagua-lightning-demo"
JOB_MODULE = "bagua_lightning.examples.demo"


@dataclass(kw_only=True, slots=True)
class Preset:
    """Size of each job: the full demo, or ``--quick`` (a smoke run of a few seconds of training).

    Attributes:
        epochs: epochs per job.
        samples: dataset size.
        transform_ms: slow transform per sample, in milliseconds.
        autotune_interval: steps between autotune step boundaries.
    """

    epochs: int
    samples: int
    transform_ms: float
    autotune_interval: int


FULL = Preset(epochs=8, samples=4096, transform_ms=3.0, autotune_interval=8)
QUICK = Preset(epochs=2, samples=512, transform_ms=2.0, autotune_interval=4)


@dataclass(kw_only=True, slots=True)
class Endpoints:
    """Where the jobs find the services.

    Attributes:
        autotune: ``host:port`` of the autotune service.
        redis_hosts: ``host:port`` of each Redis node.
        cluster: whether the nodes form a Redis Cluster.
        how: ``"started"`` (by this command) or ``"running"`` (found).
        secrets: the services' secrets (password, token, key) by their environment variable, for this process.
        secret_files: what hands them to the jobs: ``$NAME_FILE`` -> the path of the deployment's 0600 file, for
            each secret the services file gave (one the user set is in the jobs' inherited environment
            already). Never the values: an environment is readable in ``/proc/PID/environ`` and goes to every
            child process.
    """

    autotune: str
    redis_hosts: list[str]
    cluster: bool
    how: str
    secrets: dict[str, str] = field(default_factory=dict)
    secret_files: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The jobs' environment: the addresses and the secrets' files (never a secret, nor a command line)."""
        return {ENV_AUTOTUNE: self.autotune, ENV_REDIS_HOSTS: ",".join(self.redis_hosts), **self.secret_files}


def _secrets(autotune: str, hosts: list[dict[str, Any]]) -> dict[str, str]:
    # The secrets for exactly these addresses (the services file's go only to the addresses it records),
    # handed to the jobs explicitly through their environment.
    key = resolve_cache_key(hosts)
    found = {ENV_REDIS_PASSWORD: resolve_redis_password(hosts), ENV_AUTOTUNE_TOKEN: resolve_autotune_token(autotune),
             ENV_CACHE_KEY: key.decode() if key else None}
    return {k: v for k, v in found.items() if v}


_RECORDED = {ENV_REDIS_PASSWORD: "redis_password", ENV_AUTOTUNE_TOKEN: "autotune_token", ENV_CACHE_KEY: "cache_key"}


def _secret_files(secrets: dict[str, str]) -> dict[str, str]:
    """``$NAME_FILE`` -> path for each of ``secrets`` that came from the services file's secret files (the jobs
    read the file themselves); a secret the user set (``$NAME`` or ``$NAME_FILE``) they inherit as it is."""
    info = read_services_file()
    out = {}
    for name in secrets:
        if os.environ.get(name) or os.environ.get(name + FILE_SUFFIX):
            continue
        path = info.secrets.get(_RECORDED[name]) if info is not None else None
        if path:
            out[name + FILE_SUFFIX] = path
    return out


def _hostport(h: dict[str, Any]) -> str:
    return format_address(str(h["host"]), int(h["port"]))


def find_or_start_services(cfg: Any, timeout_s: float = 2.0) -> Endpoints:
    """The running services, else (when the environment names none) services started with ``cfg``.

    Args:
        cfg: a :class:`bagua_lightning.services.deploy.UpConfig`: where to look when neither the
            environment nor the services file name the services (its ports, else the default ones), and what
            to start when nothing answers (on free ports where it names none).
        timeout_s: deadline of each health check, in seconds.

    Raises:
        ServiceUnavailableError: services named by the environment do not answer.
    """
    from bagua_lightning.services import deploy
    from bagua_lightning.services.health import check_autotune, check_redis

    named = bool(os.environ.get(ENV_AUTOTUNE) or os.environ.get(ENV_REDIS_HOSTS))
    recorded = read_services_file() is not None
    autotune = resolve_autotune_address(None if named or recorded else cfg.autotune_address)
    resolved = resolve_redis_hosts()
    hosts, cluster = resolved if resolved is not None else (
        [{"host": cfg.host, "port": cfg.first_redis_port + i} for i in range(cfg.nodes)], True)
    secrets = _secrets(autotune, hosts)
    from bagua_lightning.core.services_file import resolve_autotune_tls, resolve_redis_tls

    ca = resolve_autotune_tls(autotune)  # the deployment's pinned CA, for the addresses it records
    health = {"autotune": check_autotune(autotune, timeout_s, token=secrets.get(ENV_AUTOTUNE_TOKEN),
                                         tls_ca=Path(ca.ca) if ca is not None else None),
              "redis": check_redis(hosts, cluster, secrets.get(ENV_REDIS_PASSWORD), timeout_s,
                                   tls=resolve_redis_tls(hosts))}
    if all(h.healthy for h in health.values()):
        return Endpoints(autotune=autotune, redis_hosts=[_hostport(h) for h in hosts], cluster=cluster,
                         how="running", secrets=secrets, secret_files=_secret_files(secrets))
    if named:
        bad = "; ".join(f"{k}: {h.detail}" for k, h in health.items() if not h.healthy)
        raise ServiceUnavailableError(
            f"the services named by {ENV_AUTOTUNE}/{ENV_REDIS_HOSTS} do not answer ({bad}); start them "
            f"(`docker compose up -d --wait`), or unset both variables to let the demo start its own")
    info = deploy.ensure_up(cfg)
    secrets = _secrets(str(info.autotune), info.redis_hosts)
    return Endpoints(autotune=str(info.autotune), redis_hosts=[_hostport(h) for h in info.redis_hosts],
                     cluster=info.redis_cluster, how="started", secrets=secrets, secret_files=_secret_files(secrets))


def clear_demo_cache(endpoints: Endpoints, dataset_name: str) -> int:
    """Delete every cached version of the demo dataset; return the number of keys deleted."""
    from bagua_lightning.client.cache import RedisStore
    from bagua_lightning.client.cache.catalog import remove_dataset

    store = RedisStore(hosts=endpoints.redis_hosts, cluster_mode=True,
                       password=endpoints.secrets.get(ENV_REDIS_PASSWORD))
    try:
        return remove_dataset(store, dataset_name)
    finally:
        store.shutdown()


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    # A job is rank 0 plus the ranks Lightning started as its children, all in one process group.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)


def run_job(argv: list[str], env: dict[str, str], timeout_s: float) -> int:
    """Run one job (``python -m bagua_lightning.examples.demo ARGV``); its output goes to ours.

    The job is stopped (SIGTERM, then SIGKILL, every rank) on timeout and on Ctrl-C.
    """
    proc = subprocess.Popen([sys.executable, "-m", JOB_MODULE, *argv], env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        print(f"error: the job did not finish within {timeout_s:.0f} s (--timeout); stopped it", file=sys.stderr)
        return 124
    finally:
        _stop_group(proc)


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        return _demo(args)
    except (ConfigurationError, ServiceUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigurationError) else 1


def _demo(args: argparse.Namespace) -> int:
    from bagua_lightning.services.deploy import UpConfig

    from .demo_report import (
        DATASET_NAME,
        format_comparison,
        format_job,
        load_job,
        plot_trajectory,
    )

    preset = QUICK if args.quick else FULL
    epochs = args.epochs if args.epochs is not None else preset.epochs
    samples = args.samples if args.samples is not None else preset.samples
    transform_ms = args.transform_ms if args.transform_ms is not None else preset.transform_ms
    interval = args.autotune_interval if args.autotune_interval is not None else preset.autotune_interval
    for name, value in (("--jobs", args.jobs), ("--epochs", epochs), ("--samples", samples),
                        ("--batch-size", args.batch_size), ("--autotune-interval", interval)):
        if value < 1:
            raise ConfigurationError(f"{name} {value} must be a positive integer")
    if args.devices is not None and args.devices < 1:
        raise ConfigurationError(f"--devices {args.devices} must be a positive number of processes")
    if not args.timeout > 0:
        raise ConfigurationError(f"--timeout {args.timeout} must be > 0 seconds")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    endpoints = find_or_start_services(UpConfig(autotune_port=args.autotune_port, redis_port=args.redis_port,
                                                timeout_s=args.services_timeout))
    print(f"services ({'started by this demo' if endpoints.how == 'started' else 'already running'}): "
          f"autotune {endpoints.autotune}; redis {'cluster' if endpoints.cluster else 'server'} "
          f"{','.join(endpoints.redis_hosts)}", flush=True)
    if not args.keep_cache:
        deleted = clear_demo_cache(endpoints, DATASET_NAME)
        if deleted:
            print(f"removed {deleted} samples an earlier demo cached (--keep-cache keeps them)", flush=True)

    env = {**os.environ, **endpoints.env()}
    common = ["--out", str(out), "--epochs", str(epochs), "--samples", str(samples), "--batch-size",
              str(args.batch_size), "--transform-ms", str(transform_ms), "--autotune-interval", str(interval),
              "--algorithm", args.algorithm, "--workers", str(args.workers), "--dataset-name", DATASET_NAME,
              "--no-plot"]
    if args.devices is not None:
        common += ["--devices", str(args.devices)]
    jobs = []
    for i in range(1, args.jobs + 1):
        name = f"job{i}"
        (out / f"{name}.json").unlink(missing_ok=True)
        print(f"\n-- {name} of {args.jobs}: training (the first job computes every sample, later ones read "
              "the cache)" if i == 1 else f"\n-- {name} of {args.jobs}: the same job again", flush=True)
        rc = run_job([*common, "--job", name], env, args.timeout)
        if rc != 0:
            print(f"error: {name} exited with {rc}; its output is above", file=sys.stderr)
            return rc or 1
        jobs.append(load_job(out / f"{name}.json"))

    comparison = format_comparison(jobs)
    summary = "\n\n".join([*(format_job(j) for j in jobs), *([comparison] if comparison else [])])
    (out / "summary.txt").write_text(summary + "\n")
    plot = plot_trajectory(jobs, out / "autotune.png")
    print(f"\n{comparison}\n" if comparison else "")
    print(f"autotune trajectory plot: {plot}")
    print(f"summaries: {out / 'summary.txt'}; measurements: {', '.join(str(out / f'{j.job}.json') for j in jobs)}")
    if endpoints.how == "started":
        print("the services keep running (`bagua-lightning status`; `bagua-lightning down` stops them): the next "
              "demo starts on the plan tuned here, and with --keep-cache on the samples cached here")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the ``bagua-lightning`` command line."""
    from bagua_lightning.core.args import (
        non_negative_float_arg,
        non_negative_int_arg,
        port_arg,
        positive_float_arg,
        positive_int_arg,
    )
    from bagua_lightning.services.deploy import DEFAULT_AUTOTUNE_PORT, DEFAULT_REDIS_PORT

    p = subparsers.add_parser(
        "demo", help="run the main job: autotuned Lightning training on a Redis-cached dataset, twice",
        description="Run the main job: start the services when none answer, train a small model on 2 processes "
                    "(every GPU when there are some) with BaguaStrategy(autotune=True) and a Redis-cached dataset, "
                    "twice, and summarise what the autotuner and the cache did (a PNG plot included).")
    p.add_argument("--quick", action="store_true",
                   help=f"small jobs ({QUICK.samples} samples, {QUICK.epochs} epochs): a smoke run")
    p.add_argument("--jobs", type=positive_int_arg, default=2, help="jobs to run one after the other (default %(default)s)")
    p.add_argument("--epochs", type=positive_int_arg, default=None, help=f"epochs per job (default {FULL.epochs})")
    p.add_argument("--samples", type=positive_int_arg, default=None, help=f"dataset size (default {FULL.samples})")
    p.add_argument("--batch-size", type=positive_int_arg, default=32, help="per process (default %(default)s)")
    p.add_argument("--devices", "--processes", dest="devices", type=positive_int_arg, default=None,
                   help="training processes (default: every GPU, else 2 CPU processes)")
    p.add_argument("--transform-ms", type=non_negative_float_arg, default=None,
                   help=f"slow transform per sample, ms (default {FULL.transform_ms})")
    p.add_argument("--autotune-interval", type=positive_int_arg, default=None,
                   help=f"steps between autotune step boundaries (default {FULL.autotune_interval})")
    p.add_argument("--algorithm", choices=("gradient_allreduce", "bytegrad"), default="gradient_allreduce",
                   help="(default %(default)s)")
    p.add_argument("--workers", type=non_negative_int_arg, default=0, help="DataLoader workers per process (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default ./%(default)s)")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep samples earlier demo runs cached (the first job then reads them too)")
    p.add_argument("--autotune-port", type=port_arg, default=None,
                   help="where to look for / start the autotune service when the environment and the services "
                        f"file name none (default: look on {DEFAULT_AUTOTUNE_PORT}, start on a free port)")
    p.add_argument("--redis-port", type=port_arg, default=None,
                   help=f"first port of the Redis Cluster, likewise (default: look on {DEFAULT_REDIS_PORT}.., "
                        "start on a free block: client ports and bus ports + 10000)")
    p.add_argument("--services-timeout", type=positive_float_arg, default=90.0,
                   help="seconds for started services to become healthy (default %(default)s)")
    p.add_argument("--timeout", type=positive_float_arg, default=1800.0, help="seconds per job (default %(default)s)")
    p.set_defaults(func=_cmd_demo)
