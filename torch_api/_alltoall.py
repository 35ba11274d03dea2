"""The all-to-all family of Bagua's primitives (re-exported by :mod:`.communication`).

``alltoall_v`` follows Bagua's (and MPI's) layout: ``counts[j]`` elements at offset ``displs[j]`` of the
buffer belong to communicator rank ``j``. A displacement list holds one entry per rank, or one more: the
total that Bagua's examples append (``[0, 1, 2, 3, 5]`` for counts ``[1, 1, 1, 2]``), which is checked to fit
and otherwise ignored. Counts and displacements may be lists, tuples, NumPy arrays or 1-D tensors.

``recv_counts[i]`` is the most this rank accepts from rank ``i``, as in Bagua: the ranks first exchange
what each actually sends (one small all-to-all), so a sender sending less leaves the rest of that slot
untouched, and one sending more fails on every rank with a ValueError naming both counts instead of
corrupting memory or hanging.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ._primitive import Comm, _check, _flat, _local, _numel, _resolve, _slice, _store

__all__ = ["alltoall", "alltoall_inplace", "alltoall_v", "alltoall_v_inplace"]


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Comm = None) -> None:
    """Slice ``send_tensor`` in ``nranks`` parts; part ``j`` of rank ``i`` becomes part ``i`` of rank ``j``'s
    ``recv_tensor`` (same size)."""
    c = _resolve(comm)
    if c is None:
        return
    _check(c, send_tensor, recv_tensor)
    _numel("recv_tensor", recv_tensor, send_tensor.numel(), "the size of send_tensor")
    _slice(send_tensor, c)
    src = send_tensor.detach().reshape(-1).clone()  # may alias recv_tensor
    out = _flat(recv_tensor)
    if _local(c):
        out.copy_(src)
    else:
        dist.all_to_all_single(out, src, group=c.torch_group)
    _store(recv_tensor, out)


def alltoall_inplace(tensor: torch.Tensor, comm: Comm = None) -> None:
    """The in-place :func:`alltoall`."""
    alltoall(tensor, tensor, comm)


def _ints(what: str, values: Iterable[int] | torch.Tensor) -> list[int]:
    """``values`` (a list, tuple, NumPy array or 1-D tensor of integers) as a list of ints."""
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a sequence of integers, got {values!r}") from None
    if any(v < 0 for v in out):
        raise ValueError(f"{what} must not be negative, got {out}")
    return out


def _splits(what: str, counts: Iterable[int] | torch.Tensor, displs: Iterable[int] | torch.Tensor, n: int,
            size: int) -> tuple[list[int], list[int]]:
    """Validated per-rank counts and displacements (the trailing total of ``displs`` checked, then dropped)."""
    cnt, dsp = _ints(f"{what}_counts", counts), _ints(f"{what}_displs", displs)
    if len(cnt) != n:
        raise ValueError(f"{what}_counts needs one entry per rank ({n}), got {len(cnt)}: {cnt}")
    if len(dsp) not in (n, n + 1):
        raise ValueError(f"{what}_displs needs one entry per rank ({n}), optionally followed by the total "
                         f"({n + 1}), got {len(dsp)}: {dsp}")
    if len(dsp) == n + 1 and dsp[n] > size:
        raise ValueError(f"{what}_displs ends with total {dsp[n]}, more than the tensor's {size} elements")
    dsp = dsp[:n]
    for i, (k, d) in enumerate(zip(cnt, dsp, strict=True)):
        if d + k > size:
            raise ValueError(f"{what} part {i}: count {k} at displacement {d} does not fit in {size} elements")
    return cnt, dsp


def alltoall_v(send_tensor: torch.Tensor, send_counts: Iterable[int] | torch.Tensor,
               send_displs: Iterable[int] | torch.Tensor, recv_tensor: torch.Tensor,
               recv_counts: Iterable[int] | torch.Tensor, recv_displs: Iterable[int] | torch.Tensor,
               comm: Comm = None) -> None:
    """All-to-all with a size per peer.

    Args:
        send_tensor: Input; ``send_counts[j]`` elements from offset ``send_displs[j]`` go to rank ``j``.
        send_counts: Elements for each rank (one entry per rank).
        send_displs: Offset of each rank's elements in ``send_tensor`` (one entry per rank, optionally
            followed by the total).
        recv_tensor: Output; what rank ``i`` sends lands at offset ``recv_displs[i]``.
        recv_counts: The most elements accepted from each rank.
        recv_displs: Offset of each rank's elements in ``recv_tensor`` (as ``send_displs``).
        comm: The communicator (None: the default group's global communicator).

    Raises:
        ValueError: A list of the wrong length, a part outside its tensor, or a rank sending more than
            the receiver's ``recv_counts`` allows (raised on every rank).
    """
    c = _resolve(comm)
    if c is None:
        return
    _check(c, send_tensor, recv_tensor)
    n = c.nranks()
    s_cnt, s_dsp = _splits("send", send_counts, send_displs, n, send_tensor.numel())
    r_max, r_dsp = _splits("recv", recv_counts, recv_displs, n, recv_tensor.numel())
    flat_send = send_tensor.detach().reshape(-1)
    packed = torch.cat([flat_send[d:d + k] for k, d in zip(s_cnt, s_dsp, strict=True)])  # a copy: may alias
    if _local(c):
        r_cnt = s_cnt
        if s_cnt[0] > r_max[0]:
            raise ValueError(f"alltoall_v: sends {s_cnt[0]} elements, recv_counts allows {r_max[0]}")
    else:
        # What each peer really sends, and whether every receiver can take it (the check is agreed on by
        # every rank, so all of them raise together instead of some hanging in the exchange below).
        mine = torch.tensor(s_cnt, dtype=torch.int64, device=c.device)
        theirs = torch.empty(n, dtype=torch.int64, device=c.device)
        dist.all_to_all_single(theirs, mine, group=c.torch_group)
        r_cnt = [int(v) for v in theirs.tolist()]
        bad = torch.tensor([int(any(k > m for k, m in zip(r_cnt, r_max, strict=True)))], device=c.device)
        dist.all_reduce(bad, group=c.torch_group)
        if int(bad.item()):
            over = [(i, k, m) for i, (k, m) in enumerate(zip(r_cnt, r_max, strict=True)) if k > m]
            raise ValueError(
                "alltoall_v: a rank sends more than its receiver's recv_counts allow"
                + (f" (here: rank {over[0][0]} sends {over[0][1]}, recv_counts allows {over[0][2]})"
                   if over else " (on another rank)"))
    got = torch.empty(sum(r_cnt), dtype=recv_tensor.dtype, device=recv_tensor.device)
    if _local(c):
        got.copy_(packed)
    else:
        dist.all_to_all_single(got, packed, output_split_sizes=r_cnt, input_split_sizes=s_cnt,
                               group=c.torch_group)
    out = _flat(recv_tensor)
    for part, d in zip(got.split(r_cnt), r_dsp, strict=True):
        out[d:d + part.numel()].copy_(part)
    _store(recv_tensor, out)


def alltoall_v_inplace(tensor: torch.Tensor, counts: Iterable[int] | torch.Tensor,
                       displs: Iterable[int] | torch.Tensor, comm: Comm = None) -> None:
    """The in-place :func:`alltoall_v`: ``counts``/``displs`` lay out both what goes to and what comes from
    each rank (so the counts must be symmetric: what rank ``i`` sends ``j`` is what ``j`` sends ``i``)."""
    alltoall_v(tensor, counts, displs, tensor, counts, displs, comm)
