"""Scenarios of the weight-averaging algorithms' tests, run on real Gloo ranks.

:func:`run_ranks` runs a scenario on every rank (through :func:`tests.ranks.run_function`) with the
job's :class:`CommContext`; the results come back by rank. Scenario functions live here (importable
by the ranks).

The toy task: a small MLP fitting a fixed random teacher, each rank on its own
shard of the data, so weights drift apart between rank unless averaged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bagua_lightning.engine.algorithms.base import Algorithm, get_algorithm_class
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration, split_into_buckets
from tests.ranks import run_function

Scenario = Callable[..., Any]


def run_ranks(
    scenario: Scenario, world_size: int, *args: Any, local_size: int | None = None, timeout_s: float = 120.0
) -> list[Any]:
    """Run ``scenario(comm, *args)`` on ``world_size`` Gloo ranks (:func:`tests.ranks.run_function`); results by rank."""
    return run_function(_with_comm, scenario, local_size or world_size, *args, world_size=world_size,
                        local_size=local_size, timeout_s=timeout_s)


def _with_comm(scenario: Scenario, local_size: int, *args: Any) -> Any:
    return scenario(CommContext.build(local_size=local_size), *args)


# --- the toy task ---------------------------------------------------------------------------------

def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_plan(model: nn.Module, bucket_size: int = 300) -> BucketPlan:
    """A plan with several small buckets (exercises the multi-bucket paths)."""
    decls = [TensorDeclaration(n, p.numel()) for n, p in model.named_parameters()]
    return BucketPlan(buckets=split_into_buckets(decls, bucket_size), bucket_size=bucket_size)


def shard(rank: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(8, 1, generator=teacher)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 8, generator=g)
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(n, 1, generator=g)


def eval_loss(model: nn.Module) -> float:
    xs, ys = zip(*(shard(r) for r in range(8)), strict=True)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)))


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def build(name: str, comm: CommContext, model: nn.Module, **kwargs: Any) -> Algorithm:
    algo = get_algorithm_class(name).from_kwargs(**kwargs)
    algo.setup(model, comm, make_plan(model))
    return algo


def train_step(algo: Algorithm, model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int,
               on_averaged: Callable[[], None] | None = None) -> None:
    """One training step driven exactly as the module wrapper drives the hooks."""
    x, y = shard(rank)
    algo.on_forward_start(step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    algo.on_backward_end(step)
    if on_averaged is not None:
        on_averaged()
    opt.step()
    algo.on_optimizer_step_end(step)
    opt.zero_grad()


# --- scenarios: decentralized ---------------------------------------------------------------------

def decentralized_trace(comm: CommContext, kwargs: dict[str, Any], steps: int, lr: float = 0.1) -> dict[str, Any]:
    """Train ``steps`` steps; record weights at forward start (before) and after the averaging."""
    model = make_model()
    algo = build("decentralized", comm, model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    before: list[torch.Tensor] = []
    after: list[torch.Tensor] = []
    peers: list[int | None] = []
    start = eval_loss(model)
    for step in range(steps):
        before.append(flat_weights(model))
        peers.append(algo.peer_at(step))  # type: ignore[attr-defined]
        train_step(algo, model, opt, step, comm.rank, on_averaged=lambda: after.append(flat_weights(model)))
    algo.teardown()
    return {"before": before, "after": after, "peers": peers, "start_loss": start, "end_loss": eval_loss(model)}


def decentralized_traces(comm: CommContext, configs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """:func:`decentralized_trace` for several configurations in one launch (saves process start-ups)."""
    return [decentralized_trace(comm, kwargs, steps) for kwargs in configs]


# --- scenarios: low precision decentralized -------------------------------------------------------

def low_precision_trace(comm: CommContext, kwargs: dict[str, Any], steps: int, lr: float = 0.1) -> dict[str, Any]:
    """Train ``steps`` steps and check the DCD-PSGD update of every communicating step on this rank."""
    from bagua_lightning.engine.compression import max_quantisation_error

    model = make_model()
    algo: Any = build("low_precision_decentralized", comm, model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    start = eval_loss(model)
    worst_excess = 0.0  # how far the new weights land outside the quantisation bound of the target
    model_equals_replica = True
    for step in range(steps):
        x, y = shard(comm.rank)
        algo.on_forward_start(step)
        nn.functional.mse_loss(model(x), y).backward()
        algo.on_backward_end(step)
        opt.step()
        reps = {k: [t.clone() for t in v] for k, v in algo.replicas.items()}
        local = [f.clone() for f in algo._buckets.flatten()]
        algo.on_optimizer_step_end(step)
        opt.zero_grad()
        if algo.communicates_at(step) and algo.neighbours is not None and not algo._scope.uses_hierarchy:
            for i, x_local in enumerate(local):
                w, left, right = reps["weight"][i], reps["left"][i], reps["right"][i]
                diff = x_local + (left + right) / 3 - 5 / 3 * w
                target = x_local + (left + right) / 3 - 2 / 3 * w
                new = algo.replicas["weight"][i]
                excess = (new - target).abs().max().item() - max_quantisation_error(diff, 1)
                worst_excess = max(worst_excess, excess)
            model_equals_replica &= all(
                torch.equal(a, b) for a, b in zip(algo._buckets.flatten(), algo.replicas["weight"], strict=True)
            )
    replicas = {k: [t.clone() for t in v] for k, v in algo.replicas.items()}
    neighbours = algo.neighbours
    end = eval_loss(model)
    # A restore loads the same weights on every rank; the replicas must then be rebuilt from them.
    common = make_model()
    with torch.no_grad():
        for p, q in zip(model.parameters(), common.parameters(), strict=True):
            p.copy_(q)
    algo.load_state_dict(algo.state_dict())
    algo.on_forward_start(steps)
    restored_ok = all(
        torch.equal(t, f) for k in ("weight", "left", "right")
        for t, f in zip(algo.replicas[k], algo._buckets.flatten(), strict=True)
    )
    algo.teardown()
    return {
        "start_loss": start, "end_loss": end, "worst_excess": worst_excess,
        "model_equals_replica": model_equals_replica, "replicas": replicas, "neighbours": neighbours,
        "weights": flat_weights(model), "restored_ok": restored_ok,
    }


def low_precision_traces(comm: CommContext, configs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """:func:`low_precision_trace` for several configurations in one launch."""
    return [low_precision_trace(comm, kwargs, steps) for kwargs in configs]


# --- scenarios: async (through the module wrapper, which drives every hook) ------------------------

def _thread_alive() -> bool:
    import threading

    return any(t.name == "bagua-async-model-average" for t in threading.enumerate())


def _wrapped(comm: CommContext, lr: float, **kwargs: Any) -> tuple[Any, Any, torch.optim.Optimizer]:
    from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

    model = make_model()
    algo = get_algorithm_class("async").from_kwargs(**kwargs)
    ddp = BaguaDistributedDataParallel(model, algo, comm, bucket_size=300)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ddp.attach_optimizers([opt])
    return ddp, algo, opt


def _wrapped_step(ddp: Any, opt: torch.optim.Optimizer, rank: int) -> None:
    x, y = shard(rank)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()


def _train_until(algo: Any, ddp: Any, opt: torch.optim.Optimizer, rank: int, rounds: int,
                 deadline_s: float = 60.0, pause_s: float = 0.002) -> None:
    deadline = time.monotonic() + deadline_s
    while algo.averaging_rounds < rounds:
        if time.monotonic() > deadline:
            raise TimeoutError(f"averaging reached {algo.averaging_rounds} rounds, wanted {rounds}")
        _wrapped_step(ddp, opt, rank)
        time.sleep(pause_s * (1 + rank))  # ranks run at different paces


def async_lifecycle(comm: CommContext, warmup_steps: int) -> dict[str, Any]:
    """Warm-up identity, training with background averaging, abort/resume, clean stop."""
    ddp, algo, opt = _wrapped(comm, 0.05, sync_interval_ms=20, warmup_steps=warmup_steps)
    start = eval_loss(ddp.module)
    warm_spread = []
    for _ in range(warmup_steps):
        _wrapped_step(ddp, opt, comm.rank)
        w = flat_weights(ddp.module)
        lo, hi = w.clone(), w.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        warm_spread.append(float((hi - lo).abs().max()))
    thread_during_warmup = _thread_alive()
    _train_until(algo, ddp, opt, comm.rank, rounds=3)
    averaging = algo.is_averaging
    algo.abort(ddp)
    aborted_rounds = algo.averaging_rounds
    for _ in range(5):
        _wrapped_step(ddp, opt, comm.rank)
    after_abort = {"rounds": algo.averaging_rounds, "alive": _thread_alive()}
    algo.resume(ddp)
    _train_until(algo, ddp, opt, comm.rank, rounds=aborted_rounds + 2)
    end = eval_loss(ddp.module)
    if comm.rank == 0:
        ddp(shard(0)[0])  # a forward left without its step (weights lock held): teardown must not hang
    steps = ddp.step
    ddp.teardown()
    algo.teardown()  # idempotent
    return {
        "warm_spread": warm_spread, "thread_during_warmup": thread_during_warmup, "averaging": averaging,
        "aborted_rounds": aborted_rounds, "after_abort": after_abort, "steps": steps,
        "start_loss": start, "end_loss": end, "alive_after_teardown": _thread_alive(),
    }


def async_average_exact(comm: CommContext) -> dict[str, Any]:
    """With no local progress (lr=0), averaging rounds set every rank's weights to the mean over ranks."""
    ddp, algo, opt = _wrapped(comm, 0.0, sync_interval_ms=10)
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.fill_(float(comm.rank + 1))
    _wrapped_step(ddp, opt, comm.rank)  # starts the averaging thread
    deadline = time.monotonic() + 60
    while algo.averaging_rounds < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    ddp.teardown()
    return {"weights": flat_weights(ddp.module), "rounds": algo.averaging_rounds,
            "alive_after_teardown": _thread_alive()}


def async_scenarios(comm: CommContext, warmup_steps: int) -> dict[str, Any]:
    return {"lifecycle": async_lifecycle(comm, warmup_steps), "exact": async_average_exact(comm)}
