"""Mixture of experts sharded over the ranks (Bagua's ``model_parallel.moe``)."""

from .experts import Experts
from .layer import MoE
from .sharded_moe import MOELayer, TopKGate, all_to_all, top1gating, top2gating
from .utils import is_moe_param, mark_expert_params

__all__ = ["Experts", "MOELayer", "MoE", "TopKGate", "all_to_all", "is_moe_param", "mark_expert_params",
           "top1gating", "top2gating"]
