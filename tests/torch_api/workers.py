"""Rank programs for the torch_api tests: ``python workers.py CASE [ARGS]``, one process per rank.

Each case checks values on its own rank and exits non-zero (with the assertion in the log) on a mismatch.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

import bagua_lightning.torch_api.communication as C
import bagua_lightning.torch_api.process_group as PG
from bagua_lightning.torch_api import env
from bagua_lightning.torch_api.communication import ReduceOp

INT_OPS: dict[ReduceOp, Callable[[int, int], int]] = {
    ReduceOp.SUM: operator.add, ReduceOp.PRODUCT: operator.mul, ReduceOp.MIN: min, ReduceOp.MAX: max,
    ReduceOp.BAND: operator.and_, ReduceOp.BOR: operator.or_, ReduceOp.BXOR: operator.xor,
}


def expected(values: list[list[int]], op: ReduceOp) -> list[int]:
    """Reference reduction of per-rank integer lists, written independently of the code under test."""
    n = len(values)
    if op is ReduceOp.AVG:
        return [int(sum(col) / n) for col in zip(*values, strict=True)]
    return [functools.reduce(INT_OPS[op], col) for col in zip(*values, strict=True)]


def value(rank: int) -> list[int]:
    return [rank + 1, 3 * (rank + 1), 1 << rank, 5 + (rank % 3), 7 - rank]


def t(xs: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(xs, dtype=dtype)


def eq(got: torch.Tensor, want: list[int] | torch.Tensor, what: str) -> None:
    want_t = want if isinstance(want, torch.Tensor) else torch.tensor(want, dtype=got.dtype)
    assert torch.equal(got.reshape(-1), want_t.reshape(-1).to(got.dtype)), f"{what}: got {got.tolist()}, want {want_t.tolist()}"


def check_reductions(r: int, n: int) -> None:
    vals = [value(i) for i in range(n)]
    for op in ReduceOp:
        want = expected(vals, op)
        recv = torch.zeros(5, dtype=torch.int64)
        send = t(value(r))
        C.allreduce(send, recv, op=op)
        eq(recv, want, f"allreduce {op.name}")
        eq(send, value(r), f"allreduce {op.name} left send_tensor")
        x = t(value(r))
        C.allreduce_inplace(x, op)
        eq(x, want, f"allreduce_inplace {op.name}")
        for dst in (0, n - 1):
            recv = torch.full((5,), -7, dtype=torch.int64)
            C.reduce(t(value(r)), recv, dst, op)
            eq(recv, want if r == dst else [-7] * 5, f"reduce {op.name} dst {dst}")
            x = t(value(r))
            C.reduce_inplace(x, dst, op)
            eq(x, want if r == dst else value(r), f"reduce_inplace {op.name} dst {dst}")
    # Floats: AVG divides exactly.
    x = torch.tensor([float(r), 2.0 * r + 1])
    C.allreduce_inplace(x, ReduceOp.AVG)
    mean = sum(range(n)) / n
    assert torch.allclose(x, torch.tensor([mean, 2 * mean + 1])), x
    # Bitwise ops on floats are refused on every rank before anything is sent.
    try:
        C.allreduce_inplace(torch.ones(2), ReduceOp.BXOR)
    except ValueError as e:
        assert "integer" in str(e)
    else:
        raise AssertionError("BXOR on floats did not raise")


def check_reduce_scatter(r: int, n: int) -> None:
    k = 3
    rows = [[10 * i + j + 1 for j in range(n * k)] for i in range(n)]
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.BXOR, ReduceOp.PRODUCT):
        want = expected(rows, op)[r * k:(r + 1) * k]
        recv = torch.zeros(k, dtype=torch.int64)
        C.reduce_scatter(t(rows[r]), recv, op)
        eq(recv, want, f"reduce_scatter {op.name}")
        x = t(rows[r])
        C.reduce_scatter_inplace(x, op)
        mine = rows[r][:r * k] + want + rows[r][(r + 1) * k:]
        eq(x, mine, f"reduce_scatter_inplace {op.name}")


def check_gathers(r: int, n: int) -> None:
    everything = [v for i in range(n) for v in value(i)]
    recv = torch.zeros(n * 5, dtype=torch.int64)
    C.allgather(t(value(r)), recv)
    eq(recv, everything, "allgather")
    x = torch.zeros(n * 5, dtype=torch.int64)
    x[r * 5:(r + 1) * 5] = t(value(r))
    C.allgather_inplace(x)
    eq(x, everything, "allgather_inplace")
    recv2 = torch.full((n, 5), -1, dtype=torch.int64)  # 2-D output: only the element count matters
    C.allgather(t(value(r)), recv2)
    eq(recv2, everything, "allgather 2-D")
    for dst in (0, n - 1):
        recv = torch.full((n * 5,), -1, dtype=torch.int64)
        C.gather(t(value(r)), recv, dst)
        eq(recv, everything if r == dst else [-1] * (n * 5), f"gather dst {dst}")
        if r == dst:
            x = torch.zeros(n * 5, dtype=torch.int64)
            x[r * 5:(r + 1) * 5] = t(value(r))
        else:
            x = t(value(r))
        C.gather_inplace(x, 5, dst)
        eq(x, everything if r == dst else value(r), f"gather_inplace dst {dst}")
    for src in (0, n - 1):
        parts = [[1000 * src + 10 * i + j for j in range(3)] for i in range(n)]
        send = t([v for p in parts for v in p]) if r == src else torch.empty(0, dtype=torch.int64)
        recv = torch.zeros(3, dtype=torch.int64)
        C.scatter(send, recv, src)
        eq(recv, parts[r], f"scatter src {src}")
        x = t([v for p in parts for v in p]) if r == src else torch.zeros(3, dtype=torch.int64)
        C.scatter_inplace(x, 3, src)
        eq(x, [v for p in parts for v in p] if r == src else parts[r], f"scatter_inplace src {src}")


def check_alltoall(r: int, n: int) -> None:
    send = [100 * r + j for j in range(2 * n)]
    want = [100 * i + 2 * r + m for i in range(n) for m in range(2)]
    recv = torch.zeros(2 * n, dtype=torch.int64)
    C.alltoall(t(send), recv)
    eq(recv, want, "alltoall")
    x = t(send)
    C.alltoall_inplace(x)
    eq(x, want, "alltoall_inplace")

    # Uneven: rank i sends i + j + 1 elements to rank j; both sides leave one-element gaps between parts.
    def layout(counts: list[int], gap: int) -> list[int]:
        displs, at = [], 0
        for c in counts:
            displs.append(at)
            at += c + gap
        return displs

    s_counts = [r + j + 1 for j in range(n)]
    s_displs = layout(s_counts, 1)
    r_counts = [i + r + 1 for i in range(n)]
    r_displs = layout(r_counts, 2)
    send_t = torch.full((s_displs[-1] + s_counts[-1] + 1,), -5, dtype=torch.int64)
    for j in range(n):
        send_t[s_displs[j]:s_displs[j] + s_counts[j]] = t([1000 * r + 10 * j + m for m in range(s_counts[j])])
    recv_t = torch.full((r_displs[-1] + r_counts[-1] + 2,), -1, dtype=torch.int64)
    want_t = recv_t.clone()
    for i in range(n):
        want_t[r_displs[i]:r_displs[i] + r_counts[i]] = t([1000 * i + 10 * r + m for m in range(r_counts[i])])
    C.alltoall_v(send_t, s_counts, s_displs, recv_t, r_counts, r_displs)
    eq(recv_t, want_t, "alltoall_v")
    size = max(send_t.numel(), recv_t.numel())
    x = torch.full((size,), -1, dtype=torch.int64)
    x[:send_t.numel()] = send_t
    want_x = x.clone()
    for i in range(n):
        want_x[r_displs[i]:r_displs[i] + r_counts[i]] = want_t[r_displs[i]:r_displs[i] + r_counts[i]]
    C.alltoall_v(x, s_counts, s_displs, x, r_counts, r_displs)  # one tensor as input and output
    eq(x, want_x, "alltoall_v aliased")
    # Bagua's in-place form: one layout for both directions (counts are symmetric here), the
    # displacements given with Bagua's trailing total, as NumPy arrays as Bagua's example passes them.
    import numpy as np

    y = send_t.clone()
    want_y = send_t.clone()
    for i in range(n):
        want_y[s_displs[i]:s_displs[i] + s_counts[i]] = t([1000 * i + 10 * r + m for m in range(s_counts[i])])
    C.alltoall_v_inplace(y, np.array(s_counts), np.array([*s_displs, s_displs[-1] + s_counts[-1]]))
    eq(y, want_y, "alltoall_v_inplace")
    # recv_counts is the most accepted: a larger slot keeps its tail.
    big = torch.full((recv_t.numel() + n,), -1, dtype=torch.int64)
    roomy = [c + 1 for c in r_counts]
    roomy_displs = layout(roomy, 2)
    want_big = big.clone()
    for i in range(n):
        want_big[roomy_displs[i]:roomy_displs[i] + r_counts[i]] = want_t[r_displs[i]:r_displs[i] + r_counts[i]]
    C.alltoall_v(send_t, s_counts, s_displs, big, roomy, roomy_displs)
    eq(big, want_big, "alltoall_v with room to spare")


def check_p2p_and_misc(r: int, n: int) -> None:
    x = t(value(r))
    C.broadcast(x, src=n - 1)
    eq(x, value(n - 1), "broadcast")
    if n % 2 == 0:
        if r % 2 == 0:
            C.send(t(value(r)), dst=r + 1)
        else:
            y = torch.zeros(5, dtype=torch.int64)
            C.recv(y, src=r - 1)
            eq(y, value(r - 1), "send/recv")
    C.barrier()
    # Non-contiguous tensors are written back.
    m = torch.arange(6, dtype=torch.float32).reshape(2, 3).t() * (r + 1)
    C.allreduce_inplace(m, ReduceOp.SUM)
    assert torch.equal(m, torch.arange(6, dtype=torch.float32).reshape(2, 3).t() * sum(range(1, n + 1))), m
    # Coalesced calls keep every tensor's dtype and shape.
    a, b = torch.full((2, 2), float(r)), t([r, 2 * r])
    C.allreduce_coalesced_inplace([a, b])
    s = sum(range(n))
    assert torch.equal(a, torch.full((2, 2), float(s))) and b.tolist() == [s, 2 * s], (a, b)
    a, b = torch.full((3,), float(r)), t([r])
    C.broadcast_coalesced([a, b], src=1 % n)
    assert a.tolist() == [float(1 % n)] * 3 and b.tolist() == [1 % n], (a, b)
    # Objects: what torch.load(weights_only=True) accepts.
    obj = {"step": 3, "w": torch.arange(4) * (r + 1), "names": ["a", "b"], "lr": 0.5}
    got = C.broadcast_object(obj, src=n - 1)
    assert got["step"] == 3 and got["names"] == ["a", "b"] and got["lr"] == 0.5, got
    assert torch.equal(got["w"], torch.arange(4) * n), got
    # Bad arguments raise on every rank before anything is sent, so nothing hangs.
    for call, word in ((lambda: C.allgather(t([1]), torch.zeros(n + 1, dtype=torch.int64)), "elements"),
                       (lambda: C.broadcast(t([1]), src=n), "src"),
                       (lambda: C.allreduce_inplace(t([1]), op=42), "ReduceOp"),  # type: ignore[arg-type]
                       (lambda: C.alltoall_v(t([1]), [1] * (n + 1), [0] * (n + 1), t([1]), [1], [0]), "per rank"),
                       (lambda: C.send(1, 0), "Tensor")):  # type: ignore[arg-type]
        try:
            call()
        except (ValueError, TypeError) as e:
            assert word in str(e), e
        else:
            raise AssertionError(f"no error for {word}")
    C.barrier()


def case_primitives() -> None:
    C.init_process_group()
    C.init_process_group()  # a second call changes nothing
    r, n = env.get_rank(), env.get_world_size()
    backend = os.environ.get("BAGUA_TEST_BACKEND", "gloo")
    assert dist.get_backend() == backend and C.is_initialized()
    if backend == "nccl":
        torch.set_default_device("cuda")  # every tensor below lives on this rank's GPU
    check_reductions(r, n)
    check_reduce_scatter(r, n)
    check_gathers(r, n)
    check_alltoall(r, n)
    check_p2p_and_misc(r, n)
    if n == 1:
        print("primitives ok", r, flush=True)
        return
    # Everything again on a sub-group (odd ranks), through its communicator; the others are not members.
    g = C.new_group(ranks=[i for i in range(n) if i % 2 == 1])
    comm = g.get_global_communicator()
    x = t(value(r))
    C.allreduce_inplace(x, ReduceOp.SUM, comm=comm)
    if r % 2 == 1:
        eq(x, expected([value(i) for i in g.ranks], ReduceOp.SUM), "sub-group allreduce")
        recv = torch.zeros(5 * len(g.ranks), dtype=torch.int64)
        C.allgather(t(value(r)), recv, comm=g)
        eq(recv, [v for i in g.ranks for v in value(i)], "sub-group allgather")
    else:
        assert comm is C.CommMember.NON_COMM_MEMBER
        eq(x, value(r), "non-member unchanged")
        C.allgather(t(value(r)), torch.zeros(0), comm=comm)  # nothing to do, no size check
    C.barrier()
    print("primitives ok", r, flush=True)


def case_process_group() -> None:
    """4 ranks as 2 nodes x 2 (LOCAL_WORLD_SIZE=2)."""
    from bagua_lightning.engine.comm import hierarchical_all_reduce_
    from bagua_lightning.torch_api.process_group import _get_default_group

    C.init_process_group()
    r, n = env.get_rank(), env.get_world_size()
    assert (n, env.get_local_size(), env.get_local_rank(), env.get_node_rank()) == (4, 2, r % 2, r // 2)
    pg = _get_default_group()
    assert pg.ranks == [0, 1, 2, 3]
    assert pg.intra_ranks == ([0, 1] if r < 2 else [2, 3]), pg.intra_ranks
    assert pg.inter_ranks == [0, 2], pg.inter_ranks
    gc, ic, xc = pg.get_global_communicator(), pg.get_intra_node_communicator(), pg.get_inter_node_communicator()
    assert (gc.rank(), gc.nranks(), ic.rank(), ic.nranks()) == (r, 4, r % 2, 2)
    x = torch.tensor([float(r + 1)])
    C.allreduce_inplace(x, comm=ic)
    assert x.item() == (3.0 if r < 2 else 7.0), x
    if r % 2 == 0:
        assert (xc.rank(), xc.nranks()) == (r // 2, 2)
        y = torch.tensor([float(r + 1)])
        C.allreduce_inplace(y, comm=xc)
        assert y.item() == 4.0, y
    else:
        assert xc is C.CommMember.NON_COMM_MEMBER
    # The engine's view of the same group: hierarchical allreduce over real intra/inter groups.
    cc = pg.comm
    assert (cc.rank, cc.world_size, cc.local_rank, cc.local_size, cc.num_nodes) == (r, 4, r % 2, 2, 2)
    assert cc.is_hierarchical_possible and cc.backend == "gloo"
    z = torch.tensor([float(r), 10.0 * r])
    hierarchical_all_reduce_(z, cc, average=True)
    assert torch.allclose(z, torch.tensor([1.5, 15.0])), z
    # Odd ranks (one per node): the engine sees a flat group.
    odd = C.new_group([3, 1])
    if r % 2 == 1:
        oc = odd.comm
        assert (odd.ranks, oc.rank, oc.world_size, oc.local_size) == ([1, 3], r // 2, 2, 1)
        assert odd.get_intra_node_communicator().nranks() == 1
        w = torch.tensor([float(r)])
        C.allreduce_inplace(w, comm=odd.get_inter_node_communicator())
        assert w.item() == 4.0
        single = torch.tensor([5.0])
        C.allreduce_inplace(single, comm=odd.get_intra_node_communicator())  # one rank: unchanged
        assert single.item() == 5.0
    else:
        try:
            _ = odd.comm
        except ValueError as e:
            assert "not in process group" in str(e)
        else:
            raise AssertionError("a non-member got a CommContext")
    # From a torch group (uneven layout: two ranks on node 0, one on node 1), as Bagua's test does.
    tg = dist.new_group([0, 1, 2])
    bg = C.from_torch_group(tg)
    assert bg.ranks == [0, 1, 2]
    if r < 3:
        assert dist.get_rank(tg) == bg.get_global_communicator().rank()
        assert dist.get_world_size(tg) == bg.get_global_communicator().nranks() == 3
        assert bg.comm.local_size == 1 and bg.torch_group is tg
        v = torch.tensor([1.0])
        C.allreduce_inplace(v, comm=bg)
        assert v.item() == 3.0
    else:
        assert bg.get_global_communicator() is C.CommMember.NON_COMM_MEMBER
    # Bagua's own test: ranks r % 3 == 1 (a one-rank torch group here) and the even ranks.
    g1, g2 = dist.new_group([1]), dist.new_group([0, 2])
    b1, b2 = C.from_torch_group(g1), C.from_torch_group(g2)
    for tg_, bg_, members in ((g1, b1, [1]), (g2, b2, [0, 2])):
        assert bg_.ranks == members
        if r in members:
            comm_ = bg_.get_global_communicator()
            assert (dist.get_rank(tg_), dist.get_world_size(tg_)) == (comm_.rank(), comm_.nranks())
            v = torch.tensor([float(r + 1)])
            C.allreduce(v, v, comm=comm_)
            assert v.item() == sum(m + 1 for m in members), v
    # No group of no members: torch's new_group reads [] as "every rank", and Bagua built a group nobody is in
    # that failed at its first communicator (Bagua's test_decentralized asks for one on 2 ranks).
    for bad in ([], [0, 4]):
        try:
            C.new_group(bad)
        except ValueError as e:
            assert f"invalid ranks {bad}" in str(e), e
        else:
            raise AssertionError(f"new_group({bad}) was accepted")
    C.barrier()
    print("process group ok", r, flush=True)


def case_init_store(path: str) -> None:
    """Bagua's MultiProcessTestCase: a FileStore and explicit ranks, no launcher variables."""
    r, n = int(os.environ["BAGUA_TEST_RANK"]), int(os.environ["BAGUA_TEST_WORLD_SIZE"])
    assert env.get_rank() == 0 and env.get_world_size() == 1  # nothing in the environment yet
    store = dist.FileStore(path, n)
    C.init_process_group(store, rank=r, world_size=n, local_world_size=n)
    assert (env.get_rank(), env.get_world_size(), env.get_local_rank(), env.get_local_size()) == (r, n, r, n)
    x = torch.tensor([1.0])
    C.allreduce_inplace(x)
    assert x.item() == float(n)
    print("init store ok", r, flush=True)


def case_adopt_torch(path: str) -> None:
    """torch.distributed initialised first (as a Lightning strategy does): Bagua's init adopts it."""
    r, n = int(os.environ["BAGUA_TEST_RANK"]), int(os.environ["BAGUA_TEST_WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.FileStore(path, n), rank=r, world_size=n)
    assert (env.get_rank(), env.get_world_size()) == (r, n)  # from torch.distributed, no variables set
    C.init_process_group()  # node mates found by hostname through torch's own store
    assert (env.get_rank(), env.get_world_size(), env.get_local_rank(), env.get_local_size()) == (r, n, r, n)
    assert PG._get_default_group().torch_group is dist.group.WORLD
    x = torch.tensor([float(r)])
    C.allreduce_inplace(x, ReduceOp.MAX)
    assert x.item() == n - 1
    print("adopt ok", r, flush=True)


def case_hosts() -> None:
    """No LOCAL_WORLD_SIZE (Lightning's launcher): the ranks find their node mates by hostname."""
    from bagua_lightning.torch_api.process_group import _get_default_group

    r, n = int(os.environ["BAGUA_TEST_RANK"]), int(os.environ["BAGUA_TEST_WORLD_SIZE"])
    assert "LOCAL_WORLD_SIZE" not in os.environ and env.get_local_size() == 1
    C.init_process_group()
    assert (env.get_rank(), env.get_local_rank(), env.get_local_size(), env.get_node_rank()) == (r, r, n, 0)
    cc = _get_default_group().comm
    assert (cc.local_size, cc.num_nodes) == (n, 1)
    print("hosts ok", r, flush=True)


def case_env() -> None:
    """The launcher's variables before init_process_group, the same answers after."""
    r, n, local = (int(os.environ[k]) for k in ("BAGUA_TEST_RANK", "BAGUA_TEST_WORLD_SIZE", "BAGUA_TEST_LOCAL_SIZE"))
    want = (r, n, r % local, local, r // local)

    def now() -> tuple[int, ...]:
        return env.get_rank(), env.get_world_size(), env.get_local_rank(), env.get_local_size(), env.get_node_rank()

    assert now() == want, (now(), want)
    C.init_process_group()
    assert now() == want, (now(), want)
    assert env.get_master_addr() == "127.0.0.1"
    print("env ok", r, flush=True)


def case_checkpoint(path: str) -> None:
    """Save on every rank (rank 0 writes), load into fresh models: every rank gets rank 0's states."""
    from bagua_lightning.torch_api.checkpoint import load_checkpoint, save_checkpoint
    from bagua_lightning.torch_api.utils import flatten

    C.init_process_group()
    r = env.get_rank()
    torch.manual_seed(r)  # replicas differ, as with decentralized algorithms

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    model, opt, sched = make()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).pow(2).sum().backward()
        opt.step()
        sched.step()
    assert load_checkpoint(path, model) == 0  # nothing saved yet
    save_checkpoint(7, path, model, opt, sched)
    save_checkpoint(12, path, model, opt, sched)
    weights = flatten([p.detach() for p in model.parameters()])
    momenta = flatten([opt.state[p]["momentum_buffer"] for p in model.parameters()])
    C.broadcast(weights, src=0)  # rank 0's states are the checkpoint's
    C.broadcast(momenta, src=0)
    from pathlib import Path
    assert (Path(path) / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert sorted(x.name for x in Path(path).iterdir() if x.is_dir()) == ["iter_0000007", "iter_0000012"]

    torch.manual_seed(100 + r)
    fresh, fresh_opt, fresh_sched = make()
    # Loaded through a real DDP wrapper: keys saved without "module." load into it and into plain models.
    wrapped = torch.nn.parallel.DistributedDataParallel(fresh)
    assert load_checkpoint(path, wrapped, fresh_opt, fresh_sched) == 12
    assert torch.equal(flatten([p.detach() for p in fresh.parameters()]), weights)
    assert torch.equal(flatten([fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]), momenta)
    assert fresh_sched.last_epoch == 2 and fresh_opt.param_groups[0]["lr"] == 0.025, fresh_opt.param_groups
    # Saved from the wrapper, loaded into a plain model.
    save_checkpoint(13, path, wrapped)
    plain, _, _ = make()
    assert load_checkpoint(path, plain) == 13
    assert torch.equal(flatten([p.detach() for p in plain.parameters()]), weights)
    print("checkpoint ok", r, flush=True)


def case_pg_map() -> None:
    """Bagua's test_bagua_pg: bagua_patch() registers a torch group; destroy_process_group() forgets it."""
    import bagua_lightning.torch_api as bagua

    bagua.init_process_group()
    pg = dist.new_group(ranks=list(range(dist.get_world_size())))
    pg.bagua_patch()  # type: ignore[attr-defined]
    assert pg in bagua.communication._torch_to_bagua_pg_map
    del pg
    dist.destroy_process_group()
    assert len(bagua.communication._torch_to_bagua_pg_map) == 0
    print("pg map ok", flush=True)


CASES: dict[str, Callable[..., None]] = {
    "primitives": case_primitives,
    "process_group": case_process_group,
    "init_store": case_init_store,
    "env": case_env,
    "hosts": case_hosts,
    "adopt_torch": case_adopt_torch,
    "checkpoint": case_checkpoint,
    "pg_map": case_pg_map,
}

if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
    if dist.is_initialized():
        dist.barrier()  # leave together: a rank tearing down while a peer still talks aborts the process
        dist.destroy_process_group()
