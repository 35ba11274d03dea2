"""What Bagua added to torch itself, applied when :mod:`bagua_lightning.torch_api` is imported.

- ``torch.distributed.ProcessGroup.bagua_patch(stream=None)``: attaches the Bagua process group of a torch
  group (``group.bagua_pg``) and returns the group, so ``group.bagua_patch().bagua_get_global_communicator()``
  works as in Bagua. Calling it again is a no-op (the first Bagua group is kept); like
  :func:`~.process_group.from_torch_group` it is collective the first time: every rank calls it.
- ``torch.distributed.reduce`` on Gloo leaves the tensor of the ranks other than ``dst`` as it was, as
  NCCL does (Gloo's reduce leaves partial sums there). Bagua's primitives follow NCCL, and Bagua's own
  examples compare them with ``dist.reduce``; with this both backends agree. Only CPU tensors on a Gloo
  group change path (a copy is reduced instead); the result on ``dst`` is the same.
- ``torch.distributed.destroy_process_group(group)`` also forgets the Bagua group of ``group`` (all of them
  for the default group), as Bagua's ``communication._torch_to_bagua_pg_map`` did, and stops the watch over
  the other ranks when the default group goes (:mod:`~bagua_lightning.engine.peer_watch`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["apply"]

# torch group -> its Bagua group (Bagua's ``communication._torch_to_bagua_pg_map``); ProcessGroup objects
# take no attributes of their own.
_bagua_groups: dict[Any, Any] = {}


def _bagua_patch(self: Any, stream: torch.cuda.Stream | None = None) -> Any:
    if self not in _bagua_groups:
        from .process_group import from_torch_group

        _bagua_groups[self] = from_torch_group(self, stream)
    return self


def _bagua_pg(self: Any) -> Any:
    try:
        return _bagua_groups[self]
    except KeyError:
        raise AttributeError("this process group has no Bagua group yet; call group.bagua_patch() first") from None


def _communicator(kind: str) -> Callable[[Any], Any]:
    def get(self: Any) -> Any:
        return getattr(_bagua_pg(self), f"get_{kind}_communicator")()

    get.__name__ = f"bagua_get_{kind}_communicator"
    get.__doc__ = f"The {kind} communicator of the group's Bagua group (after :meth:`bagua_patch`)."
    return get


def _nccl_like_reduce(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def reduce(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch's own error for a bad call
        tensor = bound.arguments.get("tensor")
        group = bound.arguments.get("group")
        if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu"
                or group is c10d.GroupMember.NON_GROUP_MEMBER):
            return original(*args, **kwargs)
        try:
            if "gloo" not in str(dist.get_backend(group)):
                return original(*args, **kwargs)
            dst = bound.arguments.get("dst")
            group_dst = bound.arguments.get("group_dst")
            if group_dst is not None:
                dst = dist.get_global_rank(group if group is not None else c10d._get_default_group(), group_dst)
            if dst is None or dist.get_rank() == dst:
                return original(*args, **kwargs)
        except (RuntimeError, ValueError):
            return original(*args, **kwargs)
        bound.arguments["tensor"] = tensor.clone()  # reduced and dropped: this rank's tensor stays as it was
        return original(*bound.args, **bound.kwargs)

    reduce._bagua_lightning_patched = True  # type: ignore[attr-defined]
    return reduce


def _forgetting_destroy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        world = group is None or group is c10d.GroupMember.WORLD
        if world:  # first: the peers read this rank's exit mark before its connections close
            from ..engine import peer_watch

            peer_watch.stop()
        original(group)
        if world:
            _bagua_groups.clear()
        else:
            _bagua_groups.pop(group, None)

    destroy_process_group._bagua_lightning_patched = True  # type: ignore[attr-defined]
    return destroy_process_group


def apply() -> None:
    """Install the patches (idempotent)."""
    pg = dist.ProcessGroup
    if not hasattr(pg, "bagua_patch"):
        pg.bagua_patch = _bagua_patch  # type: ignore[attr-defined]
        pg.bagua_pg = property(_bagua_pg)  # type: ignore[attr-defined]
        for kind in ("global", "inter_node", "intra_node"):
            setattr(pg, f"bagua_get_{kind}_communicator", _communicator(kind))
    if not getattr(c10d.reduce, "_bagua_lightning_patched", False):
        patched = _nccl_like_reduce(c10d.reduce)
        c10d.reduce = patched
        dist.reduce = patched
    if not getattr(c10d.destroy_process_group, "_bagua_lightning_patched", False):
        patched = _forgetting_destroy(c10d.destroy_process_group)
        c10d.destroy_process_group = patched
        dist.destroy_process_group = patched
