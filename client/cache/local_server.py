"""``hosts=None``: the node-local cache servers of a job, found or started, and shared across its nodes.

The server itself (how it is started, where its state and secret live, how it is stopped) is
:mod:`bagua_lightning.core.local_redis`'s. This module coordinates a job over a ``torch.distributed`` store:

The interface (small on purpose)::

    servers = job_servers(capacity_bytes, timeout_s=30.0, store=None)
    RedisStore(hosts=servers.hosts, password=servers.password)   # one store over every node's server
    servers.local        # this node's LocalServer on the rank that started/found it, else None
    servers.started_here # True on the one process that spawned this node's server

``store``: a ``torch.distributed.Store`` (None: the default process group's store when one is
initialised, else this process alone). Protocol, under the prefix ``bagua_lightning/redis_local/``:

1. every rank publishes its node identity (host name and the address it reaches the rendezvous from)
   under ``rank/<rank>``; every rank reads all of them, so all ranks agree on the nodes (in order of
   their lowest rank) and on each node's leader (its lowest rank);
2. each leader starts or reuses its node's server (:func:`~bagua_lightning.core.local_redis.ensure_server`).
   On one node it listens on 127.0.0.1 only. On several nodes it also listens on the address the node
   reaches the rendezvous from, and all servers share one password: node 0's leader publishes its
   server's password under ``password``; the other leaders switch their servers to it
   (``CONFIG SET requirepass``, authenticated with the old one) and rewrite their 0600 secret file, so a
   later job on the same nodes finds them consistent. The job's rendezvous store is trusted with the
   password as it is trusted with the job itself (whoever can write it can join the job);
3. each leader publishes ``node/<k>`` = ``host:port`` once its server is ready with the job's password;
   every rank waits for all ``node/<k>`` and returns them in node order. Ranks other than a leader read
   the password from their node's 0600 secret file (the same user and ``$XDG_STATE_HOME`` as the leader).

Every rank takes the same steps, so nobody waits for a key that is never written; every wait has
``timeout_s``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ...core.addresses import format_address, parse_address
from ...core.errors import ServiceUnavailableError
from ...core.local_redis import LocalServer, ensure_server, local_dir, read_server, set_password

_PREFIX = "bagua_lightning/redis_local/"
LOOPBACK = "127.0.0.1"

__all__ = ["JobServers", "LocalServer", "find_or_start", "job_servers"]


@dataclass(kw_only=True)
class JobServers:
    """Every node's cache server for this job.

    Attributes:
        hosts: ``[{"host", "port"}, ...]``, one per node, in node order (the same on every rank).
        password: the password all of them require.
        local: this node's server on its leader rank, None on the other ranks.
    """

    hosts: list[dict[str, Any]] = field(default_factory=list)
    password: str
    local: LocalServer | None = None

    @property
    def started_here(self) -> bool:
        return self.local is not None and self.local.started_here


def _default_store() -> tuple[Any, int, int] | None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency of the trainer side
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store(), dist.get_rank(), dist.get_world_size()


def _rendezvous_host(store: Any) -> str | None:
    # The TCPStore under any PrefixStore wrappers knows the rendezvous host; MASTER_ADDR is the fallback.
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return os.environ.get("MASTER_ADDR") or None


def _route_address(target: str | None) -> str:
    """The local address this node uses to reach ``target`` (the rendezvous host); loopback when local."""
    if not target:
        return LOOPBACK
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return LOOPBACK


def job_servers(capacity_bytes: int, timeout_s: float = 30.0, store: Any = None, rank: int | None = None,
                world_size: int | None = None) -> JobServers:
    """Start or find this node's server and return every node's address and the shared password.

    Args:
        capacity_bytes: ``maxmemory`` of a server started now (an existing one keeps its limit).
        timeout_s: deadline for the server to start and for every wait on the store, in seconds.
        store: a ``torch.distributed.Store`` shared by the job; None: the default process group's.
        rank: this process's rank in ``store``'s job (default: the default process group's).
        world_size: ranks in the job (default: the default process group's).

    Raises:
        ServiceUnavailableError: the server did not start, or another rank did not publish in time.
    """
    if store is None:
        found = _default_store()
        if found is None:
            server = ensure_server(capacity_bytes, timeout_s=timeout_s)
            return JobServers(hosts=[{"host": server.host, "port": server.port}], password=server.password,
                              local=server)
        store, default_rank, default_world = found
        rank = default_rank if rank is None else rank
        world_size = default_world if world_size is None else world_size
    if rank is None or world_size is None:
        raise ValueError("job_servers(store=...) needs rank and world_size as well.")
    wait = timedelta(seconds=timeout_s)
    route = _route_address(_rendezvous_host(store))
    store.set(f"{_PREFIX}rank/{rank}", f"{socket.gethostname()}/{route}")
    rank_keys = [f"{_PREFIX}rank/{r}" for r in range(world_size)]
    _wait(store, rank_keys, wait)
    identities = [store.get(k).decode() for k in rank_keys]
    nodes = list(dict.fromkeys(identities))
    me = nodes.index(identities[rank])
    multi = len(nodes) > 1
    local: LocalServer | None = None
    if rank == identities.index(identities[rank]):  # the node's lowest rank leads it
        bind = route if multi else LOOPBACK
        local = ensure_server(capacity_bytes, bind=bind, timeout_s=timeout_s)
        if multi:
            if me == 0:
                store.set(f"{_PREFIX}password", local.password)
            else:
                _wait(store, [f"{_PREFIX}password"], wait)
                set_password(local, store.get(f"{_PREFIX}password").decode())
        store.set(f"{_PREFIX}node/{me}", format_address(bind, local.port))
    node_keys = [f"{_PREFIX}node/{k}" for k in range(len(nodes))]
    _wait(store, node_keys, wait)
    addresses = [parse_address(store.get(k).decode(), f"the job store's {k}") for k in node_keys]
    hosts: list[dict[str, Any]] = [{"host": h, "port": p} for h, p in addresses]
    if local is not None:
        return JobServers(hosts=hosts, password=local.password, local=local)
    mine = read_server(local_dir())
    if mine is None or mine.port != hosts[me]["port"]:
        raise ServiceUnavailableError(
            f"this node's leader published its Redis at {format_address(hosts[me]['host'], hosts[me]['port'])} "
            f"but {local_dir() / 'server.json'} does not describe it; do all ranks of a node share the same "
            "user and $XDG_STATE_HOME?"
        )
    return JobServers(hosts=hosts, password=mine.password)


def _wait(store: Any, keys: list[str], timeout: timedelta) -> None:
    try:
        store.wait(keys, timeout)
    except Exception as exc:  # torch raises DistStoreError / RuntimeError subclasses by version
        raise ServiceUnavailableError(
            f"ranks did not publish {keys[0]}.. within {timeout.total_seconds():.0f} s ({exc}); did every "
            "rank of the job create its dataset with hosts=None?"
        ) from exc


def find_or_start(capacity_bytes: int, timeout_s: float = 30.0) -> LocalServer:
    """This node's server for a one-node job: the :attr:`JobServers.local` of :func:`job_servers`.

    On ranks other than the node's leader the returned server is read from the node's record
    (``started_here`` False). Multi-node jobs should use :func:`job_servers`, which returns every node.
    """
    servers = job_servers(capacity_bytes, timeout_s)
    if servers.local is not None:
        return servers.local
    mine = read_server(local_dir())
    if mine is None:  # pragma: no cover - job_servers checked it
        raise ServiceUnavailableError(f"no node-local Redis recorded in {local_dir()}")
    return mine
