"""``bagua-lightning redis up | down | status``: a local Redis Cluster (or one server) for the sample cache."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from bagua_lightning.errors import BaguaLightningError
from bagua_lightning.services_file import ENV_REDIS_HOSTS, ENV_REDIS_PASSWORD

from . import redis_cluster

_SIZE = re.compile(r"(?i)^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$")
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512mb"``, ``"4G"`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes such as 1073741824, 512mb or 4gb")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * _UNITS[unit]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("redis", help="a local Redis Cluster for the sample cache")
    sub = parser.add_subparsers(dest="redis_command", metavar="ACTION", required=True)

    up = sub.add_parser("up", help="start a local Redis Cluster and wait until all 16384 slots are served")
    up.add_argument("--nodes", type=int, default=None, help="masters (default 3)")
    up.add_argument("--replicas", type=int, default=0, help="replicas per master (default 0)")
    up.add_argument("--port", type=int, default=redis_cluster.DEFAULT_PORT,
                    help=f"first port; nodes use consecutive ports (default {redis_cluster.DEFAULT_PORT})")
    up.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    up.add_argument("--maxmemory", type=parse_bytes, default=0,
                    help="per-node memory limit, e.g. 4gb (default: none); LFU eviction beyond it")
    up.add_argument("--password", default=None, help=f"require this password (default: ${ENV_REDIS_PASSWORD})")
    up.add_argument("--single", action="store_true", help="one standalone server instead of a cluster")
    up.add_argument("--node-timeout-ms", type=int, default=2000,
                    help="cluster-node-timeout: failover detection time (default 2000)")
    up.add_argument("--timeout", type=float, default=60.0, help="start-up deadline in seconds (default 60)")
    _state_dir_option(up)
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop the local Redis deployment(s) and remove their data")
    down.add_argument("--port", type=int, default=None, help="only the deployment with this first port")
    down.add_argument("--keep-data", action="store_true", help="keep the data folders")
    _state_dir_option(down)
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help="show the local Redis deployment(s)")
    status.add_argument("--port", type=int, default=None, help="only the deployment with this first port")
    status.add_argument("--password", default=None, help=f"password (default: ${ENV_REDIS_PASSWORD})")
    status.add_argument("--json", action="store_true", help="print JSON")
    _state_dir_option(status)
    status.set_defaults(func=_status)


def _state_dir_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None,
                   help="state folder (default: bagua-lightning's state dir, e.g. ~/.local/state/bagua-lightning)")


def _up(args: argparse.Namespace) -> int:
    if args.single and args.nodes not in (None, 1):
        print(f"--single starts one standalone server; drop --nodes {args.nodes}.", file=sys.stderr)
        return 2
    try:
        info = redis_cluster.start_cluster(
            nodes=1 if args.single else (args.nodes or 3), replicas=args.replicas, port=args.port,
            host=args.host, maxmemory=args.maxmemory, password=args.password, cluster=not args.single,
            node_timeout_ms=args.node_timeout_ms, state_root=args.state_dir, timeout_s=args.timeout)
    except BaguaLightningError as exc:
        print(f"redis up failed: {exc}", file=sys.stderr)
        return 1
    kind = "Redis Cluster" if info.cluster else "standalone Redis"
    print(f"{kind} up: {len(info.masters)} master(s), {len(info.nodes) - len(info.masters)} replica(s); "
          f"state in {info.state_dir}")
    print(f"hosts: {info.hosts_string}")
    print(f"export {ENV_REDIS_HOSTS}={info.hosts_string}")
    if info.password_set and not os.environ.get(ENV_REDIS_PASSWORD):
        print(f"export {ENV_REDIS_PASSWORD}=...  # the password you passed")
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = redis_cluster.stop_cluster(args.port, args.state_dir, remove_data=not args.keep_data)
    print(f"stopped {len(stopped)} redis-server process(es)" + (f": {stopped}" if stopped else ""))
    return 0


def _status(args: argparse.Namespace) -> int:
    entries = redis_cluster.cluster_status(args.port, args.state_dir, args.password)
    if args.json:
        print(json.dumps(entries, indent=2))
    elif not entries:
        print("no local Redis deployment recorded")
    for e in [] if args.json else entries:
        head = f"cluster_state={e.get('cluster_state')} slots={e.get('slots_ok')}" if e["cluster"] else "standalone"
        print(f"port {e['port']}: {head}; hosts {e['hosts']}; state {e['state_dir']}")
        for n in e["nodes"]:
            up = "up" if n.get("up") else f"DOWN ({n.get('error', 'no process')})"
            extra = f" keys={n['keys']} used_memory={n['used_memory']}" if n.get("up") else ""
            print(f"  {n['host']}:{n['port']} pid {n['pid']} {n['role']}: {up}{extra}")
    healthy = all(n.get("up") for e in entries for n in e["nodes"]) and all(
        e.get("cluster_state") == "ok" for e in entries if e["cluster"])
    return 0 if entries and healthy else 1
