"""Worker for tests/engine/test_gradient_algorithms.py: run under torchrun, one JSON per rank.

``python -m torch.distributed.run --nproc_per_node N gradient_workers.py OUT_DIR [--local-size L]
[--backend gloo|nccl]`` runs every scenario and writes ``OUT_DIR/rank{r}.json`` with the
measured values; the test asserts on them. Plain torch (no Lightning): fast to start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.compressed_comm import compressed_all_reduce_
from bagua_lightning.engine.compression import max_quantisation_error
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
from bagua_lightning.engine.parameters import declare, trainable_parameters
from bagua_lightning.proto.plan import BucketPlan

SMALL_BUCKET = 2048  # bytes: several buckets on the test model


def make_model(device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed + 1234 * dist.get_rank())  # different per rank: the wrapper must broadcast
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)


def batches(device: torch.device, steps: int, per_step: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    w_true = torch.randn(8, 1, generator=g)
    out = []
    for s in range(steps):
        micro = []
        for m in range(per_step):
            gg = torch.Generator().manual_seed(1000 * s + 10 * m + dist.get_rank())
            x = torch.randn(16, 8, generator=gg)
            micro.append((x.to(device), (x @ w_true).tanh().to(device)))
        out.append(micro)
    return out


def params_spread(module: nn.Module) -> float:
    """Largest difference of any parameter between ranks (0 when replicas are identical)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float((hi - lo).abs().max())


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    *,
    no_sync: Callable[[], Any] | None = None,
    set_to_none: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    losses = []
    for step, micro in enumerate(data):
        opt.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for m, (x, y) in enumerate(micro):
            last = m == len(micro) - 1
            ctx = no_sync() if (no_sync is not None and not last) else _null()
            with ctx:
                loss = nn.functional.mse_loss(model(x), y) / len(micro)
                loss.backward()
            total += float(loss)
        opt.step()
        losses.append(total)
        if on_step:
            on_step(step)
    return losses


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def reference_ddp(device: torch.device, data: list[Any], lr: float) -> list[torch.Tensor]:
    model = make_model(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    snaps: list[torch.Tensor] = []

    def snap(step: int) -> None:
        snaps.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))

    train(ddp, opt, data, no_sync=ddp.no_sync, on_step=snap)
    return snaps


def bagua_run(
    comm: CommContext, device: torch.device, data: list[Any], lr: float, *, algorithm: str, flatten: bool,
    set_to_none: bool = True, apply_plan_at: int | None = None, **kwargs: Any,
) -> dict[str, Any]:
    model = make_model(device)
    algo = get_algorithm_class(algorithm).from_kwargs(**kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    wrapper = BaguaDistributedDataParallel(model, algo, comm, flatten=flatten, bucket_size=SMALL_BUCKET,
                                           optimizers=[opt])
    snaps: list[torch.Tensor] = []
    info: dict[str, Any] = {"plans": []}

    def on_step(step: int) -> None:
        snaps.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        plan = wrapper.bucket_plan
        assert plan is not None
        info["plans"].append(len(plan.buckets))
        if apply_plan_at is not None and step == apply_plan_at:
            # One bucket per tensor, registration order: a very different partition.
            decls = declare(trainable_parameters(model))
            wrapper.driver.apply_plan(BucketPlan(buckets=tuple((d,) for d in decls), bucket_size=1))

    losses = train(wrapper, opt, data, no_sync=wrapper.no_sync, set_to_none=set_to_none, on_step=on_step)
    timings = wrapper.last_step_timings()
    plan = wrapper.bucket_plan
    assert plan is not None
    info.update(
        losses=losses,
        snaps=snaps,
        spread=params_spread(model),
        steps=wrapper.step,
        timing_buckets=len(timings.buckets) if timings else -1,
        timing_bytes=sum(b.bytes for b in timings.buckets) if timings else -1,
        timing_ok=bool(timings) and all(b.comm_ms >= 0 and b.wait_ms >= 0 and b.ready_ms >= 0
                                        for b in timings.buckets),
        plan_buckets=len(plan.buckets),
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        grads_are_views=flatten and all(
            p.grad is not None and p.grad.data_ptr() == v.data_ptr()
            for p, v in zip(model.parameters(), _views(wrapper, model), strict=True)
        ),
    )
    wrapper.teardown()
    return info


def _views(wrapper: BaguaDistributedDataParallel, model: nn.Module) -> list[torch.Tensor]:
    engine = wrapper.algorithm.engine  # type: ignore[attr-defined]
    by_name = engine.views_by_name()
    return [by_name[n] for n, _ in model.named_parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def scenario_allreduce(comm: CommContext, device: torch.device, hierarchical: bool) -> dict[str, Any]:
    lr = 0.05
    data = batches(device, 6, per_step=2)  # two micro-batches: no_sync on the first
    ref = reference_ddp(device, data, lr)
    out: dict[str, Any] = {}
    for name, kw in {
        "flat": {"flatten": True},
        "noflat": {"flatten": False},
        "keepgrads": {"flatten": True, "set_to_none": False},
        "replan": {"flatten": True, "apply_plan_at": 2},
    }.items():
        run = bagua_run(comm, device, data, lr, algorithm="gradient_allreduce", hierarchical=hierarchical, **kw)
        out[name] = {
            "diff_vs_ddp": max_diff(run["snaps"], ref),
            "spread": run["spread"],
            "steps": run["steps"],
            "timing_buckets": run["timing_buckets"],
            "timing_bytes": run["timing_bytes"],
            "timing_ok": run["timing_ok"],
            "plan_buckets": run["plan_buckets"],
            "plans": run["plans"],
            "param_bytes": run["param_bytes"],
            "grads_are_views": run["grads_are_views"],
        }
    # average=False sums: one step of SGD moves world_size times further than DDP's mean.
    run = bagua_run(comm, device, data[:1], lr / comm.world_size, algorithm="gradient_allreduce",
                    flatten=True, average=False, hierarchical=hierarchical)
    out["sum"] = {"diff_vs_ddp": max_diff(run["snaps"], ref[:1])}
    return out


def scenario_bytegrad(comm: CommContext, device: torch.device, hierarchical: bool) -> dict[str, Any]:
    # Compression error of one exchange against the exact mean.
    torch.manual_seed(99 + comm.rank)
    n = 4096
    x = (torch.randn(n) * torch.linspace(0.1, 3, n)).to(device)
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= comm.world_size
    y = x.clone()
    compressed_all_reduce_(y, comm, average=True, hierarchical=hierarchical)
    err = (y - exact).abs().max()
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    # Bound: first quantisation of every contribution (chunked by the exchange size), then of the sum.
    parts = comm.num_nodes if hierarchical and comm.is_hierarchical_possible else comm.world_size
    local = torch.tensor([max_quantisation_error(x, parts)], device=device)
    if hierarchical and comm.is_hierarchical_possible:
        # Leaders quantise a node's sum: its width is at most local_size times the widest contribution.
        local *= comm.local_size
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    bound = float(local) + max_quantisation_error(exact, parts) + float(local) / 255 + 1e-6
    same = y.clone()
    dist.broadcast(same, src=0)
    lr = 0.05
    data = batches(device, 30)
    run = bagua_run(comm, device, data, lr, algorithm="bytegrad", flatten=True, hierarchical=hierarchical)
    return {
        "err": float(err),
        "bound": bound,
        "identical_result": bool(torch.equal(same, y)),
        "loss_first": run["losses"][0],
        "loss_last": sum(run["losses"][-5:]) / 5,
        "spread": run["spread"],
        "timing_buckets": run["timing_buckets"],
    }


def scenario_qadam(comm: CommContext, device: torch.device, hierarchical: bool) -> dict[str, Any]:
    model = make_model(device)
    errors = []
    algo = QAdamAlgorithm(hierarchical=hierarchical)
    wrapper = BaguaDistributedDataParallel(model, algo, comm, bucket_size=SMALL_BUCKET)
    for bad in ([torch.optim.Adam(model.parameters())],
                [QAdamOptimizer(model.parameters()), QAdamOptimizer(model.parameters())]):
        try:
            wrapper.attach_optimizers(bad)
        except ConfigurationError as exc:
            errors.append(str(exc))
    opt = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=5)
    wrapper.attach_optimizers([opt])
    data = batches(device, 40)
    spreads = []
    losses = train(wrapper, opt, data, on_step=lambda s: spreads.append(params_spread(model)) if s in (3, 39) else None)
    exp_avg_are_views = all(
        opt.state[p]["exp_avg"].data_ptr() == algo._momentum_engine.view(p).data_ptr()  # type: ignore[union-attr]
        for p in model.parameters()
    )
    wrapper.teardown()
    return {
        "errors": errors,
        "loss_first": losses[0],
        "loss_last": sum(losses[-5:]) / 5,
        "spread_warmup": spreads[0],
        "spread_end": spreads[1],
        "completed_steps": opt.completed_steps,
        "exp_avg_are_views": exp_avg_are_views,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--local-size", type=int, default=0)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--scenarios", default="allreduce,bytegrad,qadam")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    comm = CommContext.build(local_size=args.local_size or dist.get_world_size())
    hierarchical = comm.is_hierarchical_possible
    result: dict[str, Any] = {"world_size": comm.world_size, "hierarchical": hierarchical}
    rc = 0
    try:
        for name in args.scenarios.split(","):
            fn = {"allreduce": scenario_allreduce, "bytegrad": scenario_bytegrad, "qadam": scenario_qadam}[name]
            result[name] = fn(comm, device, hierarchical)
    except Exception:
        result["error"] = traceback.format_exc()
        rc = 1
    Path(args.out, f"rank{comm.rank}.json").write_text(json.dumps(result, indent=1))
    comm.destroy_groups()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
