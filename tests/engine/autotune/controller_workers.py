"""Worker for tests/engine/autotune/test_controller.py: autotuned training in plain torch loops, one JSON per rank.

Started with torchrun's environment variables (tests/ranks.py:run_ranks). In one
process, against the real autotune service at ``--address``:

1. ``reference``: the same training without autotune (the loss to match);
2. ``tuned``: with an :class:`AutotuneController`; every step's plan (version, fingerprint)
   is recorded. With ``--fault-dir``, rank 0 pauses at two steps for the test to kill,
   then restart, the service (files ``kill``/``killed``, ``restart``/``restarted``);
3. ``bytegrad``: a short tuned run of bytegrad (chunked, padded buckets);
4. ``mismatch``: rank 1 cannot apply the initial plan; every rank must raise PlanMismatchError;
5. ``absent``: against ``--dead-address`` (nothing listens): trains on the default plan.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bagua_lightning.core.errors import PlanMismatchError
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.autotune import AutotuneController, AutotuneSettings
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

LOGGER = "bagua_lightning.engine.autotune"


class Net(nn.Module):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(48, 48), nn.Tanh())],
                                    nn.Linear(48, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Counter(logging.Handler):
    """Counts the autotune logger's warnings (the 'one warning per outage' checks)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(32, 48, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).tanh()


def wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not create {path} within {timeout_s} s")
        time.sleep(0.05)


class FailingTarget:
    """The wrapper's driver, except that applying a plan fails on this rank (a rank that cannot follow the
    others)."""

    def __init__(self, wrapper: BaguaDistributedDataParallel) -> None:
        self.wrapper = wrapper

    @property
    def bucket_plan(self) -> Any:
        return self.wrapper.bucket_plan

    def apply_plan(self, plan: Any) -> None:
        raise RuntimeError("injected: this rank cannot apply the plan")

    def last_step_timings(self) -> Any:
        return self.wrapper.last_step_timings()


def mismatch(comm: CommContext, address: str) -> str:
    """Rank 1 fails to apply the initial plan: every rank must raise PlanMismatchError (not hang)."""
    model = Net()
    wrapper = BaguaDistributedDataParallel(model, get_algorithm_class("gradient_allreduce").from_kwargs(), comm,
                                           bucket_size=4096)
    target = FailingTarget(wrapper) if comm.rank == 1 else wrapper.driver
    ctl = AutotuneController(AutotuneSettings(address=address, interval=3, model_name="mismatch-net"), target,
                             model, model_prefix="Net", nproc_per_node=comm.local_size, group=comm.group)
    try:
        ctl.setup()
    except PlanMismatchError as exc:
        return str(exc)
    finally:
        ctl.close()
        wrapper.teardown()
    return ""


def run(comm: CommContext, steps: int, *, address: str | None, interval: int = 3, fault_dir: Path | None = None,
        fault_steps: tuple[int, int] = (0, 0), model_name: str | None = None,
        algorithm: str = "gradient_allreduce", apply_delay: int | None = None,
        aggregate_reports: bool = True, depth: int = 5,
        after_setup: Callable[[], None] | None = None) -> dict[str, Any]:
    model = Net(depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapper = BaguaDistributedDataParallel(model, get_algorithm_class(algorithm).from_kwargs(), comm,
                                           bucket_size=4096, optimizers=[opt])
    counter = Counter()
    logging.getLogger(LOGGER).addHandler(counter)
    ctl = None
    if address is not None:
        settings = AutotuneSettings(address=address, interval=interval, rpc_timeout_s=0.5, connect_timeout_s=1.0,
                                    model_name=model_name, apply_delay=apply_delay,
                                    aggregate_reports=aggregate_reports)
        ctl = AutotuneController(settings, wrapper.driver, model, model_prefix="Net", nproc_per_node=comm.local_size,
                                 group=comm.group)
    records: list[list[Any]] = []
    losses: list[float] = []
    completed_at = None
    try:
        if ctl is not None:
            ctl.setup()
        if after_setup is not None:
            after_setup()
        for step in range(steps):
            if fault_dir is not None and comm.rank == 0 and step in fault_steps:
                kind = "kill" if step == fault_steps[0] else "restart"
                (fault_dir / kind).touch()
                wait_for(fault_dir / f"{kind}ed")
            if ctl is not None:
                ctl.on_batch_start(step, 32)
                if ctl.completed and completed_at is None:
                    completed_at = step
            plan = wrapper.bucket_plan
            assert plan is not None
            records.append([step, ctl.version if ctl else -1, plan.fingerprint(), len(plan.buckets),
                            plan.is_hierarchical_reduce])
            x, y = batch(step)
            time.sleep(0.02)  # "compute": an interval outlasts a background RPC even on a loaded 2-core VM
            opt.zero_grad()
            loss = nn.functional.mse_loss(wrapper(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        summary = ctl.summary() if ctl else None
    finally:
        if ctl is not None:
            ctl.close()
        wrapper.teardown()
        logging.getLogger(LOGGER).removeHandler(counter)
    return {"losses": losses, "records": records, "warnings": counter.messages, "completed_at": completed_at,
            "applied": ctl.applied if ctl else [], "registered": ctl.registered if ctl else False,
            "summary": summary.line() if summary else "", "speeds": ctl.speeds if ctl else [],
            "threads": sorted(t.name for t in threading.enumerate() if "autotune" in t.name),
            "job_id": ctl.job_id if ctl else "", "model_name": ctl.model_name if ctl else ""}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--address", required=True)
    parser.add_argument("--dead-address", default="")
    parser.add_argument("--local-size", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-dir", default="")
    parser.add_argument("--fault-steps", default="12,24")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    comm = CommContext.build(local_size=args.local_size or dist.get_world_size())
    result: dict[str, Any] = {}
    rc = 0
    try:
        result["reference"] = run(comm, args.steps, address=None)
        kill, restart = (int(s) for s in args.fault_steps.split(","))
        result["tuned"] = run(comm, args.steps, address=args.address,
                              fault_dir=Path(args.fault_dir) if args.fault_dir else None, fault_steps=(kill, restart))
        result["mismatch"] = mismatch(comm, args.address)
        # Plans applied one step after each boundary (apply_delay=1), measured over the rest of the interval.
        result["bytegrad"] = run(comm, 21, address=args.address, model_name="bytegrad-net", algorithm="bytegrad",
                                 apply_delay=1)
        # Bagua's protocol: every rank reports its own measurement.
        # (Another depth: a model shape the service has no completed plan for.)
        result["per_rank"] = run(comm, 12, address=args.address, model_name="per-rank-net", aggregate_reports=False,
                                 depth=4)
        if args.dead_address:
            result["absent"] = run(comm, 12, address=args.dead_address, model_name="absent-net")
    except Exception:
        result["error"] = traceback.format_exc()
        rc = 1
    Path(args.out, f"rank{comm.rank}.json").write_text(json.dumps(result, indent=1))
    comm.destroy_groups()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
