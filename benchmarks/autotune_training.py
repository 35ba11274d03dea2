"""Autotuned bucket plans against a sweep of fixed bucket sizes and DDP's default, in one run.

Launch with torchrun (NCCL on GPUs, Gloo on CPU); rank 0 starts an autotune service
process on a free port unless ``--service host:port`` names a running one::

    torchrun --nproc_per_node 4 benchmarks/autotune_training.py                    # ~110M-param transformer
    # on a machine without an editable install: export PYTHONPATH=$(.ci/linktree) first (the service
    # needs grpcio, grpcio-health-checking and grpcio-reflection; no Redis)
    torchrun --nproc_per_node 2 benchmarks/autotune_training.py --model small      # CPU
    python benchmarks/autotune_training.py --netns --model small                   # CPU, 2 hosts at 1 Gbit/s

Phases, every rank in lock-step:

1. **tune**: a fresh model trains for ``--tune-steps`` steps under an
   :class:`~bagua_lightning.engine.autotune.AutotuneController` (reports every
   ``--interval`` steps); *steps until settled* is the step at which the last new plan
   was applied (or the step at which the service reported tuning completed, if later).
2. **interleaved steps**: every variant -- DDP (default 25 MiB buckets), ``gradient_allreduce``
   with fixed bucket sizes ``--sweep`` (MiB), and ``gradient_allreduce`` on the tuned plan --
   trains its own copy of the model (same weights, same batches); each of ``--rounds`` rounds
   runs one step of every variant in a shuffled order (the same on every rank), each step
   timed between device synchronisations (``benchmarks/interleaved.py``). The result is the
   tuned plan's speed against the best sweep point and against DDP,
   ``median(other) / median(tuned)``, with 95 % bootstrap intervals.

``--netns`` (root, iproute2; CPU only) runs the two ranks in two network namespaces joined
by a veth pair shaped to ``--rate``, reusing ``benchmarks/slow_network.py``'s ``two_hosts``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULT_TAG = "AUTOTUNE_TRAINING_RESULT "
SIZES = {  # vocab, width, layers, heads, seq_len
    "100m": (32000, 768, 12, 12, 512),
    "small": (2000, 256, 4, 4, 64),
    "tiny": (500, 64, 2, 4, 32),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SIZES), default="100m")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank per step (0: 16 for 100m, else 8)")
    p.add_argument("--sweep", default="1,4,16,64,256", help="fixed bucket sizes to sweep, MiB")
    p.add_argument("--tune-steps", type=int, default=200, help="steps of the tuning phase")
    p.add_argument("--interval", type=int, default=10, help="autotune_interval, steps")
    p.add_argument("--max-samples", type=int, default=10, help="the service's --max-samples")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--rounds", type=int, default=40, help="timed steps per variant (one per round)")
    p.add_argument("--steps", type=int, default=10, help="steps per variant of the --phases diagnostic")
    p.add_argument("--service", default="", help="host:port of a running service (default: start one)")
    p.add_argument("--netns", action="store_true", help="CPU: two ranks in two shaped network namespaces")
    p.add_argument("--rate", default="1gbit", help="veth rate with --netns (tc syntax)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--phases", action="store_true",
                   help="GPU: print every rank's forward/backward/optimizer ms per variant (diagnostic)")
    args = p.parse_args(argv)
    args.batch = args.batch or (16 if args.model == "100m" else 8)
    return args


# --- one rank -------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(HERE))
    from allreduce_vs_ddp import Transformer  # the same code-built model as the DDP benchmark
    from interleaved import bootstrap_ratio, interleave, slowest_rank

    from bagua_lightning.engine.algorithms.base import get_algorithm_class
    from bagua_lightning.engine.autotune import AutotuneController, AutotuneSettings
    from bagua_lightning.engine.comm import CommContext
    from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

    cuda = torch.cuda.is_available() and not args.netns
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # torchrun sets 1
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_size = 1 if args.netns else int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    comm = CommContext.build(local_size=local_size)
    vocab, width, layers, heads, seq_len = SIZES[args.model]
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, vocab, (args.batch, seq_len + 1), generator=g).to(device) for _ in range(4)]

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Transformer(vocab, width, layers, heads, seq_len).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

    def step(wrapped: nn.Module, opt: torch.optim.Optimizer, i: int, events: list[Any] | None = None) -> None:
        tokens = batches[i % len(batches)]
        if events:
            events[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):  # as allreduce_vs_ddp.py
            logits = wrapped(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        if events:
            events[1].record()
        loss.backward()
        if events:
            events[2].record()
        opt.step()
        if events:
            events[3].record()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def bagua(model: nn.Module, opt: torch.optim.Optimizer, bucket_size: int,
              plan: Any = None) -> BaguaDistributedDataParallel:
        algo = get_algorithm_class("gradient_allreduce").from_kwargs()
        return BaguaDistributedDataParallel(model, algo, comm, bucket_size=bucket_size, plan=plan, optimizers=[opt])

    # -- the service: a process started by rank 0, or the one named
    service_proc = None
    address = args.service
    if not address:
        # In --netns mode the ranks share no loopback: the service listens on rank 0's veth address.
        host = os.environ.get("MASTER_ADDR", "127.0.0.1") if args.netns else "127.0.0.1"
        port = torch.zeros(1, dtype=torch.int64, device=device)
        if rank == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port[0] = sock.getsockname()[1]
            service_proc = subprocess.Popen(
                [sys.executable, "-m", "bagua_lightning.cli", "autotune", "serve", "--host", host,
                 "--port", str(int(port[0])), "--world-size", str(world), "--warmup-time-s", "0",
                 "--sampling-confidence-time-s", "0", "--max-samples", str(args.max_samples)],
                env=dict(os.environ), stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT, start_new_session=True)
        dist.broadcast(port, src=0)
        address = f"{host}:{int(port[0])}"
    try:
        # -- phase 1: tune
        model, opt = make()
        wrapped = bagua(model, opt, 10 * 1024**2)
        settings = AutotuneSettings(address=address, interval=args.interval, rpc_timeout_s=2.0,
                                    connect_timeout_s=30.0, model_name=f"bench-{args.model}-{int(time.time())}")
        ctl = AutotuneController(settings, wrapped.driver, model, model_prefix="Transformer",
                                 nproc_per_node=local_size, device=device, group=comm.group)
        ctl.setup()
        completed_at = None
        t0 = time.monotonic()
        for i in range(args.tune_steps):
            ctl.on_batch_start(i, args.batch)
            if ctl.completed and completed_at is None:
                completed_at = i
            step(wrapped, opt, i)
        sync()
        tune_s = time.monotonic() - t0
        tuned_plan = wrapped.bucket_plan
        assert tuned_plan is not None
        applied = list(ctl.applied)
        ctl.close()
        wrapped.teardown()
        settled = max([applied[-1][0] if applied else 0, completed_at or 0])
        del wrapped, model, opt

        # -- phase 2: timed rounds, every variant on its own copy
        sweep = [int(s) for s in args.sweep.split(",") if s]
        variants: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
        m, o = make()
        variants["ddp"] = (nn.parallel.DistributedDataParallel(m, device_ids=[local_rank] if cuda else None), o)
        for mib in sweep:
            m, o = make()
            variants[f"fixed {mib} MiB"] = (bagua(m, o, mib * 1024**2), o)
        m, o = make()
        variants["autotuned"] = (bagua(m, o, 10 * 1024**2, plan=tuned_plan), o)
        for w, o in variants.values():
            for i in range(args.warmup):
                step(w, o, i)
        counters = dict.fromkeys(variants, args.warmup)

        def one_step(name: str) -> Any:
            def run() -> None:
                w, o = variants[name]
                step(w, o, counters[name])
                counters[name] += 1
            return run
        times = slowest_rank(interleave({name: one_step(name) for name in variants}, args.rounds, sync=sync),
                             device if cuda else None)
        median = {k: statistics.median(v) for k, v in times.items()}  # ms per step
        phases = phase_times(variants, step, args.steps, cuda) if args.phases else {}
        all_phases: list[Any] = [None] * world
        if phases:
            dist.all_gather_object(all_phases, {"phases": phases, "memory": memory_note(cuda)})
        best_fixed = min((k for k in median if k.startswith("fixed")), key=lambda k: median[k])
        vs_best = bootstrap_ratio(times[best_fixed], times["autotuned"])
        vs_ddp = bootstrap_ratio(times["ddp"], times["autotuned"])
        result = {
            "model": args.model, "world_size": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "params": sum(p.numel() for p in make()[0].parameters()), "netns": args.netns, "rate": args.rate,
            "step_ms": median, "samples_per_s": {k: 1000.0 * args.batch * world / v for k, v in median.items()},
            "best_fixed": best_fixed, "rounds": args.rounds,
            "autotuned_vs_best_fixed": vs_best[0], "autotuned_vs_best_fixed_ci95": list(vs_best[1:]),
            "autotuned_vs_ddp": vs_ddp[0], "autotuned_vs_ddp_ci95": list(vs_ddp[1:]),
            "steps_until_settled": settled, "completed_at": completed_at, "tune_steps": args.tune_steps,
            "tune_s": tune_s, "interval": args.interval, "plans_applied": len(applied),
            "tuned_plan": {"buckets": len(tuned_plan.buckets), "bucket_mib": [round(b / 2**20, 2) for b in
                                                                              tuned_plan.bucket_bytes],
                           "hierarchical": tuned_plan.is_hierarchical_reduce, "version": tuned_plan.version},
        }
        timings: dict[str, Any] = {}
        for name, (w, _) in variants.items():
            if isinstance(w, BaguaDistributedDataParallel):
                t = w.last_step_timings()
                plan_now = w.bucket_plan
                timings[name] = None if t is None else {
                    "buckets_in_use": len(plan_now.buckets) if plan_now else None,
                    "backward_ms": round(t.backward_ms, 2),
                    "comm_ms": round(sum(b.comm_ms for b in t.buckets), 2),
                    "exposed_wait_ms": round(max((b.wait_ms for b in t.buckets), default=0.0), 2)}
                w.teardown()
        result["last_step_timings"] = timings
        if phases:
            result["phases_by_rank"] = all_phases
        if rank == 0:
            print(RESULT_TAG + json.dumps(result), flush=True)
            report(result)
    finally:
        if service_proc is not None:
            service_proc.terminate()
            service_proc.wait(timeout=30)
        comm.destroy_groups()
        dist.destroy_process_group()


def phase_times(variants: dict[str, Any], step: Any, steps: int, cuda: bool) -> dict[str, list[float]]:
    """Per variant on this rank: median ms of forward, backward (with its communication) and optimizer.

    Diagnostic (``--phases``): a variant that is slow on one rank only shows up as a long
    phase there and a long backward (waiting for it) on the others.
    """
    import torch

    out: dict[str, list[float]] = {}
    for name, (w, o) in variants.items():
        rows: list[list[Any]] = []
        for i in range(steps):
            ev: list[Any] = [torch.cuda.Event(enable_timing=True) if cuda else _HostEvent() for _ in range(4)]
            step(w, o, i, events=ev)
            rows.append(ev)
        if cuda:
            torch.cuda.synchronize()
        out[name] = [round(statistics.median(r[k].elapsed_time(r[k + 1]) for r in rows), 2) for k in range(3)]
    return out


class _HostEvent:
    """``torch.cuda.Event``'s ``record``/``elapsed_time`` on the host clock (CPU runs)."""

    t = 0.0

    def record(self) -> None:
        self.t = time.monotonic()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1000.0


def memory_note(cuda: bool) -> str:
    import torch

    if not cuda:
        return "cpu"
    stats = torch.cuda.memory_stats()
    return (f"allocated {stats['allocated_bytes.all.current'] / 2**30:.1f} GiB, reserved "
            f"{stats['reserved_bytes.all.current'] / 2**30:.1f} GiB, cudaMalloc retries {stats['num_alloc_retries']}")


def report(result: dict[str, Any]) -> None:
    print(f"\n{result['model']} ({result['params'] / 1e6:.1f}M params), {result['world_size']} ranks on "
          f"{result['device']}{' over netns at ' + result['rate'] if result['netns'] else ''}")
    for name, speed in result["samples_per_s"].items():
        print(f"  {name:>16}: {result['step_ms'][name]:9.2f} ms/step (median of {result['rounds']} interleaved), "
              f"{speed:10.1f} samples/s")
    print(f"  tuned plan: {result['tuned_plan']}")
    for name, t in result.get("last_step_timings", {}).items():
        print(f"  {name:>16}: last measured step {t}")
    for rank, entry in enumerate(result.get("phases_by_rank") or []):
        print(f"  rank {rank}: {entry['memory']}")
        for name, (fwd, bwd, opt) in entry["phases"].items():
            print(f"    {name:>16}: forward {fwd:7.2f} ms, backward+comm {bwd:7.2f} ms, optimizer {opt:6.2f} ms")
    lo, hi = result["autotuned_vs_best_fixed_ci95"]
    print(f"  autotuned speed vs best fixed ({result['best_fixed']}): {result['autotuned_vs_best_fixed']:.3f}x "
          f"[{lo:.3f}, {hi:.3f}]")
    lo, hi = result["autotuned_vs_ddp_ci95"]
    print(f"  autotuned speed vs DDP default: {result['autotuned_vs_ddp']:.3f}x [{lo:.3f}, {hi:.3f}]")
    print(f"  steps until settled: {result['steps_until_settled']} (interval {result['interval']}, "
          f"{result['plans_applied']} plans applied, completed at step {result['completed_at']})")


# --- the --netns driver ---------------------------------------------------------------------------


def drive_netns(args: argparse.Namespace, argv: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    from slow_network import run_on_two_hosts

    outs = run_on_two_hosts([__file__, *argv], args.rate, args.timeout_s, port="29613")
    print("\n".join(line for line in outs[0].splitlines() if not line.startswith(RESULT_TAG)))


def main() -> None:
    argv = sys.argv[1:]
    args = parse(argv)
    if args.netns and "RANK" not in os.environ:
        drive_netns(args, argv)
    else:
        worker(args)


if __name__ == "__main__":
    main()
