"""``baguarun``: Bagua's multi-node starter, over :mod:`bagua_lightning.distributed.launch`.

``baguarun --host_list h1,h2 --ssh_port 22 --nproc_per_node 8 --master_port 1234 train.py ARGS`` runs
``python -m bagua_lightning.distributed.launch --nnodes 2 --node_rank I --master_addr h1 ...`` on every host
of the list, node ``I`` being the ``I``-th host, as Bagua's ``baguarun`` did. The list comes from
``--host_list`` or ``BAGUA_NODE_DOMAIN_NAMES``, the SSH port from ``--ssh_port`` or ``BAGUA_SSH_PORT``.

A list of one local host (``127.0.0.1``, ``localhost`` or this machine's name), or no list at all, starts
the node here without SSH. Other hosts are reached with the ``ssh`` program (keys, not passwords:
``BatchMode``); the commands travel on ssh's standard input, so variables passed with ``-x NAME=VALUE``
appear on no command line. Every node starts in the current directory with the same ``python``. The exit
status is the first failing node's, else 0.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["main", "node_script", "parse_args"]

_LOCAL_NAMES = {"127.0.0.1", "localhost", "::1"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Bagua's ``baguarun`` flags (underscores or dashes); argparse's one-line usage error on a bad one."""
    p = argparse.ArgumentParser(prog="baguarun", description="Start a Bagua job on one or several hosts.")
    p.add_argument("--host_list", "--host-list", dest="host_list", default=None,
                   help="comma-separated hosts, node 0 first (default: $BAGUA_NODE_DOMAIN_NAMES, else this host)")
    p.add_argument("--ssh_port", "--ssh-port", dest="ssh_port", type=int, default=None,
                   help="SSH port of the hosts (default: $BAGUA_SSH_PORT, else ssh's own)")
    p.add_argument("--master_port", "--master-port", dest="master_port", type=int, default=None)
    p.add_argument("--nproc_per_node", "--nproc-per-node", dest="nproc_per_node", type=int, required=True)
    p.add_argument("--no_python", "--no-python", dest="no_python", action="store_true")
    p.add_argument("--bagua_service_port", "--bagua-service-port", dest="bagua_service_port", type=int,
                   default=None)
    p.add_argument("-x", dest="x", action="append", default=[],
                   help="NAME=VALUE (or NAME: its value here) to set on every node; repeatable")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    hosts = args.host_list if args.host_list is not None else os.environ.get("BAGUA_NODE_DOMAIN_NAMES", "")
    args.host_list = [h.strip() for h in hosts.split(",") if h.strip()] or ["127.0.0.1"]
    if args.ssh_port is None and os.environ.get("BAGUA_SSH_PORT", "").strip():
        raw = os.environ["BAGUA_SSH_PORT"].strip()
        if not raw.isdigit():
            p.error(f"BAGUA_SSH_PORT={raw!r} is not a port; fix it or pass --ssh_port")
        args.ssh_port = int(raw)
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        p.error(f"--ssh_port must be a port in 1..65535, got {args.ssh_port}")
    if args.nproc_per_node < 1:
        p.error(f"--nproc_per_node must be at least 1, got {args.nproc_per_node}")
    env: dict[str, str] = {}
    for item in args.x:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            p.error(f"-x {item!r}: expected NAME=VALUE or NAME")
        env[name] = value if sep else os.environ.get(name, "")
    args.set_env = env
    return args


def _launch_argv(args: argparse.Namespace, node_rank: int) -> list[str]:
    argv = [sys.executable, "-m", "bagua_lightning.distributed.launch",
            f"--nproc_per_node={args.nproc_per_node}", f"--nnodes={len(args.host_list)}",
            f"--node_rank={node_rank}", f"--master_addr={args.host_list[0]}"]
    if args.master_port is not None:
        argv.append(f"--master_port={args.master_port}")
    if args.bagua_service_port is not None:
        argv.append(f"--bagua_service_port={args.bagua_service_port}")
    if args.no_python:
        argv.append("--no_python")
    return [*argv, args.training_script, *args.training_script_args]


def node_script(args: argparse.Namespace, node_rank: int) -> str:
    """The shell script a remote node runs (sent on ssh's standard input)."""
    lines = ["set -e", f"cd {shlex.quote(os.getcwd())}"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in args.set_env.items()]
    lines.append("exec " + shlex.join(_launch_argv(args, node_rank)))
    return "\n".join(lines) + "\n"


def _is_local(host: str) -> bool:
    return host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def main(argv: Sequence[str] | None = None) -> None:
    """Start every node of the job and wait for all of them."""
    args = parse_args(argv)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, host in enumerate(args.host_list):
            if len(args.host_list) == 1 and _is_local(host):
                procs.append(subprocess.Popen(_launch_argv(args, rank), env={**os.environ, **args.set_env}))
                continue
            ssh = ["ssh", "-o", "BatchMode=yes", "-T"]
            if args.ssh_port is not None:
                ssh += ["-p", str(args.ssh_port)]
            proc = subprocess.Popen([*ssh, host, "bash", "-s"], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(node_script(args, rank).encode())
            proc.stdin.close()
            procs.append(proc)
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        codes = [130]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    failed = [c for c in codes if c != 0]
    sys.exit(failed[0] if failed else 0)


if __name__ == "__main__":
    main()
