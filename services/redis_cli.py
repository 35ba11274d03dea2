"""``bagua-lightning redis up | down | status``: a local Redis Cluster (or one server) for the sample cache.

``up`` requires a password by default: ``--password-file`` names a file holding it, else
``$BAGUA_LIGHTNING_REDIS_PASSWORD``, else a random one is made. It is kept in the deployment's 0600
``password`` file (printed by ``up``), reaches the servers through a pipe and never appears on a command
line or in ``redis.conf``. ``status`` and ``down`` also cover the node-local cache server that
``CachedDataset(hosts=None)`` starts.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path
from typing import Any

from ..core import procs
from ..core.addresses import check_host, is_loopback
from ..core.args import non_negative_int_arg, port_arg, positive_float_arg, positive_int_arg, size_arg
from ..core.errors import ConfigurationError
from ..core.redis_server import DEFAULT_NODE_TIMEOUT_MS
from ..core.services_file import ENV_REDIS_HOSTS, ENV_REDIS_PASSWORD, FILE_SUFFIX
from . import redis_cluster


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("redis", help="a local Redis Cluster for the sample cache")
    sub = parser.add_subparsers(dest="redis_command", metavar="ACTION", required=True)

    up = sub.add_parser("up", help="start a local Redis Cluster and wait until all 16384 slots are served")
    up.add_argument("--nodes", type=positive_int_arg, default=None, help="masters (default 3)")
    up.add_argument("--replicas", type=non_negative_int_arg, default=None,
                    help="replicas per master: 1 (default for a cluster) fails a dead master over; 0: no failover")
    up.add_argument("--port", type=port_arg, default=redis_cluster.DEFAULT_PORT,
                    help=f"first port; nodes use consecutive ports (default {redis_cluster.DEFAULT_PORT})")
    up.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    up.add_argument("--announce-ip", default=None, metavar="ADDRESS",
                    help="with --host 0.0.0.0: the address nodes give clients and each other")
    up.add_argument("--maxmemory", type=size_arg, default=0,
                    help="per-node memory limit, e.g. 4gb (default: none); LFU eviction beyond it")
    up.add_argument("--password-file", type=Path, default=None,
                    help=f"file holding the password (default: ${ENV_REDIS_PASSWORD}, else a random one)")
    up.add_argument("--no-password", action="store_true", help="no password (loopback only)")
    up.add_argument("--single", action="store_true", help="one standalone server instead of a cluster")
    up.add_argument("--node-timeout-ms", type=positive_int_arg, default=DEFAULT_NODE_TIMEOUT_MS,
                    help=f"cluster-node-timeout: failover detection time (default {DEFAULT_NODE_TIMEOUT_MS})")
    up.add_argument("--plain-bus", action="store_true",
                    help="cluster bus without TLS: any local process can join the cluster (not for shared machines)")
    up.add_argument("--timeout", type=positive_float_arg, default=60.0, help="start-up deadline in seconds (default 60)")
    _state_dir_option(up)
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop the local Redis deployment(s) and the node-local cache server")
    down.add_argument("--port", type=port_arg, default=None,
                      help="only the deployment with this first port (the node-local server stays)")
    down.add_argument("--keep-data", action="store_true", help="keep the data folders")
    down.add_argument("--keep-local", action="store_true", help="leave the node-local cache server running")
    _state_dir_option(down)
    down.set_defaults(func=_down)

    certs = sub.add_parser("certs", help="make a CA and node certificates for a cluster bus over mutual TLS "
                                         "(docker-compose.yml's redis-certs service); keeps complete existing ones")
    certs.add_argument("--dir", type=Path, required=True, help="folder for ca.crt and node-<port>.{crt,key} (0700)")
    certs.add_argument("--ports", required=True, metavar="FIRST-LAST", type=_port_range,
                       help="the nodes' client ports, e.g. 7000-7005 (one certificate each)")
    certs.add_argument("--host", action="append", default=[], metavar="ADDRESS",
                       help="address the nodes are reached at, for the certificates' subjectAltName (repeatable)")
    certs.set_defaults(func=_certs)

    status = sub.add_parser("status", help="show the local Redis deployment(s) and the node-local cache server")
    status.add_argument("--port", type=port_arg, default=None, help="only the deployment with this first port")
    status.add_argument("--json", action="store_true", help="print JSON")
    _state_dir_option(status)
    status.set_defaults(func=_status)


def _state_dir_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None,
                   help="state folder (default: bagua-lightning's state dir, e.g. ~/.local/state/bagua-lightning)")


def _password(args: argparse.Namespace) -> str:
    if args.no_password:
        if args.password_file is not None:
            raise ConfigurationError("--no-password and --password-file contradict each other; give one.")
        if not is_loopback(args.host):
            raise ConfigurationError(f"--no-password with --host {args.host}: anyone on the network could use "
                                     "the cache; drop --no-password or bind 127.0.0.1.")
        return ""
    if args.password_file is not None:
        return procs.read_secret(args.password_file)
    return os.environ.get(ENV_REDIS_PASSWORD) or secrets.token_urlsafe(32)


def _up(args: argparse.Namespace) -> int:
    if args.single and args.nodes not in (None, 1):
        raise ConfigurationError(f"--single starts one standalone server; drop --nodes {args.nodes}.")
    if args.single and args.replicas:
        raise ConfigurationError(f"--single starts one standalone server; drop --replicas {args.replicas}.")
    replicas = args.replicas if args.replicas is not None else 0 if args.single else 1
    check_host(args.host, "--host")
    info = redis_cluster.start_cluster(
        nodes=1 if args.single else (args.nodes or 3), replicas=replicas, port=args.port,
        host=args.host, announce_ip=args.announce_ip, maxmemory=args.maxmemory, password=_password(args), cluster=not args.single,
        node_timeout_ms=args.node_timeout_ms, bus_tls=not args.plain_bus, state_root=args.state_dir,
        timeout_s=args.timeout)
    kind = "Redis Cluster" if info.cluster else "standalone Redis"
    print(f"{kind} up: {len(info.masters)} master(s), {len(info.nodes) - len(info.masters)} replica(s); "
          f"state in {info.state_dir}")
    print(f"hosts: {info.hosts_string}")
    print(f"export {ENV_REDIS_HOSTS}={info.hosts_string}")
    if info.password_file:
        # The file's path, not its content: a value in the environment reaches /proc/PID/environ and every child.
        print(f"export {ENV_REDIS_PASSWORD}{FILE_SUFFIX}={info.password_file}  # the password's 0600 file")
    return 0


def _port_range(text: str) -> list[int]:
    first, _, last = text.partition("-")
    try:
        lo, hi = port_arg(first), port_arg(last or first)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range; give e.g. 7000-7005") from None
    if hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range; give e.g. 7000-7005")
    return list(range(lo, hi + 1))


def _certs(args: argparse.Namespace) -> int:
    from .redis_tls import CA_CERT, make_node_certificates

    wanted = [args.dir / CA_CERT] + [args.dir / f"node-{p}.{ext}" for p in args.ports for ext in ("crt", "key")]
    if all(f.is_file() for f in wanted):
        # A restarted compose project keeps its certificates: its running nodes trust only this CA.
        print(f"certificates for ports {args.ports[0]}-{args.ports[-1]} already in {args.dir}")
        return 0
    hosts = [check_host(h, "--host") for h in args.host]
    make_node_certificates(args.dir, args.ports, hosts)
    print(f"made a CA and {len(args.ports)} node certificates in {args.dir} (the CA key is deleted)")
    return 0


def _down(args: argparse.Namespace) -> int:
    from ..core.local_redis import stop_server

    stopped = redis_cluster.stop_cluster(args.port, args.state_dir, remove_data=not args.keep_data)
    if args.port is None and not args.keep_local:
        stopped += stop_server(args.state_dir / "redis-local" if args.state_dir else None)
    print(f"stopped {len(stopped)} redis-server process(es)" + (f": {stopped}" if stopped else ""))
    return 0


def _status(args: argparse.Namespace) -> int:
    from ..core.local_redis import server_status

    entries = redis_cluster.cluster_status(args.port, args.state_dir)
    local = server_status(args.state_dir / "redis-local" if args.state_dir else None) if args.port is None else None
    if args.json:
        print(json.dumps({"deployments": entries, "node_local": local}, indent=2))
    elif not entries and local is None:
        print("no local Redis deployment recorded")
    for e in [] if args.json else entries:
        head = f"cluster_state={e.get('cluster_state')} slots={e.get('slots_ok')}" if e["cluster"] else "standalone"
        print(f"port {e['port']}: {head}; hosts {e['hosts']}; state {e['state_dir']}")
        for n in e["nodes"]:
            up = "up" if n.get("up") else f"DOWN ({n.get('error', 'no process')})"
            extra = f" keys={n['keys']} used_memory={n['used_memory']}" if n.get("up") else ""
            print(f"  {n['host']}:{n['port']} pid {n['pid']} {n['role']}: {up}{extra}")
    if local is not None and not args.json:
        state = "up" if local.get("up") else "stale record (process gone; `down` removes it)" if local.get(
            "stale") else f"DOWN ({local.get('error', 'no process')})"
        extra = f" keys={local['keys']} used_memory={local['used_memory']}" if local.get("up") else ""
        print(f"node-local cache server {local['address']} pid {local['pid']} maxmemory {local['maxmemory']}: "
              f"{state}{extra}; state {local['folder']}")
    healthy = all(n.get("up") and n.get("process") for e in entries for n in e["nodes"]) and all(
        e.get("cluster_state") == "ok" for e in entries if e["cluster"]) and (
        local is None or local.get("up") or local.get("stale"))
    return 0 if (entries or local) and healthy else 1
