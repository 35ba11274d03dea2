"""Bagua's ``bagua.torch_api.model_parallel``: the mixture-of-experts layer (``moe``)."""

from . import moe

__all__ = ["moe"]
