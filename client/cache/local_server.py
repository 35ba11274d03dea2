"""The node-local ``redis-server`` that ``RedisStore(hosts=None)`` spawns and every job on the node shares.

The server is bound to 127.0.0.1 with protected mode and a random password, has ``maxmemory`` set to the
store's ``capacity_per_node`` with the LFU eviction policy (see
:data:`bagua_lightning.services.redis_cluster.DEFAULT_EVICTION_POLICY`) and no persistence. It runs detached,
so it outlives the job that started it and the next job on the node reuses what is cached.

Its address and password sit in ``<state_dir>/redis-local/server.json`` (mode 0600 in a 0700 folder, so only
the same user can use it). Start-up is serialised by an exclusive ``flock`` on that folder: whichever process
gets there first starts the server, the others find it. Under ``torch.distributed`` only local rank 0 does
that; the other ranks wait for its address under a per-host key of the default process group's store.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bagua_lightning.errors import ServiceUnavailableError
from bagua_lightning.services.redis_cluster import NodeConfig, is_redis_pid, launch_node, wait_ready
from bagua_lightning.services_file import state_dir

log = logging.getLogger(__name__)

_STORE_KEY = "bagua_lightning/redis_local/{host}"


@dataclass(kw_only=True)
class LocalServer:
    """A running node-local server. ``started_here``: this process spawned it (``shutdown`` may stop it)."""

    host: str
    port: int
    password: str
    pid: int
    maxmemory: int
    started_here: bool = False


def local_dir() -> Path:
    return state_dir() / "redis-local"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(folder: Path) -> LocalServer | None:
    try:
        data = json.loads((folder / "server.json").read_text())
        return LocalServer(**{k: data[k] for k in ("host", "port", "password", "pid", "maxmemory")})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(server: LocalServer) -> bool:
    if not is_redis_pid(server.pid):
        return False
    try:
        wait_ready(server.host, server.port, server.password, timeout_s=1.0)
    except ServiceUnavailableError:
        return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_local_server(capacity_bytes: int, timeout_s: float = 30.0, folder: Path | None = None) -> LocalServer:
    """Return the node's shared server, starting it first if none is alive.

    ``capacity_bytes`` only applies to a server started now; an existing one keeps its limit (as in Bagua).
    """
    folder = folder or local_dir()
    with _locked(folder):
        existing = _read(folder)
        if existing is not None and _alive(existing):
            if existing.maxmemory != capacity_bytes:
                log.info("reusing the local Redis on port %d with maxmemory %d bytes (capacity_per_node=%d "
                         "only applies to a newly started server)", existing.port, existing.maxmemory,
                         capacity_bytes)
            return existing
        password = secrets.token_urlsafe(24)
        for _attempt in range(3):  # the free port can be taken between probing and binding
            port = _free_port()
            cfg = NodeConfig(port=port, data_dir=folder / "data", maxmemory=capacity_bytes, password=password)
            proc = launch_node(cfg)
            try:
                wait_ready(cfg.host, port, password, proc, timeout_s=timeout_s)
            except ServiceUnavailableError:
                if proc.poll() is None:
                    proc.kill()
                continue
            server = LocalServer(host=cfg.host, port=port, password=password, pid=proc.pid,
                                 maxmemory=capacity_bytes, started_here=True)
            fd = os.open(folder / "server.json.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({k: v for k, v in asdict(server).items() if k != "started_here"}, f)
            os.replace(folder / "server.json.tmp", folder / "server.json")
            log.info("started a local Redis for the sample cache on 127.0.0.1:%d (maxmemory %d bytes)",
                     port, capacity_bytes)
            return server
        raise ServiceUnavailableError(f"could not start a local redis-server; see {folder / 'data' / 'redis.log'}")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def find_or_start(capacity_bytes: int, timeout_s: float = 30.0) -> LocalServer:
    """:func:`ensure_local_server`, coordinated over the default process group when one exists."""
    try:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
    except ImportError:  # pragma: no cover - torch is a dependency of the trainer side
        distributed = False
    if not distributed:
        return ensure_local_server(capacity_bytes, timeout_s)
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    key = _STORE_KEY.format(host=socket.gethostname())
    if _local_rank() == 0:
        server = ensure_local_server(capacity_bytes, timeout_s)
        store.set(key, f"{server.host}:{server.port}")  # the password stays in the 0600 file
        return server
    store.wait([key], timedelta(seconds=timeout_s))
    address = store.get(key).decode()
    found = _read(local_dir())
    if found is None or f"{found.host}:{found.port}" != address:
        raise ServiceUnavailableError(
            f"local rank 0 published Redis at {address} but {local_dir() / 'server.json'} does not describe it; "
            "do all ranks of this node share the same user and $XDG_STATE_HOME?"
        )
    return found
