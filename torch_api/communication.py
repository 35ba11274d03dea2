"""Bagua's communication primitives (``bagua.torch_api.communication``) on torch.distributed.

Every primitive takes ``comm``: a communicator of a :class:`BaguaProcessGroup`
(``group.get_global_communicator()``, ``get_intra_node_communicator()``, ``get_inter_node_communicator()``),
a :class:`BaguaProcessGroup` (its global communicator), or None (the default group's global
communicator). ``src``/``dst`` are ranks within that communicator. A rank outside the communicator
(``CommMember.NON_COMM_MEMBER``) returns at once, as in Bagua. The calls are synchronous: the result is
in the output tensor when the call returns (with NCCL: for work queued after it on the current stream).

Every rank of the communicator must make the same calls in the same order, with matching sizes.
Where a backend lacks a collective it is built from ones it has; ``docs/torch_api_comm.md`` lists them.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ._alltoall import alltoall, alltoall_inplace, alltoall_v, alltoall_v_inplace
from ._communicator import bind_primitives
from ._ops import ReduceOp, all_gather_single, as_reduce_op, check_op_dtype, divide_, native_op, reduce_rows
from ._primitive import Comm, _check, _flat, _local, _numel, _resolve, _slice, _store, watch_primitives
from ._service import get_hyperparameters_service_client
from ._torch_patch import _bagua_groups as _torch_to_bagua_pg_map  # noqa: F401 (Bagua's name)
from .process_group import (
    BaguaCommunicator,
    BaguaProcessGroup,
    CommMember,
    _get_default_group,
    from_torch_group,
    is_initialized,
    new_group,
)
from .process_group_init import init_process_group

__all__ = [
    "BaguaCommunicator",
    "BaguaProcessGroup",
    "CommMember",
    "ReduceOp",
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
    "from_torch_group",
    "gather",
    "gather_inplace",
    "get_hyperparameters_service_client",
    "init_bagua_communicator",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
]

def _rank_not_in_comm(comm: Any = None) -> bool:
    """Whether this process is outside ``comm`` (None: the default communicator, which holds every rank)."""
    return comm is not None and comm is CommMember.NON_COMM_MEMBER


def _rank_not_in_group(group: BaguaProcessGroup | None = None) -> bool:
    """Whether this process is outside ``group`` (None: the default group, which holds every rank)."""
    return group is not None and _rank_not_in_comm(group.get_global_communicator())


def init_bagua_communicator(model_name: str, stream: torch.cuda.Stream | None = None) -> BaguaCommunicator:
    """The default group's global communicator (Bagua created one per model; torch shares the group)."""
    del model_name, stream
    comm = _get_default_group().get_global_communicator()
    assert isinstance(comm, BaguaCommunicator)  # the default group holds every rank
    return comm


def send(tensor: torch.Tensor, dst: int, comm: Comm = None) -> None:
    """Send ``tensor`` to communicator rank ``dst``; returns when it is sent."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, tensor)
    dist.send(tensor.detach().contiguous(), dst=c.global_rank(dst, "dst"), group=c.torch_group)


def recv(tensor: torch.Tensor, src: int, comm: Comm = None) -> None:
    """Receive into ``tensor`` from communicator rank ``src``."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, tensor)
    buf = _flat(tensor)
    dist.recv(buf, src=c.global_rank(src, "src"), group=c.torch_group)
    _store(tensor, buf)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: Comm = None) -> None:
    """Copy ``tensor`` of communicator rank ``src`` into ``tensor`` on every rank (same number of elements)."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, tensor)
    root = c.global_rank(src, "src")
    if _local(c):
        return
    buf = _flat(tensor)
    dist.broadcast(buf, src=root, group=c.torch_group)
    _store(tensor, buf)


def _allreduce_flat(c: BaguaCommunicator, buf: torch.Tensor, op: ReduceOp) -> None:
    check_op_dtype(op, buf)
    if _local(c):
        return
    native = native_op(op, c.backend)
    if native is None:
        rows = torch.empty((c.nranks(), buf.numel()), dtype=buf.dtype, device=buf.device)
        all_gather_single(rows.view(-1), buf, group=c.torch_group)
        buf.copy_(reduce_rows(rows, op))
        return
    dist.all_reduce(buf, op=native, group=c.torch_group)
    if op is ReduceOp.AVG and c.backend != "nccl":
        divide_(buf, c.nranks())


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """Reduce ``tensor`` over every rank with ``op``; every rank ends with the result in ``tensor``."""
    c = _resolve(comm)
    if c is None:
        return
    op = as_reduce_op(op)
    _check(c, tensor)
    buf = _flat(tensor)
    _allreduce_flat(c, buf, op)
    _store(tensor, buf)


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
              comm: Comm = None) -> None:
    """Reduce ``send_tensor`` over every rank with ``op`` into ``recv_tensor`` (same size) on every rank."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, send_tensor, recv_tensor)
    _numel("recv_tensor", recv_tensor, send_tensor.numel(), "the size of send_tensor")
    if recv_tensor is not send_tensor:
        recv_tensor.detach().copy_(send_tensor.detach().reshape(recv_tensor.shape))
    allreduce_inplace(recv_tensor, op, c)


def allreduce_coalesced_inplace(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                                comm: Comm = None) -> None:
    """:func:`allreduce_inplace` of several tensors (one collective per dtype and device)."""
    c = _resolve(comm)
    if c is None:
        return
    for group in _by_kind(tensors):
        flat = _flatten_dense_tensors([t.detach() for t in group])
        allreduce_inplace(flat, op, c)
        for t, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            t.detach().copy_(synced)


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, comm: Comm = None) -> None:
    """:func:`broadcast` of several tensors (one collective per dtype and device)."""
    c = _resolve(comm)
    if c is None:
        return
    for group in _by_kind(tensors):
        flat = _flatten_dense_tensors([t.detach() for t in group])
        broadcast(flat, src, c)
        for t, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            t.detach().copy_(synced)


def _by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    return list(kinds.values())


def _reduce_to(c: BaguaCommunicator, buf: torch.Tensor, root: int, op: ReduceOp) -> torch.Tensor | None:
    """Reduce ``buf`` (a scratch copy) to global rank ``root``; the result there, None elsewhere."""
    check_op_dtype(op, buf)
    me = c.ranks[c.rank()]
    if _local(c):
        return buf
    native = native_op(op, c.backend)
    if native is None:
        rows = torch.empty((c.nranks(), buf.numel()), dtype=buf.dtype, device=buf.device)
        all_gather_single(rows.view(-1), buf, group=c.torch_group)
        return reduce_rows(rows, op) if me == root else None
    dist.reduce(buf, dst=root, op=native, group=c.torch_group)
    if me != root:
        return None
    if op is ReduceOp.AVG and c.backend != "nccl":
        divide_(buf, c.nranks())
    return buf


def reduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           comm: Comm = None) -> None:
    """Reduce ``send_tensor`` over every rank with ``op`` into ``recv_tensor`` of communicator rank ``dst``.

    ``send_tensor`` is left as it was everywhere; ``recv_tensor`` changes only on ``dst``.
    """
    c = _resolve(comm)
    if c is None:
        return
    op = as_reduce_op(op)
    _check(c, send_tensor, recv_tensor)
    root = c.global_rank(dst, "dst")
    _numel("recv_tensor", recv_tensor, send_tensor.numel(), "the size of send_tensor")
    out = _reduce_to(c, send_tensor.detach().reshape(-1).clone(), root, op)
    if out is not None:
        recv_tensor.detach().copy_(out.view(recv_tensor.shape))


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """The in-place :func:`reduce`: ``tensor`` of rank ``dst`` gets the result; the others keep theirs."""
    reduce(tensor, tensor, dst, op, comm)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Comm = None) -> None:
    """Concatenate ``send_tensor`` of every rank, in rank order, into ``recv_tensor`` (``nranks`` times as big)."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, send_tensor, recv_tensor)
    n = c.nranks()
    _numel("recv_tensor", recv_tensor, n * send_tensor.numel(), f"{n} ranks x send_tensor")
    out = _flat(recv_tensor)
    src = send_tensor.detach().reshape(-1).clone()  # may alias recv_tensor
    if _local(c):
        out.copy_(src)
    else:
        all_gather_single(out, src, group=c.torch_group)
    _store(recv_tensor, out)


def allgather_inplace(tensor: torch.Tensor, comm: Comm = None) -> None:
    """The in-place :func:`allgather`: rank ``i``'s input is the ``i``-th of ``nranks`` equal slices of ``tensor``."""
    c = _resolve(comm)
    if c is None:
        return
    k = _slice(tensor, c)
    mine = _flat(tensor)[c.rank() * k:(c.rank() + 1) * k]
    allgather(mine, tensor, c)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm: Comm = None) -> None:
    """Concatenate ``send_tensor`` of every rank, in rank order, into ``recv_tensor`` of communicator rank ``dst``."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, send_tensor, recv_tensor)
    root = c.global_rank(dst, "dst")
    n, me = c.nranks(), c.rank() == dst
    src = send_tensor.detach().reshape(-1).clone()
    if me:
        _numel("recv_tensor", recv_tensor, n * send_tensor.numel(), f"{n} ranks x send_tensor on the dst rank")
        out = _flat(recv_tensor)
        if _local(c):
            out.copy_(src)
        else:
            dist.gather(src, list(out.view(n, -1).unbind(0)), dst=root, group=c.torch_group)
        _store(recv_tensor, out)
    elif not _local(c):
        dist.gather(src, None, dst=root, group=c.torch_group)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: Comm = None) -> None:
    """The in-place :func:`gather`: on ``dst`` ``tensor`` holds ``nranks * count`` elements (its own input at
    slice ``dst``), elsewhere ``count`` (the input)."""
    c = _resolve(comm)
    if c is None:
        return
    if c.rank() == dst:
        _numel("tensor", tensor, c.nranks() * count, f"{c.nranks()} ranks x count on the dst rank")
        gather(_flat(tensor)[dst * count:(dst + 1) * count], tensor, dst, c)
    else:
        _numel("tensor", tensor, count, "count on a rank other than dst")
        gather(tensor, tensor, dst, c)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm: Comm = None) -> None:
    """Slice ``send_tensor`` of communicator rank ``src`` in ``nranks`` parts; rank ``i`` gets part ``i``."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, send_tensor, recv_tensor)
    root = c.global_rank(src, "src")
    n, me = c.nranks(), c.rank() == src
    out = _flat(recv_tensor)
    if me:
        _numel("send_tensor", send_tensor, n * recv_tensor.numel(), f"{n} ranks x recv_tensor on the src rank")
        parts = list(send_tensor.detach().reshape(n, -1).clone().unbind(0))
        if _local(c):
            out.copy_(parts[0])
        else:
            dist.scatter(out, parts, src=root, group=c.torch_group)
    else:
        dist.scatter(out, None, src=root, group=c.torch_group)
    _store(recv_tensor, out)


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: Comm = None) -> None:
    """The in-place :func:`scatter`: on ``src`` ``tensor`` holds ``nranks * count`` elements (unchanged: its
    part is slice ``src``), elsewhere ``count`` (overwritten with that rank's part)."""
    c = _resolve(comm)
    if c is None:
        return
    if c.rank() == src:
        _numel("tensor", tensor, c.nranks() * count, f"{c.nranks()} ranks x count on the src rank")
        scatter(tensor, torch.empty(count, dtype=tensor.dtype, device=tensor.device), src, c)
    else:
        _numel("tensor", tensor, count, "count on a rank other than src")
        scatter(tensor, tensor, src, c)


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                   comm: Comm = None) -> None:
    """Reduce ``send_tensor`` over every rank with ``op``; rank ``i`` gets slice ``i`` of the result.

    NCCL: one reduce-scatter (bitwise ops: all-to-all then a local reduction). Gloo: all-to-all, then
    each rank reduces the ``nranks`` slices it received.
    """
    c = _resolve(comm)
    if c is None:
        return
    op = as_reduce_op(op)
    _check(c, send_tensor, recv_tensor)
    n, k = c.nranks(), recv_tensor.numel()
    _numel("send_tensor", send_tensor, n * k, f"{n} ranks x recv_tensor")
    check_op_dtype(op, send_tensor)
    src = send_tensor.detach().reshape(-1).clone()  # may alias recv_tensor
    out = _flat(recv_tensor)
    native = native_op(op, c.backend) if c.backend == "nccl" else None
    if _local(c):
        out.copy_(src)
    elif native is not None:
        dist.reduce_scatter_tensor(out, src, op=native, group=c.torch_group)
    else:
        rows = torch.empty((n, k), dtype=src.dtype, device=src.device)
        dist.all_to_all_single(rows.view(-1), src, group=c.torch_group)
        out.copy_(reduce_rows(rows, op))
    _store(recv_tensor, out)


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Comm = None) -> None:
    """The in-place :func:`reduce_scatter`: rank ``i``'s slice ``i`` of ``tensor`` gets the result; the other
    slices keep their input."""
    c = _resolve(comm)
    if c is None:
        return
    k = _slice(tensor, c)
    flat = _flat(tensor)
    out = torch.empty(k, dtype=tensor.dtype, device=tensor.device)
    reduce_scatter(flat, out, op, c)
    flat[c.rank() * k:(c.rank() + 1) * k].copy_(out)
    _store(tensor, flat)


def barrier(comm: Comm = None) -> None:
    """Return once every rank of the communicator has entered ``barrier``."""
    c = _resolve(comm)
    if c is None or _local(c):
        return
    token = torch.ones(1, device=c.device)
    dist.all_reduce(token, group=c.torch_group)
    token.item()  # with NCCL, wait on the host as well


def broadcast_object(obj: Any, src: int = 0, comm: Comm = None) -> Any:
    """Broadcast ``obj`` from communicator rank ``src``; returns it on every rank.

    ``obj`` is serialised with ``torch.save`` and loaded with ``torch.load(weights_only=True)``: tensors,
    numbers, strings, and lists, tuples and dicts of them (an optimizer's ``state_dict()``) travel;
    other objects raise on the receiving ranks, as nothing received is unpickled freely.
    """
    c = _resolve(comm)
    if c is None:
        return obj
    root = c.global_rank(src, "src")
    if _local(c):
        return obj
    device = c.device
    if c.rank() == src:
        data = io.BytesIO()
        torch.save(obj, data)
        payload = torch.frombuffer(bytearray(data.getvalue()), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=root, group=c.torch_group)
    if c.rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=root, group=c.torch_group)
    if c.rank() == src:
        return obj
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)


watch_primitives(sys.modules[__name__])
bind_primitives(sys.modules[__name__])  # the communicator methods run the primitives above
