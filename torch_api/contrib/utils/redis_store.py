"""Bagua's ``bagua.torch_api.contrib.utils.redis_store``: :class:`RedisStore` and its server helpers.

``RedisStore(hosts=None, cluster_mode=True, capacity_per_node=None, **options)`` (None: Bagua's 100 GiB,
capped at a quarter of the machine's memory): see :class:`bagua_lightning.client.cache.store.RedisStore`. :func:`start_redis_server_cli` and
:func:`find_free_port` start a standalone server the way Bagua's tests do, but bound to loopback with
protected mode on, and with the deployment's password (``BAGUA_LIGHTNING_REDIS_PASSWORD``) when one is set,
handed over on stdin, never on a command line.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import tempfile
import time

import redis

from ....client.cache.store import DEFAULT_CAPACITY, RedisStore
from ....core.errors import ConfigurationError, ServiceUnavailableError
from ....core.services_file import resolve_redis_password

__all__ = ["DEFAULT_CAPACITY", "RedisStore", "find_free_port", "start_redis_server_cli"]

START_TIMEOUT_S = 30.0  # seconds for the server to answer PING


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _directives(args: tuple[str, ...]) -> list[str]:
    """``("--name value", "--flag")`` (Bagua's form, one or several options per string) -> config lines."""
    lines: list[list[str]] = []
    for arg in args:
        for token in shlex.split(arg):
            if token.startswith("--"):
                lines.append([token[2:]])
            elif lines:
                lines[-1].append(token)
            else:
                raise ConfigurationError(f"redis-server option {arg!r} does not start with '--name'.")
    return [" ".join(shlex.quote(t) if t else '""' for t in line) for line in lines]


def start_redis_server_cli(port: int, capacity: int, *args: str) -> None:
    """Start a detached ``redis-server`` on 127.0.0.1:``port`` and wait until it answers.

    Args:
        port: TCP port to listen on.
        capacity: ``maxmemory`` in bytes; keys are evicted (LFU) beyond it. No persistence.
        *args: further options as ``"--name value"`` strings (e.g. ``"--cluster-config-file nodes.conf"``).

    Raises:
        ConfigurationError: a port or capacity out of range, or a malformed option.
        ServiceUnavailableError: the server did not start or answer within 30 s.

    The server runs until it is told to shut down (``redis.Redis(port=port, password=...).shutdown()``).
    """
    if not 0 < int(port) < 65536:
        raise ConfigurationError(f"port={port!r} is not a TCP port; give 1..65535.")
    if int(capacity) <= 0:
        raise ConfigurationError(f"capacity={capacity!r}; give a positive number of bytes.")
    folder = tempfile.mkdtemp(prefix=f"bagua-lightning-redis-{port}-")
    # The password its clients (RedisStore(hosts=[127.0.0.1:port])) resolve for this address.
    password = resolve_redis_password([("127.0.0.1", int(port))])
    config = [f"port {int(port)}", "bind 127.0.0.1", "protected-mode yes", "daemonize yes",
              f"dir {shlex.quote(folder)}", f"pidfile {shlex.quote(folder + '/redis.pid')}", 'logfile ""',
              f"maxmemory {int(capacity)}", "maxmemory-policy allkeys-lfu", "appendonly no", 'save ""']
    if password:
        config.append(f"requirepass {shlex.quote(password)}")
    config += _directives(args)
    done = subprocess.run(["redis-server", "-"], input="\n".join(config) + "\n", text=True, capture_output=True,
                          timeout=START_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise ServiceUnavailableError(f"redis-server on port {port} did not start: {done.stdout[-500:]}")
    deadline = time.monotonic() + START_TIMEOUT_S
    with redis.Redis(host="127.0.0.1", port=int(port), password=password, socket_timeout=2.0) as client:
        while True:
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
                if time.monotonic() > deadline:
                    raise ServiceUnavailableError(f"redis-server on port {port} does not answer: {exc}") from exc
            time.sleep(0.05)
