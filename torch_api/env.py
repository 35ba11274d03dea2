"""Where this process sits in the job, as Bagua's ``bagua.torch_api.env`` reports it.

Before :func:`~bagua_lightning.torch_api.communication.init_process_group` the answers come from the
launcher's environment, first match wins:

========================  =================================================================
what                      variables, in order
========================  =================================================================
rank                      ``RANK`` (torchrun, Bagua's launcher), ``SLURM_PROCID``,
                          ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``; else ``NODE_RANK *
                          local size + LOCAL_RANK`` (Lightning's launcher sets no ``RANK``)
world size                ``WORLD_SIZE``, ``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``
local rank                ``LOCAL_RANK``, ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
                          ``MPI_LOCALRANKID``
local size                ``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``,
                          ``OMPI_COMM_WORLD_LOCAL_SIZE``, ``MPI_LOCALNRANKS``
node rank                 ``NODE_RANK`` (Lightning, Bagua), ``GROUP_RANK`` (torchrun),
                          ``SLURM_NODEID``; else ``rank // local size``
========================  =================================================================

After it, the values the process group was initialised with (arguments of ``init_process_group``
override the environment), so both agree for the rest of the job. Rank and world size of a
torch.distributed group initialised by someone else (a Lightning strategy, a user's own call) count
before any variable. A variable that is set but not an
integer raises a :class:`~bagua_lightning.core.errors.ConfigurationError` naming it.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

import torch.distributed as dist

from ..core.errors import ConfigurationError

__all__ = [
    "find_free_network_port",
    "get_autotune_level",
    "get_autotune_max_samples",
    "get_autotune_sampling_confidence_time_s",
    "get_autotune_server_wait_time",
    "get_autotune_warmup_time_s",
    "get_bagua_service_port",
    "get_default_bucket_size",
    "get_is_output_autotune_log",
    "get_local_rank",
    "get_local_size",
    "get_master_addr",
    "get_node_rank",
    "get_process_group_timeout_s",
    "get_rank",
    "get_world_size",
    "is_report_metrics_switch_on",
]

DEFAULT_BUCKET_SIZE = 10 * 1024**2  # bytes, Bagua's default
DEFAULT_PROCESS_GROUP_TIMEOUT_S = 1800.0  # seconds, Bagua's 30 minutes

_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_WORLD_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
_NODE_RANK_VARS = ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID")


@dataclass(frozen=True, slots=True)
class Topology:
    """The layout ``init_process_group`` fixed for this process (global ranks, node by node)."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int


# Set once by init_process_group (the process-wide default group, as torch.distributed keeps its own).
_topology: Topology | None = None


def _set_topology(topology: Topology | None) -> None:
    global _topology
    _topology = topology


def _int_var(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    # SLURM writes tasks per node as "4" or "4(x2)" (4 tasks on each of 2 nodes), or "4,2" when uneven.
    m = re.fullmatch(r"(-?\d+)(\(x\d+\))?(,.*)?", raw) if name == "SLURM_NTASKS_PER_NODE" else None
    if m is not None:
        return int(m.group(1))
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={raw!r} is not an integer; unset it or fix it") from None


def _first(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _int_var(name)
        if value is not None:
            return value
    return None


def _launcher_local_size() -> int | None:
    """Processes per node as a launcher variable gives it, None when none does."""
    return _first(_LOCAL_SIZE_VARS)


def _launcher_local_rank() -> int | None:
    """Rank on the node as a launcher variable gives it, None when none does."""
    return _first(_LOCAL_RANK_VARS)


def get_world_size() -> int:
    """Number of processes in the job.

    Returns:
        The world size (1 when nothing says otherwise).
    """
    if _topology is not None:
        return _topology.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = _first(_WORLD_SIZE_VARS)
    return 1 if value is None else value


def get_local_size() -> int:
    """Number of processes on this node.

    Returns:
        The local size (1 when nothing says otherwise).
    """
    if _topology is not None:
        return _topology.local_size
    value = _first(_LOCAL_SIZE_VARS)
    return 1 if value is None else value


def get_local_rank() -> int:
    """Rank of this process among the processes of its node, in ``[0, local_size)``.

    Returns:
        The local rank (0 when nothing says otherwise).
    """
    if _topology is not None:
        return _topology.local_rank
    value = _first(_LOCAL_RANK_VARS)
    return 0 if value is None else value


def get_rank() -> int:
    """Global rank of this process, in ``[0, world_size)``.

    Returns:
        The rank (0 when nothing says otherwise).
    """
    if _topology is not None:
        return _topology.rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    value = _first(_RANK_VARS)
    if value is not None:
        return value
    node = _first(_NODE_RANK_VARS)
    return (node or 0) * get_local_size() + get_local_rank()


def get_node_rank() -> int:
    """Index of this process's node, in ``[0, world_size // local_size)``.

    Returns:
        The node rank.
    """
    if _topology is not None:
        return _topology.node_rank
    value = _first(_NODE_RANK_VARS)
    return get_rank() // max(1, get_local_size()) if value is None else value


def get_default_bucket_size() -> int:
    """Default communication bucket size in bytes (``BAGUA_DEFAULT_BUCKET_SIZE``, default 10 MiB).

    Returns:
        The default bucket size.
    """
    value = _int_var("BAGUA_DEFAULT_BUCKET_SIZE")
    return DEFAULT_BUCKET_SIZE if value is None else value


def get_master_addr() -> str:
    """Address of the rank-0 host (``MASTER_ADDR``, default ``127.0.0.1``)."""
    return os.environ.get("MASTER_ADDR", "").strip() or "127.0.0.1"


def get_bagua_service_port() -> int:
    """Port of Bagua's autotune service (``BAGUA_SERVICE_PORT``, -1 when unset)."""
    value = _int_var("BAGUA_SERVICE_PORT")
    return -1 if value is None else value


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigurationError(f"environment variable {name}={raw!r} is not a switch; use 1 or 0")


def is_report_metrics_switch_on() -> bool:
    """Whether metrics reporting is on (``BAGUA_REPORT_METRICS=1``)."""
    return _flag("BAGUA_REPORT_METRICS")


def get_autotune_level() -> int:
    """The autotune level (``BAGUA_AUTOTUNE``, default 0: off)."""
    value = _int_var("BAGUA_AUTOTUNE")
    return 0 if value is None else value


def get_autotune_max_samples() -> int:
    """How many samples the autotuner takes (``BAGUA_AUTOTUNE_MAX_SAMPLES``, default 60)."""
    value = _int_var("BAGUA_AUTOTUNE_MAX_SAMPLES")
    return 60 if value is None else value


def _float_var(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={raw!r} is not a number; unset it or fix it") from None


def get_autotune_sampling_confidence_time_s() -> float:
    """Seconds a sample is measured for (``BAGUA_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S``, default 5)."""
    return _float_var("BAGUA_AUTOTUNE_SAMPLING_CONFIDENCE_TIME_S", 5.0)


def get_autotune_warmup_time_s() -> float:
    """Seconds of warm-up before tuning starts (``BAGUA_AUTOTUNE_WARMUP_TIME_S``, default 30)."""
    return _float_var("BAGUA_AUTOTUNE_WARMUP_TIME_S", 30.0)


def get_is_output_autotune_log() -> bool:
    """Whether the autotuner writes its log (``BAGUA_IS_OUTPUT_AUTOTUNE_LOG=1``)."""
    return _flag("BAGUA_IS_OUTPUT_AUTOTUNE_LOG")


def get_autotune_server_wait_time() -> int:
    """Seconds to wait for the autotune service to answer (``BAGUA_AUTOTUNE_SERVER_WAIT_TIME``, default 300)."""
    value = _int_var("BAGUA_AUTOTUNE_SERVER_WAIT_TIME")
    return 300 if value is None else value


def get_process_group_timeout_s() -> float:
    """Timeout of the process group's collectives and rendezvous, in seconds.

    ``BAGUA_LIGHTNING_PROCESS_GROUP_TIMEOUT_S`` (default 1800, Bagua's 30 minutes).
    """
    value = _float_var("BAGUA_LIGHTNING_PROCESS_GROUP_TIMEOUT_S", DEFAULT_PROCESS_GROUP_TIMEOUT_S)
    if value <= 0:
        raise ConfigurationError(
            f"BAGUA_LIGHTNING_PROCESS_GROUP_TIMEOUT_S={value} must be a positive number of seconds"
        )
    return value


def find_free_network_port() -> int:
    """A TCP port that was free on this host a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
