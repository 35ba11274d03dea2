"""Rank functions for tests/engine/test_powersgd.py (run by tests/ranks.py's ``run_function`` on Gloo).

Each trains the same seeded regression task with torch's DDP (+ a comm hook) and with the engine's
algorithms through ``BaguaDistributedDataParallel``, and returns what the test asserts: the loss curves,
parameters, replica spread, what ran where.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.algorithms.powersgd import PowerSGDAlgorithm
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
from bagua_lightning.engine.parameters import declare, trainable_parameters
from bagua_lightning.proto.plan import BucketPlan

ONE_BUCKET = 64 << 20  # bytes: the whole model in one bucket, as DDP's 25 MB cap leaves it
SMALL_BUCKET = 4096  # bytes: several buckets
LR = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(16, 1, generator=g)
    out = []
    for s in range(steps):
        gg = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        x = torch.randn(32, 16, generator=gg)
        out.append((x, (x @ teacher).tanh()))
    return out


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def spread(model: nn.Module) -> float:
    values = flat(model)
    lo, hi = values.clone(), values.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float((hi - lo).max())


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]],
          on_step: Callable[[int], None] | None = None) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if on_step is not None:
            on_step(step)
    return losses


def half_hook(dtype: str) -> Callable[..., Any]:
    """torch's bf16/fp16_compress_hook. DDP refuses the bf16 one by name off CUDA/NCCL; Gloo sums bfloat16
    well, so it is called through a function of another name (the hook itself is torch's, unchanged)."""
    hook = default_hooks.bf16_compress_hook if dtype == "bf16" else default_hooks.fp16_compress_hook

    def torch_half_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations as types
        return hook(state, bucket)

    return torch_half_hook


def ddp_run(data: list[tuple[torch.Tensor, torch.Tensor]], hook: str, **state: Any) -> dict[str, Any]:
    """torch's DDP, plain or with one of its comm hooks."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    if hook == "powersgd":
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, **state), powerSGD_hook.powerSGD_hook)
    elif hook in ("bf16", "fp16"):
        ddp.register_comm_hook(None, half_hook(hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = train(ddp, opt, data)
    return {"losses": losses, "params": flat(model)}


def bagua_run(comm: CommContext, data: list[tuple[torch.Tensor, torch.Tensor]], algorithm: str, *,
              bucket_size: int = ONE_BUCKET, replan_at: int | None = None, **kwargs: Any) -> dict[str, Any]:
    model = make_model()
    algo = get_algorithm_class(algorithm).from_kwargs(**kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    wrapper = BaguaDistributedDataParallel(model, algo, comm, bucket_size=bucket_size, optimizers=[opt])

    def on_step(step: int) -> None:
        if step == replan_at:  # one bucket per tensor, registration order: what an autotuner plan may do
            decls = declare(trainable_parameters(model))
            wrapper.driver.apply_plan(BucketPlan(buckets=tuple((d,) for d in decls), bucket_size=1))

    losses = train(wrapper, opt, data, on_step)
    plan = wrapper.bucket_plan
    out = {"losses": losses, "params": flat(model), "spread": spread(model),
           "buckets": len(plan.buckets) if plan else 0}
    wrapper.teardown()
    return out


def anchor(local_size: int) -> dict[str, Any]:
    """powersgd and half_allreduce against DDP + torch's hooks, same task, same settings."""
    comm = CommContext.build(local_size=local_size)
    data = batches(30)
    state = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "min_compression_rate": 2,
             "use_error_feedback": True, "warm_start": True, "random_seed": 0}
    out: dict[str, Any] = {"ddp": ddp_run(data, "plain"), "ddp_powersgd": ddp_run(data, "powersgd", **state)}
    out["powersgd"] = bagua_run(comm, data, "powersgd", **state)
    out["powersgd_rank2"] = bagua_run(comm, data, "powersgd", **{**state, "matrix_approximation_rank": 2})
    out["ddp_powersgd_rank2"] = ddp_run(data, "powersgd", **{**state, "matrix_approximation_rank": 2})
    out["powersgd_buckets"] = bagua_run(comm, data, "powersgd", bucket_size=SMALL_BUCKET, **state)
    out["powersgd_replan"] = bagua_run(comm, data, "powersgd", bucket_size=SMALL_BUCKET, replan_at=10, **state)
    for dtype in ("bf16", "fp16"):
        out[f"ddp_{dtype}"] = ddp_run(data, dtype)
        out[dtype] = bagua_run(comm, data, "half_allreduce", dtype=dtype)
    return out


def hierarchical(local_size: int) -> dict[str, Any]:
    """Two nodes of two ranks: full precision within the node, PowerSGD (half precision) among leaders."""
    comm = CommContext.build(local_size=local_size)
    data = batches(30)
    out: dict[str, Any] = {"ddp": ddp_run(data, "plain"), "hierarchical_possible": comm.is_hierarchical_possible}
    out["powersgd"] = bagua_run(comm, data, "powersgd", start_powerSGD_iter=2, hierarchical=True,
                                bucket_size=SMALL_BUCKET)
    out["half"] = bagua_run(comm, data, "half_allreduce", hierarchical=True, bucket_size=SMALL_BUCKET)
    out["half_flat"] = bagua_run(comm, data, "half_allreduce", bucket_size=SMALL_BUCKET)
    return out


class _ThreadProbe(PowerSGDAlgorithm):
    """powersgd recording which thread each compressed bucket step ran on."""

    threads: list[str]

    def _low_rank_step(self, bucket: Any, group: Any, size: int) -> Any:
        self.threads.append(threading.current_thread().name)
        return super()._low_rank_step(bucket, group, size)


def resume(steps: int, stop_at: int) -> dict[str, Any]:
    """Train ``steps`` straight, and ``stop_at`` + restore from the algorithm's state + the rest: compare."""
    comm = CommContext.build(local_size=dist.get_world_size())
    data = batches(steps)
    kwargs = {"start_powerSGD_iter": 3, "matrix_approximation_rank": 2}

    def run(part: list[tuple[torch.Tensor, torch.Tensor]], weights: dict[str, torch.Tensor] | None,
            state: dict[str, Any] | None) -> tuple[nn.Module, dict[str, Any], list[str], bool]:
        model = make_model()
        if weights is not None:
            model.load_state_dict(weights)
        algo = _ThreadProbe(**kwargs)
        algo.threads = []
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        wrapper = BaguaDistributedDataParallel(model, algo, comm, bucket_size=SMALL_BUCKET, optimizers=[opt])
        if state is not None:
            algo.load_state_dict(state)
        train(wrapper, opt, part)
        saved = algo.state_dict()
        several = len(algo.engine.buckets) > 1
        wrapper.teardown()
        return model, saved, algo.threads, several

    straight, _, threads, several = run(data, None, None)
    first, state, _, _ = run(data[:stop_at], None, None)
    weights = {k: v.clone() for k, v in first.state_dict().items()}
    resumed, _, _, _ = run(data[stop_at:], weights, state)
    return {"diff": float((flat(resumed) - flat(straight)).abs().max()),
            "moved": float((flat(resumed) - flat(first)).abs().max()),
            "iteration": state["iteration"], "errors_by_rank": len(state["errors"]),
            "own_error_norm": float(state["errors"][dist.get_rank()].norm()),
            "threads": sorted(set(threads)), "main_thread": threading.main_thread().name,
            "several_buckets": several}
