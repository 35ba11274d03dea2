"""Bagua's ``bagua.torch_api.model_parallel.moe`` (implementation: ``engine/contrib/moe/``)."""

from .layer import MoE
from .utils import is_moe_param

__all__ = ["MoE", "is_moe_param"]
