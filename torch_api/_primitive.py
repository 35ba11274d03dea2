"""What every primitive of :mod:`.communication` and :mod:`._alltoall` shares: resolving ``comm`` and
checking and viewing the tensors."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..engine import peer_watch
from .process_group import BaguaCommunicator, BaguaProcessGroup, CommMember, _get_default_group

__all__ = ["Comm", "_check", "_flat", "_local", "_numel", "_resolve", "_slice", "_store", "watch_primitives"]

Comm = BaguaCommunicator | BaguaProcessGroup | Any | None


def _resolve(comm: Comm) -> BaguaCommunicator | None:
    """The communicator to run on, or None when this rank is not in it."""
    if comm is None or comm is CommMember.WORLD:
        comm = _get_default_group().get_global_communicator()
    elif isinstance(comm, BaguaProcessGroup):
        comm = comm.get_global_communicator()
    if comm is CommMember.NON_COMM_MEMBER:
        return None
    if isinstance(comm, BaguaCommunicator) and comm.check_abort():
        return None  # an aborted communicator communicates no more, as in Bagua
    if not isinstance(comm, BaguaCommunicator):
        raise TypeError(
            f"comm={comm!r} is not a Bagua communicator; pass group.get_global_communicator() "
            "(or the group itself, or None for the default group)"
        )
    return comm


def _check(c: BaguaCommunicator, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        if c.backend == "nccl" and t.device.type != "cuda":
            raise ValueError(f"an NCCL communicator needs CUDA tensors, got one on {t.device}; move it with .cuda()")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of ``t`` (a copy when ``t`` is not contiguous; :func:`_store` writes it back)."""
    return t.detach().view(-1) if t.is_contiguous() else t.detach().reshape(-1).clone()


def _store(t: torch.Tensor, flat: torch.Tensor) -> None:
    if not t.is_contiguous():
        t.detach().copy_(flat.view(t.shape))


def _numel(what: str, t: torch.Tensor, expected: int, why: str) -> None:
    if t.numel() != expected:
        raise ValueError(f"{what} has {t.numel()} elements; expected {expected} ({why})")


def _local(c: BaguaCommunicator) -> bool:
    """A single-rank communicator without a torch group: every primitive is a local copy."""
    return c.torch_group is None


def _slice(tensor: torch.Tensor, c: BaguaCommunicator) -> int:
    n = c.nranks()
    if tensor.numel() % n:
        raise ValueError(f"tensor has {tensor.numel()} elements, not divisible by the communicator's {n} ranks")
    return tensor.numel() // n


def _watched(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def primitive(*args: Any, **kwargs: Any) -> Any:
        peer_watch.set_op(name)
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:  # a peer failed: say which (the backend's error does not)
            failure = peer_watch.explain(exc)
            if failure is exc:
                raise
            raise failure from exc

    return primitive


def watch_primitives(module: ModuleType) -> None:
    """Wrap ``module``'s public primitives: each names itself to the peer watch, and an error a failed peer
    caused becomes a :class:`~bagua_lightning.engine.peer_watch.PeerFailedError` naming that peer."""
    for name in getattr(module, "__all__", ()):
        fn = getattr(module, name)
        if callable(fn) and not isinstance(fn, type) and getattr(fn, "__module__", "") == module.__name__:
            setattr(module, name, _watched(name, fn))
