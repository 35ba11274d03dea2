"""The node-local cache server: one ``redis-server`` per node that ``CachedDataset(hosts=None)`` starts.

How it lives and dies:

- The first job on a node that uses ``hosts=None`` starts it (serialised by a ``flock``); later jobs of
  the same user reuse it and what it caches. It runs detached and outlives the job, on purpose.
- It binds 127.0.0.1 (plus, for a multi-node job, the address the node reaches the job's rendezvous
  with), requires a random password, has no persistence, and evicts with LFU beyond ``maxmemory``:
  the store's ``capacity_per_node``, capped at :func:`default_capacity` (a quarter of the machine's
  memory) when it asks for more than the machine has.
- Its state lives in ``<state_dir>/redis-local/`` (0700): ``server.json`` (address, process record,
  limit; 0600), ``password`` (0600; the only copy of the secret) and the deployment marker.
- ``bagua-lightning status`` / ``redis status`` list it; ``bagua-lightning down`` / ``redis down`` stop it
  and remove its folder (pid, start time and deployment id must match, see :mod:`~bagua_lightning.core.procs`).

No torch here: the CLI imports it. The job-level coordination (ranks, nodes) is
:mod:`bagua_lightning.client.cache.local_server`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from . import procs
from .addresses import format_address
from .errors import ServiceUnavailableError
from .procs import ProcessRecord
from .redis_server import NodeConfig, client_for, launch_node, wait_ready
from .services_file import state_dir

log = logging.getLogger(__name__)

SERVER_FILE = "server.json"
PASSWORD_FILE = "password"
MEMORY_SHARE = 0.25  # of the machine's memory, when the store asks for more than the machine has


@dataclass(kw_only=True)
class LocalServer:
    """A running node-local server. ``started_here``: this process spawned it (``shutdown`` may stop it)."""

    host: str
    port: int
    password: str
    process: ProcessRecord
    maxmemory: int
    binds: tuple[str, ...] = ("127.0.0.1",)
    folder: Path
    started_here: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "binds": list(self.binds), "maxmemory": self.maxmemory,
                "process": self.process.to_json(), "password_file": str(self.folder / PASSWORD_FILE)}


def local_dir() -> Path:
    """``<state_dir>/redis-local``: the node-local server's folder."""
    return state_dir() / "redis-local"


def default_capacity() -> int:
    """A quarter of this machine's memory, in bytes."""
    return int(psutil.virtual_memory().total * MEMORY_SHARE)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold the folder's start-up lock (one process starts the server, the others find it)."""
    procs.private_dir(folder)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_server(folder: Path | None = None) -> LocalServer | None:
    """The recorded server of ``folder`` (default :func:`local_dir`) when the record is this folder's own.

    A missing, malformed or copied record (marker naming another folder or deployment) gives None.
    """
    folder = folder or local_dir()
    try:
        data = json.loads((folder / SERVER_FILE).read_text())
        process = ProcessRecord.from_json(data["process"])
        if not procs.owns(folder, process.deployment):
            return None
        return LocalServer(host=str(data["host"]), port=int(data["port"]), binds=tuple(data["binds"]),
                           maxmemory=int(data["maxmemory"]), process=process, folder=folder,
                           password=procs.read_secret(folder / PASSWORD_FILE))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def is_alive(server: LocalServer) -> bool:
    """True when the recorded process is ours and answers PING with its password."""
    if not procs.is_running(server.process):
        return False
    try:
        wait_ready(server.host, server.port, server.password, timeout_s=1.0)
    except ServiceUnavailableError:
        return False
    return True


def _write(server: LocalServer) -> None:
    procs.write_private(server.folder / SERVER_FILE, json.dumps(server.to_json()))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_server(capacity_bytes: int, *, bind: str = "127.0.0.1", timeout_s: float = 30.0,
                  folder: Path | None = None) -> LocalServer:
    """Return the node's shared server, starting it first if none is alive; it also listens on ``bind``.

    ``capacity_bytes`` only applies to a server started now; an existing one keeps its limit (as in Bagua).
    """
    folder = folder or local_dir()
    with locked(folder):
        existing = read_server(folder)
        if existing is not None and is_alive(existing):
            if bind not in existing.binds:
                _add_bind(existing, bind)
            return existing
        if existing is not None:
            procs.stop(existing.process, 5.0)
        total = psutil.virtual_memory().total
        if capacity_bytes > total:
            log.warning("capacity_per_node=%d bytes exceeds this machine's %d bytes of memory; the local Redis "
                        "gets %d bytes (a quarter of it)", capacity_bytes, total, default_capacity())
            capacity_bytes = default_capacity()
        deployment = procs.new_deployment_id()
        procs.write_marker(folder, deployment)
        password = secrets.token_urlsafe(24)
        procs.write_private(folder / PASSWORD_FILE, password)
        binds = tuple(dict.fromkeys(("127.0.0.1", bind)))
        for _attempt in range(3):  # the free port can be taken between probing and binding
            port = _free_port()
            cfg = NodeConfig(port=port, host=" ".join(binds), data_dir=folder / "data", maxmemory=capacity_bytes,
                             password=password, deployment=deployment)
            proc = launch_node(cfg)
            try:
                wait_ready("127.0.0.1", port, password, proc, timeout_s=timeout_s)
            except ServiceUnavailableError:
                procs.stop_child(proc)
                continue
            server = LocalServer(host="127.0.0.1", port=port, password=password, binds=binds, folder=folder,
                                 process=procs.record(proc.pid, deployment), maxmemory=capacity_bytes,
                                 started_here=True)
            _write(server)
            log.info("started the node-local Redis for the sample cache on %s port %d (maxmemory %d bytes)",
                     "/".join(binds), port, capacity_bytes)
            return server
        raise ServiceUnavailableError(f"could not start a local redis-server; see {folder / 'data' / 'redis.log'}")


def _add_bind(server: LocalServer, bind: str) -> None:
    # A server first started for a one-node job also serves a later multi-node job: listen there too.
    binds = (*server.binds, bind)
    with client_for(server.host, server.port, server.password) as c:
        c.config_set("bind", " ".join(binds))
    server.binds = binds
    _write(server)


def set_password(server: LocalServer, password: str) -> None:
    """Change the server's password (every node of a multi-node job shares one) and its secret file."""
    if password == server.password:
        return
    with client_for(server.host, server.port, server.password) as c:
        c.config_set("requirepass", password)
    procs.write_private(server.folder / PASSWORD_FILE, password)
    server.password = password


def stop_server(folder: Path | None = None, timeout_s: float = 10.0) -> list[int]:
    """Stop the node-local server recorded in ``folder`` (when it is still ours) and remove the folder."""
    folder = folder or local_dir()
    server = read_server(folder)
    if server is None:
        return []
    stopped = [server.pid] if procs.stop(server.process, timeout_s) else []
    procs.remove_tree(folder, server.process.deployment)
    return stopped


def server_status(folder: Path | None = None) -> dict[str, Any] | None:
    """``{"address", "pid", "maxmemory", "keys", "used_memory", "up", ...}`` of the recorded server, or None.

    ``"stale": True`` when the recorded process is gone: the record is left for ``down`` to remove.
    """
    server = read_server(folder)
    if server is None:
        return None
    status: dict[str, Any] = {"address": format_address(server.host, server.port), "binds": list(server.binds),
                              "pid": server.pid, "maxmemory": server.maxmemory, "folder": str(server.folder),
                              "process": procs.is_running(server.process)}
    if not status["process"]:
        # A stale record: the server is gone (e.g. the machine rebooted). Nothing is asked of whatever may
        # listen on its port now (it would get the password); `down` removes the record.
        status.update(up=False, stale=True, error="process gone")
        return status
    import redis

    try:
        with client_for(server.host, server.port, server.password, timeout_s=1.0) as c:
            status["keys"] = int(c.dbsize())
            status["used_memory"] = int(c.info("memory").get("used_memory", 0))
            status["up"] = status["process"]
    except (redis.RedisError, OSError) as exc:
        status["up"] = False
        status["error"] = str(exc)
    return status
