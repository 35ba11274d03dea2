"""``bagua-lightning up | down | status``: the command line of :mod:`.deploy`.

``status`` with nothing recorded checks where trainers would look (the environment's addresses, else the
defaults) and lists the node-local cache server; it imports neither torch nor Lightning and answers in well
under a second when nothing runs (connections to closed local ports fail at once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..core.addresses import format_address, parse_address, parse_host_list
from ..core.args import non_negative_int_arg, port_arg, positive_float_arg, positive_int_arg, size_arg
from ..core.errors import ConfigurationError
from ..core.read_plane import READ_PORT_OFFSET_ENV, READER_USER
from ..core.services_file import (
    ENV_AUTOTUNE,
    ENV_LIGHTHOUSE,
    ENV_REDIS_HOSTS,
    ServicesInfo,
    read_services_file,
    resolve_autotune_address,
    resolve_autotune_tls,
    resolve_autotune_token,
    resolve_redis_hosts,
    resolve_redis_password,
    resolve_redis_tls,
    services_file_path,
)
from . import deploy
from .health import Health, check_autotune, check_lighthouse, check_redis


def _read_ports(info: ServicesInfo | None) -> list[tuple[str, int]]:
    """``(host, port)`` of the recorded Redis hosts' plaintext read ports; empty without read ports."""
    offset = info.redis_read_port_offset if info is not None else None
    if info is None or offset is None:
        return []
    return [(str(h["host"]), int(h["port"]) + offset) for h in info.redis_hosts]


def _read_ports_line(info: ServicesInfo, timeout_s: float | None = None) -> str | None:
    """One line naming the read ports (with ``timeout_s``: how many let the reader in); None without any."""
    from ..core.errors import ServiceUnavailableError
    from ..core.redis_server import check_reader

    ports = _read_ports(info)
    if not ports:
        return None
    line = (f"redis read ports: {','.join(format_address(h, p) for h, p in ports)} (every node's port "
            f"{info.redis_read_port_offset:+d}, replicas too; plaintext, user {READER_USER} without password: "
            "GET/MGET/PING of sealed entries")
    if timeout_s is None:
        return line + ")"
    answering = 0
    for host, port in ports:
        with contextlib.suppress(ServiceUnavailableError):
            check_reader(host, port, timeout_s)
            answering += 1
    return line + f"; {answering} of {len(ports)} answer)"


def _print_info(info: ServicesInfo) -> None:
    redis_hosts = ",".join(format_address(h["host"], h["port"]) for h in info.redis_hosts)
    print(f"autotune service: {info.autotune}")
    if info.lighthouse:
        print(f"lighthouse (fault tolerance): http://{info.lighthouse} (no credentials or TLS: torchft 0.2.0)")
    print(f"redis {'cluster' if info.redis_cluster else 'server'}: {redis_hosts}")
    read_line = _read_ports_line(info)
    if read_line:
        print(read_line)
    print(f"services file: {services_file_path()}")
    print(f"logs and data: {info.state_dir}")
    if info.secrets:
        print(f"secrets (0600 files): {Path(next(iter(info.secrets.values()))).parent}")
    offset = "" if info.redis_read_port_offset is None else f" {READ_PORT_OFFSET_ENV}={info.redis_read_port_offset}"
    lighthouse = f" {ENV_LIGHTHOUSE}=http://{info.lighthouse}" if info.lighthouse else ""
    print(f"trainers on this machine find them through the services file; elsewhere set "
          f"{ENV_AUTOTUNE}={info.autotune} {ENV_REDIS_HOSTS}={redis_hosts}{offset}{lighthouse} and the secrets "
          "(docs/deployment.md)")


def _cmd_up(args: argparse.Namespace) -> int:
    cfg = deploy.UpConfig(host=args.host, announce_ip=args.announce_ip, autotune_port=args.autotune_port,
                          redis_port=args.redis_port, lighthouse_port=args.lighthouse_port,
                          lighthouse=not args.no_lighthouse,
                          nodes=args.nodes, replicas=args.replicas, single=args.single, maxmemory=args.maxmemory,
                          timeout_s=args.timeout, auth=not args.no_auth, read_ports=not args.no_read_ports)
    _print_info(deploy.up(cfg, fresh=args.fresh, report=lambda line: print(line, flush=True)))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    path = services_file_path()
    report = deploy.stop_all(timeout_s=args.timeout, local=not args.keep_local)
    if not report.removed and not report.stopped:
        print(f"nothing to stop: no services file at {path} and no node-local cache server")
        return 0
    if report.stopped:
        print(f"stopped {len(report.stopped)} process(es): {' '.join(map(str, report.stopped))}")
    for line in report.removed:
        print(line)
    return 0


def _cmd_rotate(args: argparse.Namespace) -> int:
    from . import rotate

    if args.finish:
        if args.autotune_token or args.grace is not None:
            raise ConfigurationError("--finish ends an open rotation of the Redis password (alone or with "
                                     "--redis-password) or of the cache key (--cache-key); the token has none.")
        if args.redis_password or not args.cache_key:
            rotate.finish()
        if args.cache_key:
            rotate.finish_cache_key()
    else:
        rotate.rotate(redis_password=args.redis_password, autotune_token=args.autotune_token,
                      cache_key=args.cache_key, grace_s=args.grace)
    return 0


def _local_health() -> Health | None:
    from ..core.local_redis import server_status

    found = server_status()
    if found is None:
        return None
    detail = f"{found['address']} pid {found['pid']} maxmemory {found['maxmemory']}"
    if found.get("up"):
        return Health(True, f"{detail}, {found['keys']} keys, {found['used_memory']} bytes used")
    if found.get("stale"):
        return Health(False, f"{detail}: process gone; `bagua-lightning down` removes the record", stale=True)
    return Health(False, f"{detail}: {found.get('error', 'process gone')}")


def _autotune_ca(address: str, given: Path | None) -> Path | None:
    """``--tls-ca``, else ``$BAGUA_LIGHTNING_TLS_CA``, else the services file's CA for the address it records."""
    found = resolve_autotune_tls(address, ca=given)
    return Path(found.ca) if found is not None else None


def _cmd_status(args: argparse.Namespace) -> int:
    report: dict[str, Health]
    tls_ca = args.tls_ca
    info = None
    if args.autotune or args.redis or args.lighthouse:
        report = {}
        if args.lighthouse:
            report["lighthouse"] = check_lighthouse(format_address(*parse_address(
                args.lighthouse.split("://", 1)[-1].rstrip("/"), "--lighthouse")), args.timeout)
        if args.autotune:
            parse_address(args.autotune, "--autotune")
            report["autotune"] = check_autotune(args.autotune, args.timeout, token=resolve_autotune_token(args.autotune),
                                                tls_ca=_autotune_ca(args.autotune, tls_ca))
        if args.redis:
            named = parse_host_list(args.redis, "--redis")
            report["redis"] = check_redis(named, not args.single, resolve_redis_password(named), args.timeout,
                                          tls=resolve_redis_tls(named, ca=tls_ca))
    else:
        info = read_services_file()
        report = deploy.running_services(info)
        if not report:
            # Nothing recorded (e.g. `docker compose up`): check where trainers would look.
            autotune = resolve_autotune_address()
            resolved = resolve_redis_hosts()
            hosts, cluster = resolved if resolved is not None else (
                [{"host": deploy.DEFAULT_HOST, "port": deploy.DEFAULT_REDIS_PORT + i} for i in range(3)], True)
            print(f"no services recorded at {services_file_path()} (`bagua-lightning up` records them); "
                  "checking the environment's or the default addresses", file=sys.stderr)
            report = {"autotune": check_autotune(autotune, args.timeout, token=resolve_autotune_token(autotune),
                                                 tls_ca=_autotune_ca(autotune, tls_ca)),
                      "redis": check_redis(hosts, cluster, resolve_redis_password(hosts), args.timeout,
                                           tls=resolve_redis_tls(hosts, ca=tls_ca))}
            if os.environ.get(ENV_LIGHTHOUSE):  # trainers have no default Lighthouse: only the variable's
                report["lighthouse"] = check_lighthouse(os.environ[ENV_LIGHTHOUSE], args.timeout)
        local = _local_health()
        if local is not None:
            report["node-local redis"] = local
    if args.json:
        out = {k: {"healthy": h.healthy, "detail": h.detail, **({"stale": True} if h.stale else {})}
               for k, h in report.items()}
        read_ports = _read_ports(info)
        if read_ports and "redis" in out:
            out["redis"]["read_ports"] = [format_address(h, p) for h, p in read_ports]
        print(json.dumps(out))
    else:
        for name, health in report.items():
            print(f"{name}: {health.label} ({health.detail})")
        read_line = _read_ports_line(info, args.timeout) if info is not None else None
        if read_line:
            print(read_line)
    return 0 if all(h.ok for h in report.values()) else 1


def register(subparsers: Any) -> None:
    """Add ``up``, ``down``, ``status`` and ``rotate-secrets`` to the ``bagua-lightning`` command line."""
    p = subparsers.add_parser("up", help="start the autotune service, a local Redis Cluster and the fault-tolerance "
                                         "coordinator in the background",
                              description=(deploy.__doc__ or "").split("\n\n")[0] or None)
    p.add_argument("--host", default=deploy.DEFAULT_HOST,
                   help="address to bind and to give clients; a name is resolved (default %(default)s)")
    p.add_argument("--announce-ip", default=None, metavar="ADDRESS",
                   help="with --host 0.0.0.0: the address clients and Redis nodes are given (default: a "
                        "non-loopback address of this machine)")
    p.add_argument("--autotune-port", type=port_arg, default=None,
                   help=f"default: the recorded one, else {deploy.DEFAULT_AUTOTUNE_PORT} when free, else a free one")
    p.add_argument("--redis-port", type=port_arg, default=None,
                   help="first Redis port; node i uses port + i (TLS only) and its bus port + 10000 "
                        f"(default: the recorded one, else {deploy.DEFAULT_REDIS_PORT} when all are free, else a "
                        "free block)")
    p.add_argument("--lighthouse-port", type=port_arg, default=None,
                   help="port of the fault-tolerance coordinator (torchft's Lighthouse; default: the recorded one, "
                        f"else {deploy.DEFAULT_LIGHTHOUSE_PORT} when free, else a free one below "
                        f"{deploy.DEFAULT_AUTOTUNE_PORT})")
    p.add_argument("--no-lighthouse", action="store_true",
                   help="start no Lighthouse (it has no credentials or TLS: `up` warns when --host is not loopback)")
    p.add_argument("--nodes", type=positive_int_arg, default=3, help="Redis Cluster masters (default %(default)s)")
    p.add_argument("--replicas", type=non_negative_int_arg, default=None,
                   help="replicas per master: 1 (default) fails a dead master over; 0: no failover")
    p.add_argument("--single", action="store_true", help="one standalone Redis instead of a cluster")
    p.add_argument("--maxmemory", type=size_arg, default=deploy.DEFAULT_MAXMEMORY,
                   help="bytes per Redis node, e.g. 1gb, 0 for no limit (default 1gb)")
    p.add_argument("--timeout", type=positive_float_arg, default=60.0,
                   help="seconds to wait for health (default %(default)s)")
    p.add_argument("--no-auth", action="store_true",
                   help="no Redis password, autotune token or cache key (loopback only)")
    p.add_argument("--no-read-ports", action="store_true",
                   help="no plaintext read ports (trainers then read sealed entries over TLS); they serve sealed "
                        "cache entries only, without a password, so `up` warns when --host is not loopback")
    p.add_argument("--fresh", action="store_true",
                   help="stop whatever is recorded and start over: new secrets, an empty cache (default: keep "
                        "what is alive, restart only what is dead)")
    p.set_defaults(func=_cmd_up)

    p = subparsers.add_parser("down", help="stop what `bagua-lightning up` started and the node-local cache server")
    p.add_argument("--timeout", type=positive_float_arg, default=10.0,
                   help="seconds per process between SIGTERM and SIGKILL (default %(default)s)")
    p.add_argument("--keep-local", action="store_true", help="leave the node-local cache server running")
    p.set_defaults(func=_cmd_down)

    p = subparsers.add_parser("status", help="health of the recorded services (exit 1 when one is unhealthy; "
                                             "a stale node-local record is not)")
    p.add_argument("--autotune", metavar="HOST:PORT", help="check this autotune service instead of the file's")
    p.add_argument("--redis", metavar="HOST:PORT[,...]", help="check these Redis nodes instead of the file's")
    p.add_argument("--lighthouse", metavar="HOST:PORT",
                   help="check this Lighthouse (fault-tolerance coordinator; http:// optional) instead of the file's")
    p.add_argument("--single", action="store_true", help="with --redis: standalone servers, not a cluster")
    p.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="speak TLS to the services, trusting only this CA certificate (default: "
                        "$BAGUA_LIGHTNING_TLS_CA, else the services file's CA for the addresses it records)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=positive_float_arg, default=2.0, help="seconds per check (default %(default)s)")
    p.set_defaults(func=_cmd_status)

    p = subparsers.add_parser("rotate-secrets", help="new secrets for the running services (online for the "
                                                     "Redis password; docs/deployment.md)")
    p.add_argument("--redis-password", action="store_true",
                   help="add a new Redis password beside the old one (both work until --finish or --grace)")
    p.add_argument("--autotune-token", action="store_true", help="a new token; restarts the autotune service")
    p.add_argument("--cache-key", action="store_true",
                   help="a new cache key; the old one opens entries too until --cache-key --finish")
    p.add_argument("--grace", type=positive_float_arg, default=None, metavar="SECONDS",
                   help="with --redis-password: wait this long, then remove the old password")
    p.add_argument("--finish", action="store_true",
                   help="remove the old Redis password (or, with --cache-key, the old cache key) of an open rotation")
    p.set_defaults(func=_cmd_rotate)
