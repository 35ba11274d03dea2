"""Flat buffers for the fused optimizer: which tensors lie side by side in memory, and views over them.

``calculate_mutual_groups`` is Bagua's name (``bagua.torch_api.contrib.fuse.optimizer``); the rest is what
:mod:`.fused_optimizer` builds its runs and flat parameters from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["calculate_mutual_groups", "flat_view", "flatten_copies", "is_standalone", "split_like"]


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` starts exactly where ``a`` ends, inside the same storage."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()
    )


def _contiguous_runs(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped into memory-contiguous runs of two or more, in memory order."""
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    runs: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and not _adjacent(tensors[current[-1]], tensors[i]):
            if len(current) > 1:
                runs.append(current)
            current = []
        current.append(i)
    if len(current) > 1:
        runs.append(current)
    return runs


def calculate_mutual_groups(tensors_list: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
    """Runs of indices that are memory-contiguous, in the same order, in every list of ``tensors_list``.

    Args:
        tensors_list: Lists of equal length (e.g. weights, gradients, one list per state tensor); entry ``i``
            of each list belongs to parameter ``i``.

    Returns:
        The index runs (in memory order, two or more indices each) that every list has in common.
    """
    if not tensors_list:
        return []
    size = len(tensors_list[0])
    if any(len(ts) != size for ts in tensors_list):
        raise ValueError(f"every list must have the same length; got lengths {[len(ts) for ts in tensors_list]}")
    groups = _contiguous_runs(tensors_list[0])
    for tensors in tensors_list[1:]:
        other = _contiguous_runs(tensors)
        groups = [g for g in groups if g in other]
    return groups


def flat_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements over ``first``'s storage, starting where ``first`` starts."""
    with torch.no_grad():
        view = torch.empty(0, dtype=first.dtype, device=first.device)
        view.set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))
    return view


def flatten_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``tensors`` into one new flat buffer; return the views (same shapes) in the same order."""
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    views, offset = [], 0
    with torch.no_grad():
        for t in tensors:
            v = flat[offset : offset + t.numel()].view(t.shape)
            v.copy_(t)
            views.append(v)
            offset += t.numel()
    return views


def split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``, one after the other, with the shapes of ``like``."""
    views, offset = [], 0
    for t in like:
        views.append(flat.narrow(0, offset, t.numel()).view(t.shape))
        offset += t.numel()
    return views


def is_standalone(t: torch.Tensor) -> bool:
    """A tensor alone in its storage (what autograd allocates for a gradient), not a view of a buffer."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
