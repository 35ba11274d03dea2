"""Rank programs for the rest of Bagua's surface: ``python surface_workers.py CASE``.

Each case checks values on its own rank and exits non-zero (with the assertion in the log) on a mismatch.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bagua_lightning.torch_api as bagua
from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_lightning.torch_api.communication import _get_default_group, _rank_not_in_group
from bagua_lightning.torch_api.data_parallel import functional


def case_compare() -> None:
    """Bagua's primitives against torch.distributed's own calls, as Bagua's communication example does."""
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    comm = _get_default_group().get_global_communicator()
    torch.manual_seed(r)
    # reduce: every rank's tensors end equal to torch's, also on Gloo where torch's own reduce used to
    # leave partial sums on the ranks other than dst.
    dst = 1
    mine = torch.rand(4)
    s, sb, rb = mine.clone(), mine.clone(), torch.zeros(4)
    dist.reduce(s, dst)
    bagua.reduce(sb, rb, dst=dst, comm=comm)
    bagua.reduce_inplace(sb, dst=dst, comm=comm)
    assert torch.allclose(s, sb), (s, sb)
    if r == dst:
        assert torch.allclose(sb, rb), (sb, rb)
    else:
        assert torch.equal(s, mine) and torch.equal(rb, torch.zeros(4)), (s, rb)
    # alltoall_v with Bagua's trailing total in the displacements, against all_to_all_single.
    splits = [1] * (n - 1) + [2 if r == n - 1 else 1]
    size = sum(splits)
    src = torch.arange(size, dtype=torch.float32) + 100 * r
    want, got = torch.zeros(size), torch.zeros(size)
    displs = [sum(splits[:i]) for i in range(n)] + [size]
    dist.all_to_all_single(want, src, splits, splits)
    bagua.alltoall_v(src, splits, displs, got, splits, displs, comm=comm)
    assert torch.equal(want, got), (want, got)
    inplace = src.clone()
    bagua.alltoall_v_inplace(inplace, splits, displs[:n], comm=comm)  # without the total, too
    assert torch.equal(want, inplace), (want, inplace)
    try:
        bagua.alltoall_v(src, splits, [*displs, 0], got, splits, displs, comm=comm)
    except ValueError as e:
        assert "send_displs" in str(e), e
    else:
        raise AssertionError("n + 2 displacements were accepted")
    print("compare ok", r, flush=True)


def case_surface() -> None:
    """functional.all_reduce, ProcessGroup.bagua_patch, _rank_not_in_group, the service client, thread share."""
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    # Intra-op threads: each of the node's ranks gets its share of the cores (OMP_NUM_THREADS unset here).
    share = max(1, len(os.sched_getaffinity(0)) // bagua.get_local_size())
    assert "OMP_NUM_THREADS" not in os.environ
    assert torch.get_num_threads() <= share, (torch.get_num_threads(), share)
    # An autograd-aware allreduce; the gradient is the allreduce of the incoming gradient.
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = functional.all_reduce(x)
    assert torch.equal(y.detach(), torch.full((3,), n * (n + 1) / 2)), y
    (y * (r + 1)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), n * (n + 1) / 2)), x.grad
    top = functional.all_reduce(torch.tensor([float(r)]), op=dist.ReduceOp.MAX)
    assert top.item() == n - 1, top
    try:
        functional.all_reduce(x, op=dist.ReduceOp.PRODUCT)
    except ValueError as e:
        assert "PRODUCT" in str(e), e
    else:
        raise AssertionError("an unsupported op was accepted")
    # ProcessGroup.bagua_patch: the torch group's Bagua group, attached once.
    world: Any = dist.group.WORLD
    assert world.bagua_patch() is world
    first = world.bagua_pg
    assert world.bagua_patch() is world and world.bagua_pg is first
    comm = world.bagua_get_global_communicator()
    assert (comm.rank(), comm.nranks()) == (r, n), (comm.rank(), comm.nranks())
    # _rank_not_in_group: None and the default group hold every rank; a sub-group holds its own.
    sub = bagua.communication.new_group([0])
    assert not _rank_not_in_group(None) and not _rank_not_in_group(_get_default_group())
    assert _rank_not_in_group(sub) == (r != 0)
    # The autotune client of Bagua's variables, one per process.
    client = bagua.communication.get_hyperparameters_service_client()
    assert client is bagua.communication.get_hyperparameters_service_client()
    assert client.target == f"127.0.0.1:{os.environ['BAGUA_SERVICE_PORT']}", client.target
    print("surface ok", r, flush=True)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1), nn.Sigmoid())
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _train(model: nn.Module, opt: Any, steps: int, fused: bool) -> None:
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)  # the same data on every rank
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.fuse_step() if fused else opt.step()


def case_flatten() -> None:
    """do_flatten=True: parameters in one buffer in bucket order, values kept; a fused optimizer steps plainly."""
    bagua.init_process_group()
    r = bagua.get_rank()
    plain, plain_opt = _model()
    _train(plain, plain_opt, 5, fused=False)
    model, opt = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = bagua.contrib.fuse_optimizer(opt, do_flatten=True)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm(), do_flatten=True)
    params = list(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    # Bagua's buckets run last parameter first: the buffer holds them in that order, back to back.
    ordered = params[::-1]
    for a, b in itertools.pairwise(ordered):
        assert b.data_ptr() == a.data_ptr() + a.numel() * a.element_size(), "parameters are not one buffer"
    _train(model, opt, 5, fused=True)
    assert opt._bagua_fused_count == 0, opt._bagua_fused_count
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), (a, b)
    # do_flatten=False keeps the fused layout: the fused optimizer fuses.
    kept, kept_opt = _model()
    kept_opt = bagua.contrib.fuse_optimizer(kept_opt, do_flatten=True)
    kept = kept.with_bagua([kept_opt], GradientAllReduceAlgorithm(), do_flatten=False)
    _train(kept, kept_opt, 3, fused=True)
    assert kept_opt._bagua_fused_count == 3, kept_opt._bagua_fused_count
    print("flatten ok", r, flush=True)


def _forked_worker(rank: int, world_size: int, port: int, results: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    bagua.init_process_group()
    torch.manual_seed(rank)  # different starting weights: with_bagua broadcasts rank 0's
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 2)).sum().backward()
        opt.step()
    results[rank] = bagua.utils.flatten([p.detach() for p in model.parameters()]).norm().item()


def case_fork(port: str) -> None:
    """Workers started with fork from a process that imported the package and used torch train together."""
    torch.randn(256, 256) @ torch.randn(256, 256)  # the parent's intra-op pool is up before the fork
    ctx = multiprocessing.get_context("fork")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_forked_worker, args=(i, 2, int(port), results)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert codes == [0, 0], codes
    assert len(results) == 2 and results[0] == results[1] and results[0] > 0, dict(results)
    print("fork ok", dict(results), flush=True)


def case_launched(*args: str) -> None:
    """A script started by bagua_lightning.distributed.launch or baguarun: its variables and arguments."""
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    x = torch.tensor([float(r + 1)])
    bagua.allreduce_inplace(x)
    assert x.item() == n * (n + 1) / 2, x
    print(f"launched ok rank={r} world={n} local_size={os.environ.get('LOCAL_SIZE')} "
          f"service_port={os.environ.get('BAGUA_SERVICE_PORT')} extra={os.environ.get('BAGUA_TEST_EXTRA')} "
          f"args={list(args)}", flush=True)


CASES: dict[str, Callable[..., None]] = {"compare": case_compare, "surface": case_surface, "flatten": case_flatten,
                                         "fork": case_fork, "launched": case_launched}

if __name__ == "__main__":
    # Started with Bagua's --set_additional_flag, the script's first argument is --local_rank=N.
    local_rank = [a for a in sys.argv[1:2] if a.startswith("--local_rank=")]
    rest = sys.argv[1 + len(local_rank):]
    CASES[rest[0]](*local_rank, *rest[1:])
