"""Gradient compressors side by side on a slow link: torch's DDP hooks against the engine's algorithms, one run.

Two CPU ranks in the two network namespaces of ``slow_network.py`` (a veth pair shaped with ``tc``, root and
iproute2 needed; the namespaces are always deleted)::

    python benchmarks/compressors.py --rate 1gbit
    python benchmarks/compressors.py --rate 100mbit --rounds 12

Variants (each its own copy of the same MLP, same weights, same batches, SGD):

* ``ddp``: torch's DDP (the baseline); ``ddp+powersgd_hook``: DDP with torch's ``powerSGD_hook``;
  ``ddp+bf16_hook``: DDP with torch's ``bf16_compress_hook`` (DDP refuses that hook by name off CUDA, so it is
  called through a function of another name; Gloo sums bfloat16);
* ``gradient_allreduce``, ``bytegrad``, ``half_allreduce`` (bf16), ``powersgd``: the engine's algorithms through
  ``BaguaDistributedDataParallel``;
* ``auto``: the registered ``auto`` over gradient_allreduce, bytegrad, half_allreduce and powersgd, choosing
  during untimed interleaved rounds of every variant (``allreduce_vs_ddp.select``), then timed like the others.

PowerSGD runs with the same settings on both sides: rank ``--rank``, error feedback, warm start,
``start_powerSGD_iter`` 10, ``min_compression_rate`` 2; every variant is past step 10 before the timed rounds.
Timing: ``benchmarks/interleaved.py`` (one step of every variant per round, shuffled, the slowest rank's time);
speed = median(baseline) / median(variant) with a 95 % bootstrap interval, against DDP and against the
hook of the same kind. The link limit of a variant is the bytes each rank sends per step (ring allreduce:
2(n-1)/n of the buffer; bytegrad's reduce-scatter + all-gather of uint8 chunks alike) at the link rate;
``limit / step`` is how close the variant runs to it (1.0: the wire alone sets its pace). ``local`` is the same
step with no communication (one rank's own model): a variant's floor is ``max(limit, local)``, the wire and the
compute perfectly overlapped, and ``floor / step`` is how close it comes to that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce_vs_ddp import select  # sibling modules of the benchmarks
from interleaved import interleave, slowest_rank, speeds
from slow_network import run_on_two_hosts

from bagua_lightning.engine.algorithms.auto import AutoAlgorithm
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.algorithms.powersgd import should_compress
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

VARIANTS = ("ddp", "ddp+powersgd_hook", "ddp+bf16_hook", "gradient_allreduce", "bytegrad", "half_allreduce",
            "powersgd", "auto", "local")
LOCAL = "local"  # the same step with no communication: the compute floor
AUTO_CANDIDATES = ["gradient_allreduce", "bytegrad", "half_allreduce", "powersgd"]
START_ITER = 10
RATES = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}  # tc's suffixes, bits per second


def bits_per_second(rate: str) -> float:
    for suffix, scale in RATES.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise SystemExit(f"--rate {rate!r}: give a tc rate such as 1gbit or 100mbit")


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(args.layers):
        layers += [nn.Linear(args.width, args.width)] + ([nn.ReLU()] if i < args.layers - 1 else [])
    return nn.Sequential(*layers)


def wire_bytes(variant: str, model: nn.Module, world: int, rank: int) -> float:
    """Bytes each rank sends per step (ring collectives: 2(n-1)/n of what is reduced)."""
    ring = 2 * (world - 1) / world
    numel = sum(p.numel() for p in model.parameters())
    if variant in ("ddp", "gradient_allreduce"):
        return ring * 4 * numel
    if variant in ("ddp+bf16_hook", "half_allreduce"):
        return ring * 2 * numel
    if variant == "bytegrad":
        return ring * numel  # uint8 chunks (headers of 8 bytes per chunk left out)
    low_rank = 0
    for p in model.parameters():
        m = p.detach().reshape(p.shape[0], -1)
        rows, cols = m.shape
        r = min(rows, cols, rank)
        low_rank += (rows + cols) * r if should_compress(rows, cols, r, 2) else m.numel()
    return ring * 4 * low_rank


def torch_hook(name: str, rank: int) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd_hook":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=START_ITER, min_compression_rate=2)
        return state, powerSGD_hook.powerSGD_hook

    # No annotations: DDP checks them as types, and this module's are strings.
    def torch_bf16_hook(state, bucket):
        return default_hooks.bf16_compress_hook(state, bucket)

    return None, torch_bf16_hook


class Runner:
    """One variant: its model copy, optimizer and wrapper; ``auto`` as ``allreduce_vs_ddp.select`` expects."""

    def __init__(self, variant: str, args: argparse.Namespace, comm: CommContext,
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.variant, self.batches, self.i = variant, batches, 0
        model = make_model(args)
        self.model: nn.Module
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.auto: AutoAlgorithm | None = None
        if variant == LOCAL:
            self.model = model
        elif variant.startswith("ddp"):
            # torch's powerSGD_hook issues a bucket's second and third allreduces from the callbacks of its first
            # (Gloo's threads) while autograd issues the next bucket's: with two buckets the ranks met them in
            # different orders here (Gloo: "Received data size doesn't match"), so the hook gets one bucket.
            cap = 1024.0 if variant == "ddp+powersgd_hook" else args.bucket_mb
            self.model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
            if "+" in variant:
                self.model.register_comm_hook(*torch_hook(variant.partition("+")[2], args.rank))
        else:
            algo: Any
            if variant == "auto":
                algo = self.auto = AutoAlgorithm(candidates=AUTO_CANDIDATES, warmup_steps=args.auto_warmup,
                                                 trial_steps=args.auto_trials, max_runoffs=args.auto_max_runoffs)
            elif variant == "powersgd":
                algo = get_algorithm_class(variant).from_kwargs(matrix_approximation_rank=args.rank,
                                                                start_powerSGD_iter=START_ITER)
            else:
                algo = get_algorithm_class(variant).from_kwargs()
            self.model = BaguaDistributedDataParallel(model, algo, comm, bucket_size=int(args.bucket_mb * 2**20),
                                                      optimizers=[self.opt])

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def close(self) -> None:
        if isinstance(self.model, BaguaDistributedDataParallel):
            self.model.teardown()


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = CommContext.build(local_size=1)  # each namespace is a host: two nodes of one rank
    g = torch.Generator().manual_seed(1 + comm.rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randint(args.width, (args.batch,), generator=g))
               for _ in range(4)]
    runners = [Runner(v, args, comm, batches) for v in args.variants]
    interleave({r.variant: r.step for r in runners}, args.warmup, seed=args.seed + 1)  # untimed
    select(runners, torch.device("cpu"), args.seed)  # type: ignore[arg-type]
    most = max(r.i for r in runners)
    for r in runners:  # the same progress for all (past start_powerSGD_iter) before timing
        while r.i < most:
            r.step()
    own = interleave({r.variant: r.step for r in runners}, args.rounds, seed=args.seed)
    times = slowest_rank(own)
    chosen = next((r.auto.selection for r in runners if r.auto is not None), None)
    model = make_model(args)
    for r in runners:
        r.close()
    if comm.rank == 0:
        rate = bits_per_second(args.rate)
        limits = {v: wire_bytes(v, model, comm.world_size, args.rank) * 8 / rate * 1000 for v in times
                  if v not in ("auto", LOCAL)}
        if chosen is not None and chosen.chosen is not None and "auto" in times:
            limits["auto"] = limits.get(chosen.chosen, wire_bytes(chosen.chosen, model, comm.world_size, args.rank)
                                        * 8 / rate * 1000)
        result: dict[str, Any] = {"rate": args.rate, "params": sum(p.numel() for p in model.parameters()),
                                  "rounds": args.rounds, "variants": {}, "auto": chosen.line() if chosen else None}
        baselines = {}
        if "ddp" in times:
            baselines["ddp"] = "ddp"
        if "ddp+powersgd_hook" in times:
            baselines["powersgd_hook"] = "ddp+powersgd_hook"
        if "ddp+bf16_hook" in times:
            baselines["bf16_hook"] = "ddp+bf16_hook"
        against = {key: {s.variant: s for s in speeds(times, base)} for key, base in baselines.items()}
        compute = statistics.median(times[LOCAL]) if LOCAL in times else 0.0
        for v in times:
            median = statistics.median(times[v])
            entry: dict[str, Any] = {"median_ms": median, "step_ms": times[v], "limit_ms": limits.get(v),
                                     "limit_ratio": limits[v] / median if v in limits else None,
                                     # the wire and the compute perfectly overlapped: the best a step can be
                                     "floor_ms": max(limits[v], compute) if v in limits else None,
                                     "floor_ratio": max(limits[v], compute) / median if v in limits else None}
            for key, table in against.items():
                s = table[v]
                entry[f"vs_{key}"] = {"ratio": s.ratio, "ci95": [s.low, s.high]}
            result["variants"][v] = entry
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    comm.destroy_groups()
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> None:
    print(f"link {result['rate']}, MLP of {result['params'] / 1e6:.1f}M parameters, {result['rounds']} interleaved "
          "steps per variant, slowest rank's step; ratio = median(baseline) / median(variant) [95 % interval]")
    keys = [k for k in ("ddp", "powersgd_hook", "bf16_hook") if f"vs_{k}" in next(iter(result["variants"].values()))]
    print(f"{'variant':<20}{'step ms':>9}" + "".join(f"{'vs ' + k:>26}" for k in keys)
          + f"{'limit ms':>10}{'limit/step':>11}{'floor/step':>11}")
    for v, e in result["variants"].items():
        cols = "".join(f"{e[f'vs_{k}']['ratio']:>8.2f}x [{e[f'vs_{k}']['ci95'][0]:.2f}, {e[f'vs_{k}']['ci95'][1]:.2f}]"
                       .rjust(26) for k in keys)
        limit = (f"{e['limit_ms']:>10.1f}{e['limit_ratio']:>11.2f}{e['floor_ratio']:>11.2f}"
                 if e["limit_ms"] is not None else "")
        print(f"{v:<20}{e['median_ms']:>9.1f}{cols}{limit}")
    if result.get("auto"):
        print(result["auto"])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rate", default="1gbit", help="tc rate of each veth end (default 1gbit)")
    p.add_argument("--width", type=int, default=1024, help="width of the Linear layers")
    p.add_argument("--layers", type=int, default=4, help="Linear(width, width) layers")
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--rank", type=int, default=1, help="PowerSGD's matrix_approximation_rank (both sides)")
    p.add_argument("--bucket-mb", type=float, default=10.0, help="bucket size of every variant, MiB")
    p.add_argument("--warmup", type=int, default=3, help="untimed interleaved rounds first")
    p.add_argument("--rounds", type=int, default=30, help="timed steps per variant (one per round)")
    p.add_argument("--auto-warmup", type=int, default=1, help="auto: untimed steps after each switch")
    p.add_argument("--auto-trials", type=int, default=4, help="auto: timed steps per candidate")
    p.add_argument("--auto-max-runoffs", type=int, default=1, help="auto: at most this many runoffs")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle (same on every rank)")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    forwarded = list(argv if argv is not None else sys.argv[1:])  # the workers write no JSON
    load = os.getloadavg()[0]
    outputs = run_on_two_hosts([os.path.abspath(__file__), "--worker", *forwarded], args.rate, args.timeout_s,
                               port="29623")
    line = next((x for x in outputs[0].splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"rank 0 printed no result:\n{outputs[0][-4000:]}")
    result = json.loads(line[len("RESULT "):])
    result["load_avg_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    report(result)
    print(f"1-min load average before/after: {result['load_avg_1min']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
