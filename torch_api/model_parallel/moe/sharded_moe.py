"""Bagua's ``moe.sharded_moe``."""

from ....engine.contrib.moe.sharded_moe import (
    Base,
    MOELayer,
    TopKGate,
    exp_selection_uniform_map,
    gumbel_map,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    uniform_map,
)

__all__ = [
    "Base", "MOELayer", "TopKGate", "exp_selection_uniform_map", "gumbel_map", "gumbel_rsample",
    "multiplicative_jitter", "top1gating", "top2gating", "uniform_map",
]
