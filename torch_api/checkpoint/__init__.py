"""Bagua's checkpoints (``bagua.torch_api.checkpoint``): save and load a model, its optimizer and LR scheduler."""

from .checkpointing import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
