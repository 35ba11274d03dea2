"""``bagua-lightning cache ls | rm NAME[:VERSION]``: the datasets cached in Redis. No torch is imported."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..core.addresses import format_address, parse_host_list
from ..core.errors import BaguaLightningError, ConfigurationError
from ..core.services_file import (
    ENV_REDIS_HOSTS,
    ENV_REDIS_PASSWORD,
    resolve_redis_hosts,
    resolve_redis_password,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("cache", help="datasets cached in Redis by CachedDataset")
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    ls = sub.add_parser("ls", help="list cached datasets: name, version, samples, bytes, creation time")
    _connection_options(ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_ls)
    rm = sub.add_parser("rm", help="delete a cached dataset (every version, or NAME:VERSION)")
    rm.add_argument("target", metavar="NAME[:VERSION]")
    _connection_options(rm)
    rm.set_defaults(func=_rm)


def _connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", default=None,
                   help=f"Redis servers host:port,host:port (default: ${ENV_REDIS_HOSTS}, the services file, "
                        "or the node-local cache server)")
    p.add_argument("--password-file", type=Path, default=None,
                   help=f"file holding the password (default: ${ENV_REDIS_PASSWORD} or the services file's)")
    p.add_argument("--username", default=None, help="ACL user")
    p.add_argument("--ssl", action="store_true", help="connect with TLS")


def _store(args: argparse.Namespace) -> Any:
    from ..core.local_redis import is_alive, read_server
    from ..core.procs import read_secret
    from .cache.store import RedisStore

    password = read_secret(args.password_file) if args.password_file else None
    options: dict[str, Any] = {"username": args.username, "ssl": args.ssl, "socket_timeout_s": 10.0}
    if args.hosts:
        hosts = parse_host_list(args.hosts, "--hosts")
        return RedisStore(hosts=hosts, password=password or resolve_redis_password(hosts), **options)
    resolved = resolve_redis_hosts()
    if resolved is not None:
        return RedisStore(hosts=resolved[0], password=password or resolve_redis_password(resolved[0]), **options)
    server = read_server()
    if server is not None and is_alive(server):
        return RedisStore(hosts=[format_address(server.host, server.port)], password=password or server.password,
                          **options)
    raise BaguaLightningError(f"no Redis to look in: pass --hosts host:port or set {ENV_REDIS_HOSTS}")


def _ls(args: argparse.Namespace) -> int:
    from .cache import catalog

    try:
        store = _store(args)
        entries = catalog.list_datasets(store)
    except ConfigurationError:
        raise  # a usage error: the entry point prints it (exit 2)
    except (BaguaLightningError, OSError, ValueError) as exc:
        print(f"cache ls failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # redis errors: name them, no traceback
        print(f"cache ls failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return 0
    if not entries:
        print("no cached datasets")
        return 0
    print(f"{'NAME':<24} {'VERSION':<20} {'SAMPLES':>10} {'BYTES':>14}  CREATED")
    for e in entries:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.created)) if e.created else "-"
        print(f"{e.name or repr(''):<24} {e.version:<20} {e.samples:>10} {e.bytes:>14}  {created}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    from .cache import catalog

    name, sep, version = args.target.partition(":")
    try:
        store = _store(args)
        deleted = catalog.remove_dataset(store, name, version if sep else None)
    except ConfigurationError:
        raise  # a usage error: the entry point prints it (exit 2)
    except Exception as exc:  # configuration and redis errors alike: one line, no traceback
        print(f"cache rm failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"deleted {deleted} entries of {args.target}")
    return 0
