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
from .communication import *  # noqa: F403 (Bagua's primitives at the top level: communication.__all__)
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
    "BaguaTensor",
    "algorithms",
    "checkpoint",
    "communication",
    "contrib",
    "data_parallel",
    "distributed",
    "env",
    "get_autotune_level",
    "get_default_bucket_size",
    "get_local_rank",
    "get_local_size",
    "get_node_rank",
    "get_rank",
    "get_world_size",
    "model_parallel",
    "utils",
]
__all__ += communication.__all__  # one list of the primitives, kept where they are defined
