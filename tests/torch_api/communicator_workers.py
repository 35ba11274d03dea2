"""Rank programs for Bagua's communicator objects and a Bagua-style script: ``python communicator_workers.py CASE``.

Each case checks values on its own rank and exits non-zero (with the assertion in the log) on a mismatch.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import bagua_lightning.torch_api as bagua
from bagua_lightning.torch_api.communication import ReduceOp, _get_default_group


def case_script() -> None:
    """What a Bagua training script does first: the launcher's answers before and after init_process_group."""
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])

    def now() -> tuple[int, ...]:
        return (bagua.get_rank(), bagua.get_world_size(), bagua.get_local_rank(), bagua.get_local_size(),
                bagua.get_node_rank())

    want = (r, n, r % local, local, r // local)
    assert not bagua.is_initialized()
    assert now() == want, (now(), want)
    bagua.init_process_group()
    assert bagua.is_initialized() and dist.get_backend() == "gloo"
    assert now() == want, (now(), want)
    x = torch.full((3,), float(r + 1))
    bagua.allreduce_inplace(x, op=bagua.ReduceOp.AVG)
    assert torch.equal(x, torch.full((3,), (n + 1) / 2)), x
    print("script ok", r, flush=True)


def case_methods() -> None:
    """The communicator's own methods, on the default group and on a sub-group, values checked."""
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    comm = _get_default_group().get_global_communicator()
    assert comm is _get_default_group().get_global_communicator()  # one object per communicator
    assert (comm.rank(), comm.nranks(), comm.device_id(), comm.check_abort()) == (r, n, -1, False)
    x = torch.tensor([float(r + 1)] * 4)
    comm.allreduce_inplace(x, int(ReduceOp.AVG))  # Bagua passed the operator as its integer value
    assert torch.equal(x, torch.full((4,), (n + 1) / 2)), x
    out = torch.zeros(4)
    comm.allreduce(torch.ones(4), out, ReduceOp.SUM)
    assert torch.equal(out, torch.full((4,), float(n))), out
    b = torch.tensor([float(r)])
    comm.broadcast(b, n - 1)
    assert b.item() == n - 1, b
    gathered = torch.zeros(n * 2)
    comm.allgather(torch.tensor([float(r), -float(r)]), gathered)
    assert gathered.tolist() == [v for i in range(n) for v in (float(i), -float(i))], gathered
    if r % 2 == 0:
        comm.send(torch.tensor([10.0 + r]), r + 1)
    else:
        got = torch.zeros(1)
        comm.recv(got, r - 1)
        assert got.item() == 10.0 + r - 1, got
    comm.barrier()
    odd = bagua.new_group(ranks=[i for i in range(n) if i % 2 == 1])
    sub = odd.get_global_communicator()
    if r % 2 == 1:
        y = torch.tensor([float(r)])
        sub.allreduce_inplace(y, ReduceOp.MAX)
        assert y.item() == max(odd.ranks), y
    try:
        comm.allreduce_inplace(torch.ones(2), 42)
    except ValueError as exc:
        assert "op=42" in str(exc), exc
    else:
        raise AssertionError("an unknown operator value was accepted")
    comm.barrier()
    print("methods ok", r, flush=True)


def case_abort() -> None:
    """Rank r runs r + 1 allreduces; the last rank's extra one has no partner until abort() releases it."""
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    comm = _get_default_group().get_global_communicator()

    def abort() -> None:
        time.sleep(3)
        comm.abort()

    thread = threading.Thread(target=abort)
    thread.start()
    x = torch.ones(10)
    for _ in range(min(r, 1) + 1):  # ranks >= 1 wait in a second allreduce that nobody else joins
        comm.allreduce_inplace(x, ReduceOp.SUM)
    thread.join()
    assert comm.check_abort()
    if r == 0:
        assert torch.equal(x, torch.full((10,), float(n))), x
    y = torch.ones(10)
    comm.allreduce_inplace(y, ReduceOp.SUM)  # an aborted communicator returns at once, communicating nothing
    bagua.allreduce_inplace(y, comm=comm)
    assert torch.equal(y, torch.ones(10)), y
    print("abort ok", r, flush=True)


CASES: dict[str, Callable[..., None]] = {"script": case_script, "methods": case_methods, "abort": case_abort}

if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
    # Like a Bagua script, every case exits without destroy_process_group: init_process_group's exit hook
    # tears torch.distributed down once every rank is leaving.
