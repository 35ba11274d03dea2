"""``bagua-lightning up | down | status``: the autotune service and a Redis deployment as local processes.

The embedded counterpart of ``docker-compose.yml``: the same two services, started natively as detached
background processes (own session, logs under :func:`~bagua_lightning.services_file.state_dir`), the
autotune service keeping its persisted plans in the Redis deployment. ``up`` waits until both are healthy
(gRPC health ``SERVING``; every Redis node answering and, for a cluster, all 16384 slots served), then
records their addresses and pids in the services file, where ``BaguaStrategy(autotune=True)`` and
``CachedDataset`` find them. ``up`` on healthy recorded services does nothing; ``down`` stops what ``up``
started (pids checked against ``/proc/<pid>/cmdline``, so a recycled pid is never signalled) and removes
the file.

The argv of the autotune service comes from one function, :func:`autotune_service_args`, which both this
launcher and ``docker-compose.yml`` use (a test compares them). No torch is imported here: the module runs
in the torch-free service image, whose healthcheck is ``bagua-lightning status --autotune HOST:PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bagua_lightning.errors import ConfigurationError
from bagua_lightning.services.health import Health, check_autotune, check_redis, wait_healthy
from bagua_lightning.services.processes import is_autotune_pid, stop_pid
from bagua_lightning.services_file import (
    DEFAULT_AUTOTUNE_ADDRESS,
    ENV_REDIS_PASSWORD,
    ServicesInfo,
    read_services_file,
    remove_services_file,
    resolve_autotune_address,
    resolve_redis_hosts,
    services_file_path,
    state_dir,
    write_services_file,
)

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_AUTOTUNE_PORT = int(DEFAULT_AUTOTUNE_ADDRESS.rpartition(":")[2])
DEFAULT_REDIS_PORT = 7000  # first node of the local cluster; the trainer's documented default
DEFAULT_MAXMEMORY = 1024**3  # bytes per Redis node; docker-compose.yml uses the same default ("1gb")
AUTOTUNE_LOG = "autotune.log"
AUTOTUNE_SAMPLES = "autotune-samples"  # folder of the service's per-model sample logs
_SIZE = re.compile(r"^\s*(\d+)\s*(b|k|kb|m|mb|g|gb)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3}


def autotune_service_args(*, host: str, port: int, state: str, log_dir: str) -> list[str]:
    """The autotune service's arguments after the program name (``bagua-lightning``).

    The single source of truth for how the service is run: ``up`` prefixes it with
    ``python -m bagua_lightning.cli``; ``docker-compose.yml`` uses it as the ``command`` of the image
    whose entrypoint is ``bagua-lightning`` (with ``host="0.0.0.0"``, so that published ports reach it).

    Args:
        host: address to bind.
        port: gRPC port.
        state: where persisted plans live: a directory or a ``redis://host:port`` URL.
        log_dir: folder for the per-model JSONL log of every tuning sample.
    """
    return ["autotune", "serve", "--host", host, "--port", str(port), "--state", state, "--log-dir", log_dir]


def redis_state_url(host: str, port: int) -> str:
    """The ``--state`` value that keeps the autotune service's plans in the Redis node ``host:port``.

    The password is never part of the URL (it would show in ``ps``); the service reads it from
    ``BAGUA_LIGHTNING_REDIS_PASSWORD``.
    """
    return f"redis://{_bracket(host)}:{port}"


def parse_bytes(text: str | int) -> int:
    """``1073741824``, ``"1gb"``, ``"512mb"``, ``"64k"`` -> bytes (1024-based, as Redis reads them)."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        if match is None:
            raise ConfigurationError(f"size {text!r} is not bytes; give e.g. 1073741824, 1gb, 512mb or 0.")
        value = int(match.group(1)) * _UNITS[(match.group(2) or "").lower() or None]
    if value < 0:
        raise ConfigurationError(f"size {text!r} is negative; give bytes, 0 for no limit.")
    return value


@dataclass(kw_only=True)
class UpConfig:
    """What ``bagua-lightning up`` starts.

    Attributes:
        host: address both services bind and that clients are given; loopback by default. For trainers on
            other machines give this machine's address (and set ``BAGUA_LIGHTNING_REDIS_PASSWORD``).
        autotune_port: gRPC port of the autotune service.
        redis_port: first Redis port; cluster node i listens on ``redis_port + i`` (bus: ``+ 10000``).
        nodes: Redis Cluster masters.
        replicas: replicas per master (0 or 1 make sense on one machine).
        single: one standalone Redis instead of a cluster (``nodes``/``replicas`` must stay default).
        maxmemory: bytes per Redis node, 0 for no limit.
        timeout_s: deadline for both services to become healthy, in seconds.
    """

    host: str = DEFAULT_HOST
    autotune_port: int = DEFAULT_AUTOTUNE_PORT
    redis_port: int = DEFAULT_REDIS_PORT
    nodes: int = 3
    replicas: int = 0
    single: bool = False
    maxmemory: int = DEFAULT_MAXMEMORY
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.autotune_port <= 65535:
            raise ConfigurationError(f"autotune_port {self.autotune_port} is not a TCP port (1..65535).")
        if not 1 <= self.redis_port <= 65535:
            raise ConfigurationError(f"redis_port {self.redis_port} is not a TCP port (1..65535).")
        if self.nodes < 1:
            raise ConfigurationError(f"nodes={self.nodes}: a cluster needs at least one master.")
        if self.replicas < 0:
            raise ConfigurationError(f"replicas={self.replicas} is negative; use 0 or 1.")
        if self.single and (self.nodes != 3 or self.replicas):
            raise ConfigurationError(
                f"--single starts one standalone Redis; drop --nodes {self.nodes} / --replicas {self.replicas}."
            )
        redis_ports = range(self.redis_port, self.redis_port + self.redis_node_count)
        if self.autotune_port in redis_ports:
            raise ConfigurationError(
                f"autotune_port {self.autotune_port} collides with the Redis ports {redis_ports.start}.."
                f"{redis_ports.stop - 1}; pick another --autotune-port or --redis-port."
            )
        if self.maxmemory < 0:
            raise ConfigurationError(f"maxmemory {self.maxmemory} is negative; give bytes, 0 for no limit.")
        if not self.timeout_s > 0:
            raise ConfigurationError(f"timeout_s {self.timeout_s} must be > 0 seconds.")

    @property
    def redis_node_count(self) -> int:
        return 1 if self.single else self.nodes * (1 + self.replicas)

    @property
    def autotune_address(self) -> str:
        return f"{_bracket(self.host)}:{self.autotune_port}"


def start_autotune(cfg: UpConfig, state: str, folder: Path) -> subprocess.Popen[bytes]:
    """Start the autotune service detached (own session, stdin closed), logging to ``folder/autotune.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "bagua_lightning.cli",
            *autotune_service_args(host=cfg.host, port=cfg.autotune_port, state=state,
                                   log_dir=str(folder / AUTOTUNE_SAMPLES))]
    env = dict(os.environ)
    with open(folder / AUTOTUNE_LOG, "ab") as log_file:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, cwd=folder, start_new_session=True, close_fds=True)


# ------------------------------------------------------------------------------------------ up / down


def running_services(info: ServicesInfo | None, password: str | None = None) -> dict[str, Health]:
    """Health of each service recorded in ``info`` (``autotune``, ``redis``); empty when none."""
    if info is None:
        return {}
    out: dict[str, Health] = {}
    if info.autotune:
        pid = info.pids.get("autotune")
        if isinstance(pid, int) and not is_autotune_pid(pid):
            out["autotune"] = Health(False, f"process {pid} is gone")
        else:
            out["autotune"] = check_autotune(info.autotune)
    if info.redis_hosts:
        from bagua_lightning.services.redis_cluster import is_redis_pid

        gone = [p for p in info.pids.get("redis") or [] if not is_redis_pid(int(p))]
        out["redis"] = (Health(False, f"processes {gone} are gone") if gone
                        else check_redis(info.redis_hosts, info.redis_cluster, password))
    return out


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    # Two `up`s at once (two shells, the ranks of a job) would race for the same ports: one at a time.
    path = services_file_path().with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def up(cfg: UpConfig) -> ServicesInfo:
    """Start both services (or find them already running and healthy) and write the services file.

    Calls are serialised through a lock file beside the services file.

    Raises:
        ConfigurationError: bad settings, services running with other settings, or a port is taken.
        ServiceUnavailableError: a service did not become healthy before ``cfg.timeout_s``; everything
            this call started is stopped again.
    """
    with _exclusive():
        return _up(cfg)


def _up(cfg: UpConfig) -> ServicesInfo:
    from bagua_lightning.services import redis_cluster

    password = os.environ.get(ENV_REDIS_PASSWORD) or None
    existing = read_services_file()
    health = running_services(existing, password)
    if existing is not None and health and all(h.healthy for h in health.values()):
        differences = _differences(existing, cfg)
        if differences:
            raise ConfigurationError(
                f"services are already running with other settings ({'; '.join(differences)}); stop them with "
                "`bagua-lightning down` first, or run `up` with the same options."
            )
        log.info("services already running and healthy (%s)", services_file_path())
        return existing
    if existing is not None:
        log.info("recorded services are not all healthy (%s); restarting them",
                 ", ".join(f"{k}: {h.detail}" for k, h in health.items()))
        _down()
    if not _is_loopback(cfg.host) and password is None:
        log.warning("Redis will listen on %s without a password; set %s", cfg.host, ENV_REDIS_PASSWORD)
    _require_free_ports(cfg)
    folder = state_dir()
    deadline = time.monotonic() + cfg.timeout_s
    spec = redis_cluster.ClusterSpec(
        nodes=1 if cfg.single else cfg.nodes, replicas=cfg.replicas, port=cfg.redis_port, host=cfg.host,
        maxmemory=cfg.maxmemory, password=password, cluster=not cfg.single, state_root=folder,
        timeout_s=cfg.timeout_s,
    )
    cluster = redis_cluster.start_cluster(spec)
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = start_autotune(cfg, redis_state_url(cfg.host, cfg.redis_port), folder)
        wait_healthy(lambda: check_autotune(cfg.autotune_address), deadline,
                      f"the autotune service on {cfg.autotune_address}", proc, folder / AUTOTUNE_LOG)
        info = ServicesInfo(
            autotune=cfg.autotune_address,
            redis_hosts=cluster.hosts,
            redis_cluster=cluster.cluster,
            state_dir=str(folder),
            pids={"autotune": proc.pid, "redis": cluster.pids},
        )
        write_services_file(info)
        return info
    except BaseException:
        if proc is not None:
            stop_pid(proc.pid, lambda p: proc.poll() is None)
        redis_cluster.stop_cluster(cfg.redis_port, folder)
        raise


def ensure_up(cfg: UpConfig | None = None) -> ServicesInfo:
    """The recorded services when they are healthy, whatever their settings; else :func:`up` with ``cfg``.

    For callers that only need services to exist (the demo), not particular ports.
    """
    with _exclusive():
        existing = read_services_file()
        health = running_services(existing, os.environ.get(ENV_REDIS_PASSWORD) or None)
        if existing is not None and health and all(h.healthy for h in health.values()):
            return existing
        return _up(cfg or UpConfig())


def _differences(info: ServicesInfo, cfg: UpConfig) -> list[str]:
    found = []
    if info.autotune != cfg.autotune_address:
        found.append(f"autotune on {info.autotune}, asked {cfg.autotune_address}")
    first = info.redis_hosts[0] if info.redis_hosts else {}
    if (first.get("host"), first.get("port")) != (cfg.host, cfg.redis_port):
        found.append(f"Redis from {first.get('host')}:{first.get('port')}, asked {cfg.host}:{cfg.redis_port}")
    if info.redis_cluster == cfg.single:
        found.append("a cluster, asked --single" if info.redis_cluster else "--single, asked a cluster")
    nodes = len(info.pids.get("redis") or [])
    if nodes and nodes != cfg.redis_node_count:
        found.append(f"{nodes} Redis nodes, asked {cfg.redis_node_count}")
    return found


def down(timeout_s: float = 10.0) -> list[int]:
    """Stop everything the services file records and remove the file; return the pids stopped."""
    with _exclusive():
        return _down(timeout_s)


def _down(timeout_s: float = 10.0) -> list[int]:
    from bagua_lightning.services import redis_cluster

    info = read_services_file()
    if info is None:
        remove_services_file()
        return []
    stopped: list[int] = []
    pid = info.pids.get("autotune")
    if isinstance(pid, int) and stop_pid(pid, is_autotune_pid, timeout_s):
        stopped.append(pid)
    root = Path(info.state_dir) if info.state_dir else None
    if info.redis_hosts:
        stopped += redis_cluster.stop_cluster(int(info.redis_hosts[0]["port"]), root)
    for redis_pid in info.pids.get("redis") or []:  # nodes the deployment record may have lost
        if redis_cluster.is_redis_pid(int(redis_pid)):
            redis_cluster.stop_pid(int(redis_pid), timeout_s)
            stopped.append(int(redis_pid))
    remove_services_file()
    return sorted(set(stopped))


def _require_free_ports(cfg: UpConfig) -> None:
    """Fail early, naming the port and the flag, instead of finding a foreign server healthy."""
    wanted = [("--autotune-port", cfg.autotune_port)]
    for i in range(cfg.redis_node_count):
        wanted.append(("--redis-port", cfg.redis_port + i))
        if not cfg.single:
            wanted.append(("--redis-port (cluster bus, port + 10000)", cfg.redis_port + i + 10000))
    for flag, port in wanted:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # Like the servers themselves: a port in TIME_WAIT is free, a listening one is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((cfg.host, port))
            except OSError as exc:
                raise ConfigurationError(
                    f"port {port} on {cfg.host} is not free ({exc.strerror}); stop what uses it "
                    f"(`bagua-lightning down`, `bagua-lightning redis down`) or pick another {flag}."
                ) from exc


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _parse_hosts(text: str) -> list[dict[str, Any]]:
    hosts = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"Redis address {item!r} is not host:port; give e.g. 127.0.0.1:7000.")
        hosts.append({"host": host.strip("[]"), "port": int(port)})
    return hosts


# ------------------------------------------------------------------------------------------------- CLI


def _print_info(info: ServicesInfo) -> None:
    redis_hosts = ",".join(f"{_bracket(h['host'])}:{h['port']}" for h in info.redis_hosts)
    print(f"autotune service: {info.autotune}")
    print(f"redis {'cluster' if info.redis_cluster else 'server'}: {redis_hosts}")
    print(f"services file: {services_file_path()}")
    print(f"logs and data: {info.state_dir}")
    print(f"trainers on this machine find them through the services file; elsewhere set "
          f"BAGUA_LIGHTNING_AUTOTUNE_SERVICE={info.autotune} BAGUA_LIGHTNING_REDIS_HOSTS={redis_hosts}")


def _cmd_up(args: argparse.Namespace) -> int:
    cfg = UpConfig(host=args.host, autotune_port=args.autotune_port, redis_port=args.redis_port,
                   nodes=args.nodes, replicas=args.replicas, single=args.single,
                   maxmemory=parse_bytes(args.maxmemory), timeout_s=args.timeout)
    _print_info(up(cfg))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    path = services_file_path()
    had_file = path.exists()
    stopped = down(timeout_s=args.timeout)
    if not had_file:
        print(f"nothing to stop: no services file at {path}")
    else:
        print(f"stopped {len(stopped)} process(es){': ' + ' '.join(map(str, stopped)) if stopped else ''}; "
              f"removed {path}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    password = os.environ.get(ENV_REDIS_PASSWORD) or None
    report: dict[str, Health]
    if args.autotune or args.redis:
        report = {}
        if args.autotune:
            report["autotune"] = check_autotune(args.autotune, args.timeout)
        if args.redis:
            report["redis"] = check_redis(_parse_hosts(args.redis), not args.single, password, args.timeout)
    else:
        report = running_services(read_services_file(), password)
        if not report:
            # Nothing recorded (e.g. `docker compose up`): check where trainers would look.
            autotune = resolve_autotune_address()
            resolved = resolve_redis_hosts()
            hosts, cluster = resolved if resolved is not None else (
                [{"host": DEFAULT_HOST, "port": DEFAULT_REDIS_PORT + i} for i in range(3)], True)
            print(f"no services recorded at {services_file_path()} (`bagua-lightning up` records them); "
                  "checking the environment's or the default addresses", file=sys.stderr)
            report = {"autotune": check_autotune(autotune, args.timeout),
                      "redis": check_redis(hosts, cluster, password, args.timeout)}
    if args.json:
        print(json.dumps({k: {"healthy": h.healthy, "detail": h.detail} for k, h in report.items()}))
    else:
        for name, health in report.items():
            print(f"{name}: {'healthy' if health.healthy else 'UNHEALTHY'} ({health.detail})")
    return 0 if all(h.healthy for h in report.values()) else 1


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``up``, ``down`` and ``status`` to the ``bagua-lightning`` command line."""
    p = subparsers.add_parser("up", help="start the autotune service and a local Redis Cluster in the background",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind and to give clients (default %(default)s)")
    p.add_argument("--autotune-port", type=int, default=DEFAULT_AUTOTUNE_PORT, help="default %(default)s")
    p.add_argument("--redis-port", type=int, default=DEFAULT_REDIS_PORT,
                   help="first Redis port; node i uses port + i (default %(default)s)")
    p.add_argument("--nodes", type=int, default=3, help="Redis Cluster masters (default %(default)s)")
    p.add_argument("--replicas", type=int, default=0, help="replicas per master (default %(default)s)")
    p.add_argument("--single", action="store_true", help="one standalone Redis instead of a cluster")
    p.add_argument("--maxmemory", default=str(DEFAULT_MAXMEMORY),
                   help="bytes per Redis node, e.g. 1gb, 0 for no limit (default 1gb)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for health (default %(default)s)")
    p.set_defaults(func=_cmd_up)

    p = subparsers.add_parser("down", help="stop what `bagua-lightning up` started and remove the services file")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds per process between SIGTERM and SIGKILL (default %(default)s)")
    p.set_defaults(func=_cmd_down)

    p = subparsers.add_parser("status", help="health of the recorded services (exit 1 when one is unhealthy)")
    p.add_argument("--autotune", metavar="HOST:PORT", help="check this autotune service instead of the file's")
    p.add_argument("--redis", metavar="HOST:PORT[,...]", help="check these Redis nodes instead of the file's")
    p.add_argument("--single", action="store_true", help="with --redis: standalone servers, not a cluster")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds per check (default %(default)s)")
    p.set_defaults(func=_cmd_status)
