"""``init_process_group``: torch.distributed, Bagua's default process group and the watch over the other ranks.

Bagua scripts call it first. It does the rendezvous (``MASTER_ADDR``/``MASTER_PORT`` or a given store), finds
how many ranks each node runs, picks NCCL (one GPU per local rank) or Gloo, makes the default
:class:`~.process_group.BaguaProcessGroup`, starts :mod:`~bagua_lightning.engine.peer_watch` (so that no rank
waits forever on one that failed) and, at exit, makes the ranks leave torch.distributed together.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.errors import ConfigurationError
from ..engine import comm as _engine_comm
from ..engine import peer_watch
from . import env
from ._communicator import operations_left_behind
from .process_group import BaguaProcessGroup, _Registry

__all__ = ["init_process_group"]

log = logging.getLogger(__name__)

_HOST_KEY = "bagua_lightning/torch_api/host/{}"


def _layout_from_hosts(store: dist.Store, rank: int, world_size: int) -> tuple[int, int] | None:
    """``(local_rank, local_size)`` from the hostname every rank writes to ``store``.

    None when the ranks are not laid out node by node with the same number on every host (then the
    caller keeps one rank per node: a flat layout, never a wrong hierarchy).
    """
    store.set(_HOST_KEY.format(rank), socket.gethostname())
    hosts = [store.get(_HOST_KEY.format(r)).decode() for r in range(world_size)]
    runs = [h for i, h in enumerate(hosts) if i == 0 or hosts[i - 1] != h]
    if len(runs) != len(set(hosts)) or len({hosts.count(h) for h in runs}) != 1:
        log.warning("ranks are not laid out node by node (hosts %s); treating every rank as its own node", hosts)
        return None
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return mine.index(rank), len(mine)


def _default_store() -> dist.Store | None:
    """The store of a torch.distributed initialised by someone else (None if torch does not say)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


_EXIT_KEY = "bagua_lightning/torch_api/exit/{}"
_EXIT_WAIT_S = 30.0


def _wait_count(store: dist.Store, key: str, count: int, deadline: float) -> None:
    while int(store.add(key, 0)) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def _leave_together(store: dist.Store, rank: int, world_size: int) -> None:
    """At interpreter exit: tear torch.distributed down together once every rank is leaving; rank 0 (the
    store's host) exits last.

    Bagua scripts never call ``destroy_process_group``; a Gloo rank that exits while its peers still
    finish their last collective, or while its store still serves them, aborts the process. The waits
    are bounded, so a peer that died early delays the exit by at most ``_EXIT_WAIT_S`` seconds.
    """
    if not dist.is_initialized():
        return
    if peer_watch.job_failed():
        return  # a rank failed: nobody is coming; the process group goes with the process
    try:
        deadline = time.monotonic() + _EXIT_WAIT_S
        store.add(_EXIT_KEY.format("arrived"), 1)
        if operations_left_behind():
            # An operation abort() left in the backend only fails once the peers are gone: say this rank is
            # leaving (so they do not wait for it) and leave the group to the backend's own teardown.
            store.add(_EXIT_KEY.format("left"), 1)
            return
        _wait_count(store, _EXIT_KEY.format("arrived"), world_size, deadline)
        # Every rank at once: NCCL's teardown waits for its peers' (a rank destroying alone waits for them).
        dist.destroy_process_group()
        if rank == 0:
            _wait_count(store, _EXIT_KEY.format("left"), world_size - 1, deadline)  # its store serves them
        else:
            store.add(_EXIT_KEY.format("left"), 1)
    except (RuntimeError, ValueError) as exc:  # a peer or the store is gone already: nothing left to tidy
        log.debug("leaving torch.distributed at exit: %s", exc)


def _share_cores(local_size: int) -> None:
    """Give each of the node's ``local_size`` CPU ranks its share of the cores for torch's intra-op threads.

    torch starts as many intra-op (OpenMP) threads as the machine has cores in every process; with several
    ranks per node they outnumber the cores, and OpenMP's spinning barriers then make each small operator
    wait for descheduled threads (on 2 cores, 2 ranks: ~70 ms per tiny ``linear`` instead of ~50 us).
    torchrun avoids it by setting ``OMP_NUM_THREADS=1``; processes started otherwise (``multiprocessing``,
    Bagua's tests) get the same here. An explicit ``OMP_NUM_THREADS`` is left alone.
    """
    if local_size <= 1 or os.environ.get("OMP_NUM_THREADS", "").strip():
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    share = max(1, cores // local_size)
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)


def init_process_group(store: dist.Store | None = None, rank: int = -1, world_size: int = -1,
                       local_world_size: int = -1) -> None:
    """Initialise torch.distributed and Bagua's default process group; call it before any other API.

    NCCL when CUDA is available (the CUDA device is then set to the local rank), else Gloo. Without a
    ``store``, the rendezvous uses ``MASTER_ADDR``/``MASTER_PORT``; the timeout is
    :func:`~bagua_lightning.torch_api.env.get_process_group_timeout_s`. When no launcher variable gives
    the number of processes per node (Lightning's launcher sets none), the ranks compare hostnames
    through the store. When torch.distributed is already initialised (a Lightning strategy, a user's
    own call), that group is used. A second call does nothing.

    Args:
        store: key/value store for the rendezvous (e.g. ``dist.FileStore``); None: a TCP store.
        rank: this process's global rank; -1: from the environment.
        world_size: number of processes; -1: from the environment.
        local_world_size: processes per node; -1: from the environment.
    """
    if _Registry.default is not None:
        return
    adopted = dist.is_initialized()
    if adopted:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    rank = env.get_rank() if rank < 0 else rank
    world_size = env.get_world_size() if world_size < 0 else world_size
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ConfigurationError(
            f"rank {rank} and world size {world_size} do not describe a job; set RANK and WORLD_SIZE "
            "(torchrun does) or pass them to init_process_group"
        )
    timeout = timedelta(seconds=env.get_process_group_timeout_s())
    if store is None and not adopted:
        store = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))[0]
        store.set_timeout(timeout)
    layout = None
    if local_world_size > 0:
        layout = (rank % local_world_size, local_world_size)
    elif env._launcher_local_size() is not None or world_size == 1:
        layout = (env.get_local_rank(), env.get_local_size())
    else:
        host_store = _default_store() if adopted else store
        layout = _layout_from_hosts(host_store, rank, world_size) if host_store is not None else None
    local_rank, local_size = layout or (0, 1)
    if local_size <= 0 or world_size % local_size or not 0 <= local_rank < local_size:
        raise ConfigurationError(
            f"local rank {local_rank} of {local_size} processes per node does not fit world size {world_size}; "
            "every node must run the same number of processes (set LOCAL_WORLD_SIZE or local_world_size)"
        )
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        # The launcher's LOCAL_RANK names the GPU (also when the layout fell back to flat).
        launcher_local_rank = env._launcher_local_rank()
        device = launcher_local_rank if local_world_size <= 0 and launcher_local_rank is not None else local_rank
        if device >= torch.cuda.device_count():
            raise ConfigurationError(
                f"local rank {device} has no CUDA device ({torch.cuda.device_count()} visible); "
                "start at most one process per GPU on each node"
            )
        torch.cuda.set_device(device)
    if not use_cuda:
        _share_cores(local_size)
    if not adopted:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
    env._set_topology(env.Topology(rank=rank, world_size=world_size, local_rank=local_rank,
                                   local_size=local_size, node_rank=rank // local_size))
    stream = torch.cuda.Stream(priority=-1) if use_cuda else None
    try:
        _Registry.default = BaguaProcessGroup(list(range(world_size)), stream, "0", torch_group=dist.group.WORLD)
    except BaseException:
        env._set_topology(None)
        raise
    if not adopted and store is not None:
        atexit.register(_leave_together, store, rank, world_size)
        _engine_comm.exit_teardown_owned_elsewhere = True
    # After _leave_together's registration: the watch's exit mark runs first at exit (atexit is LIFO).
    peer_watch.start(store if not adopted else None, rank, world_size)
