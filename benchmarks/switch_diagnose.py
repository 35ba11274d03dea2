"""Why is a switched model slower than a freshly wrapped one? Facts side by side, one command.

``allreduce_vs_ddp.py --variants gradient_allreduce,bytegrad,auto`` builds the ``auto`` variant by
measuring gradient_allreduce, switching to bytegrad and keeping it. This script builds that model
exactly so (``auto``), next to a model wrapped with bytegrad from the start (``fresh``) and one wrapped
with bytegrad from the start that has trained as many steps as ``auto`` (``fresh_long``), then prints per
model what could make its steps slower on some CPUs and not others:

* subnormal floats (``0 < |x| < finfo.tiny``; Intel cores take microcode assists on them, AMD Zen
  mostly not) in parameters, gradients, the optimizer state, the forward's activations and the
  gradients flowing back through them;
* hooks per parameter (gradient-ready hooks, backward hooks) and on the optimizer;
* gradients and parameters that are views, non-contiguous, or not 64-byte aligned; distinct gradient
  storages and their total size;
* the process: live threads, Python objects;
* forward / backward / optimizer milliseconds per step (median of ``--rounds`` interleaved steps), once
  as is and once with ``torch.set_flush_denormal(True)``.

Two Gloo ranks on loopback (one intra-op thread each, as ``--netns`` runs), no Redis, no root::

    PYTHONPATH=$(.ci/linktree) python benchmarks/switch_diagnose.py              # the 'wide' transformer
    PYTHONPATH=$(.ci/linktree) python benchmarks/switch_diagnose.py --netns      # two namespaces at 1 Gbit/s (root)

``--embed-std 1`` rebuilds the transformer with nn.Embedding's default init (what the benchmark used
before 2026-11-26): its tied logits have a std of ~16, their softmax underflows into subnormal floats
after ~20 training steps, and ``auto`` (26 steps further into training than ``fresh``) carries them.
Exits 0 after printing rank 0's table (rank 1's facts are printed too where they differ).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TAG = "SWITCH_DIAGNOSE "


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- facts ------------------------------------------------------------------------------------------

def subnormals(t: Any) -> int:
    """How many elements of the floating tensor ``t`` are subnormal (0 < |x| < smallest normal)."""
    import torch

    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return 0
    a = t.detach().abs()
    return int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())


def _storage(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


def static_facts(runner: Any) -> dict[str, Any]:
    """Facts readable without running a step: state, hooks, layouts."""
    import torch

    model = runner.model.module
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in runner.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    storages = {_storage(g): g.untyped_storage().nbytes() for g in grads}
    return {
        "steps": runner.i,
        "sub_param": sum(subnormals(p) for p in params),
        "sub_grad": sum(subnormals(g) for g in grads),
        "sub_optstate": sum(subnormals(v) for v in state),
        "grad_hooks": sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in params),
        "bw_hooks": sum(len(getattr(p, "_backward_hooks", None) or {}) for p in params),
        "opt_hooks": len(getattr(runner.opt, "_optimizer_step_post_hooks", {})),
        "grad_views": sum(g._base is not None for g in grads),
        "grad_noncontig": sum(not g.is_contiguous() for g in grads),
        "grad_unaligned": sum(g.data_ptr() % 64 != 0 for g in grads),
        "grad_storages": len(storages),
        "grad_storage_mb": round(sum(storages.values()) / 2**20, 1),
        "param_views": sum(p._base is not None for p in params),
        "param_unaligned": sum(p.data_ptr() % 64 != 0 for p in params),
        "state_unaligned": sum(v.data_ptr() % 64 != 0 for v in state),
        "algorithm": type(runner.model.algorithm).__name__.removesuffix("Algorithm"),
    }


def activation_facts(runner: Any) -> dict[str, int]:
    """Subnormals in every module's outputs and in the gradients flowing back into them, for one step."""
    import torch

    counts = {"sub_act": 0, "sub_act_grad": 0, "act_elems": 0}

    def on_grad(g: torch.Tensor) -> None:
        counts["sub_act_grad"] += subnormals(g)

    def on_forward(module: Any, inputs: Any, out: Any) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                counts["sub_act"] += subnormals(t)
                counts["act_elems"] += t.numel()
                if t.requires_grad:
                    t.register_hook(on_grad)

    handles = [m.register_forward_hook(on_forward) for m in runner.model.module.modules()]
    try:
        runner.step()
    finally:
        for h in handles:
            h.remove()
    return counts


def timed_step(runner: Any) -> tuple[float, float, float]:
    """One training step of ``runner`` as allreduce_vs_ddp.py takes it: (forward, backward, optimizer) ms."""
    import torch
    from torch import nn

    x, y = runner.batches[runner.i % len(runner.batches)]
    runner.i += 1
    t0 = time.perf_counter()
    logits = runner.model(x)
    if logits.dim() == 3:
        logits = logits.flatten(0, 1)
    loss = nn.functional.cross_entropy(logits.float(), y.flatten())
    t1 = time.perf_counter()
    runner.opt.zero_grad(set_to_none=True)
    loss.backward()
    t2 = time.perf_counter()
    runner.opt.step()
    t3 = time.perf_counter()
    del torch
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def timings(runners: dict[str, Any], rounds: int, seed: int) -> dict[str, dict[str, float]]:
    """Median forward/backward/optimizer ms per runner, steps interleaved in a per-round shuffled order."""
    import random

    rng = random.Random(seed)
    names = list(runners)
    samples: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for n in names:
            samples[n].append(timed_step(runners[n]))
    return {n: {part: round(statistics.median(s[i] for s in samples[n]), 1)
                for i, part in enumerate(("fwd_ms", "bwd_ms", "opt_ms"))} for n in samples}


# --- one rank ---------------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from allreduce_vs_ddp import Runner, make_batches  # the benchmark's own variants, batches and step

    from bagua_lightning.engine.comm import CommContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = CommContext.build(local_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    bench = argparse.Namespace(model=args.model, seq_len=32, batch_size=args.batch_size,
                               bucket_size=10 * 1024**2, warmup=5, embed_std=args.embed_std)
    batches = make_batches(bench, torch.device("cpu"), torch.Generator().manual_seed(1 + comm.rank))
    runners = {"fresh": Runner("bytegrad", bench, torch.device("cpu"), comm, batches),
               "auto": Runner("auto", bench, torch.device("cpu"), comm, batches),
               "fresh_long": Runner("bytegrad", bench, torch.device("cpu"), comm, batches)}
    long = runners["fresh_long"]
    while long.i < runners["auto"].i:
        long.step()
    facts: dict[str, dict[str, Any]] = {n: static_facts(r) for n, r in runners.items()}
    for n, r in runners.items():
        facts[n].update(activation_facts(r))
        facts[n].update({"threads": threading.active_count(), "gc_objects": len(gc.get_objects())})
    for n, t in timings(runners, args.rounds, seed=1).items():
        facts[n].update(t)
    torch.set_flush_denormal(True)
    for n, t in timings(runners, args.rounds, seed=2).items():
        facts[n].update({f"ftz_{k}": v for k, v in t.items()})
    torch.set_flush_denormal(False)
    for n, r in runners.items():
        facts[n]["grad_hooks_end"] = static_facts(r)["grad_hooks"]
        r.close()
    print(TAG + json.dumps({"rank": comm.rank, "facts": facts}), flush=True)
    comm.destroy_groups()
    dist.destroy_process_group()


def table(facts: dict[str, dict[str, Any]], other: dict[str, dict[str, Any]] | None) -> str:
    names = list(facts)
    keys = list(facts[names[0]])
    lines = [f"{'fact':<18}" + "".join(f"{n:>18}" for n in names)]
    for k in keys:
        row = f"{k:<18}" + "".join(f"{facts[n].get(k)!s:>18}" for n in names)
        if other and any(other[n].get(k) != facts[n].get(k) for n in names) and not k.endswith("_ms") \
                and k not in ("gc_objects",):
            row += "   rank 1: " + ", ".join(str(other[n].get(k)) for n in names)
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wide", help="an allreduce_vs_ddp.py --model (default wide)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8, help="interleaved timed steps per model, each pass")
    p.add_argument("--embed-std", type=float, default=0.02,
                   help="transformer embedding init std (1.0: nn.Embedding's default, the init before 2026-11-26)")
    p.add_argument("--netns", action="store_true", help="two network namespaces joined at --rate (root)")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    argv = [str(Path(__file__).resolve()), "--worker", "--model", args.model, "--batch-size", str(args.batch_size),
            "--rounds", str(args.rounds), "--embed-std", str(args.embed_std)]
    if args.netns:
        from slow_network import run_on_two_hosts

        outputs = run_on_two_hosts(argv, args.rate, 1800, port=str(_free_port()))
    else:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = [subprocess.Popen([sys.executable, *argv], env=dict(env, RANK=str(r), LOCAL_RANK="0"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        try:
            outputs = [pr.communicate(timeout=1800)[0] for pr in procs]
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait(timeout=10)
        for r, (pr, out) in enumerate(zip(procs, outputs, strict=True)):
            if pr.returncode != 0:
                raise SystemExit(f"rank {r} failed (exit {pr.returncode}):\n{out[-4000:]}")
    results = []
    for out in outputs:
        line = next((ln for ln in out.splitlines() if ln.startswith(TAG)), None)
        if line is None:
            raise SystemExit(f"a rank printed no facts:\n{out[-4000:]}")
        results.append(json.loads(line[len(TAG):]))
    results.sort(key=lambda r: r["rank"])
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"model {args.model}, 2 Gloo ranks ({'namespaces at ' + args.rate if args.netns else 'loopback'}), "
          f"{os.cpu_count()} x {cpu}; fresh = bytegrad from the start, auto = gradient_allreduce then "
          "bytegrad (allreduce_vs_ddp's auto), fresh_long = fresh trained as many steps as auto")
    facts = results[0]["facts"]
    print(table(facts, results[1]["facts"] if len(results) > 1 else None))
    for name, f in facts.items():
        found = [k for k in ("sub_param", "sub_grad", "sub_optstate", "sub_act", "sub_act_grad") if f[k]]
        if found:
            print(f"{name}: subnormal floats in {', '.join(found)}; where a CPU is slow on them (Intel without "
                  f"flush-to-zero) its steps slow down: compare ftz_*_ms (torch.set_flush_denormal(True)) with *_ms")
    hooks = {f["grad_hooks"] for f in facts.values()} | {f["grad_hooks_end"] for f in facts.values()}
    if len(hooks) > 1:
        print(f"hook counts differ between models or over steps: {sorted(hooks)}")


if __name__ == "__main__":
    main()
