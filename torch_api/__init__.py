"""Bagua's own API (``bagua.torch_api``), module for module, over bagua-lightning's engine.

A Bagua script migrates by changing ``bagua.torch_api`` to ``bagua_lightning.torch_api`` in its
imports. Importing this package patches ``torch.nn.Module`` with ``with_bagua`` and
``torch.Tensor`` with Bagua's tensor methods, as Bagua did.
"""

from __future__ import annotations

from . import (
    algorithms,
    checkpoint,
    communication,
    contrib,
    data_parallel,
    distributed,
    env,
    model_parallel,
    utils,
)
from ._torch_patch import apply as _apply_torch_patch
from .bucket import BaguaBucket
from .communication import (
    BaguaProcessGroup,
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_coalesced_inplace,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    broadcast_coalesced,
    broadcast_object,
    from_torch_group,
    gather,
    gather_inplace,
    init_process_group,
    is_initialized,
    new_group,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from .distributed import BaguaModule
from .env import (
    get_autotune_level,
    get_default_bucket_size,
    get_local_rank,
    get_local_size,
    get_node_rank,
    get_rank,
    get_world_size,
)
from .tensor import BaguaTensor

_apply_torch_patch()

__all__ = [
    "BaguaBucket",
    "BaguaModule",
    "BaguaProcessGroup",
    "BaguaTensor",
    "ReduceOp",
    "algorithms",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_coalesced_inplace",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "broadcast_object",
    "checkpoint",
    "communication",
    "contrib",
    "data_parallel",
    "distributed",
    "env",
    "from_torch_group",
    "gather",
    "gather_inplace",
    "get_autotune_level",
    "get_default_bucket_size",
    "get_local_rank",
    "get_local_size",
    "get_node_rank",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "model_parallel",
    "new_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
    "utils",
]
