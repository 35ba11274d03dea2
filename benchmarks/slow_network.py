"""Step time of Bagua's algorithms on a slow (1 Gbit/s) link between two hosts, in one run (CPU, Gloo).

Needs root and ``ip``/``tc``. The script builds two network namespaces joined by a
veth pair (10.123.0.1/24 <-> 10.123.0.2/24), shapes both ends to ``--rate`` with
``tc`` (token bucket), starts one Gloo rank in each namespace, and always deletes the namespaces at
the end (also on failure or Ctrl-C)::

    python benchmarks/slow_network.py                      # 1 Gbit/s, 12.6M-parameter MLP (50 MB fp32)
    python benchmarks/slow_network.py --rate 100mbit --steps 3

The model is communication-bound on purpose: a few large ``Linear`` layers and a
small batch (at 1 Gbit/s ``gradient_allreduce`` spends ~85-90% of its step on the
wire; the printed breakdown shows it). Every algorithm trains a fresh copy of it
(same weights, same batches, SGD) through
:class:`~bagua_lightning.engine.ddp.BaguaDistributedDataParallel`; they take turns
for ``--rounds`` rounds so machine drift hits all alike. The median step time of each
is printed with its speed-up over ``gradient_allreduce``, and the median split of a
step into forward, backward (gradient algorithms wait for their buckets at its end)
and optimizer step (weight algorithms communicate after it), next to the same step
with no communication at all.

Each rank runs with one intra-op thread: a rank stands for a host, and two hosts
share this machine's cores; more threads per rank would only make the ranks (and
their communication threads) fight over the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

ALGORITHMS = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized")
ADDRESSES = ("10.123.0.1", "10.123.0.2")  # only inside the namespaces this script creates
PREFIX_LEN = 24
RESULT_TAG = "SLOW_NETWORK_RESULT "
LOCAL = "no communication"  # the same step on one rank's own model: the compute part of a step
PARTS = ("forward", "backward", "optimizer")


# --- the two "hosts" ------------------------------------------------------------------------------

def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


@contextlib.contextmanager
def two_hosts(rate: str) -> Iterator[tuple[list[str], list[str]]]:
    """Two namespaces joined by a shaped veth pair; yields (namespace names, veth names). Always removed."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("slow_network.py needs root and the `ip` and `tc` tools (iproute2)")
    tag = f"{os.getpid() % 100000}"
    namespaces = [f"blslow{tag}a", f"blslow{tag}b"]
    veths = [f"blv{tag}a", f"blv{tag}b"]
    try:
        for ns in namespaces:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for ns, veth, addr in zip(namespaces, veths, ADDRESSES, strict=True):
            _sh("ip", "link", "set", veth, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", veth)
            _sh("ip", "-n", ns, "link", "set", veth, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # A token bucket shapes egress to `rate`; the burst covers one GSO segment (64 KiB) with room.
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf",
                "rate", rate, "burst", "256kb", "latency", "50ms")
        yield namespaces, veths
    finally:
        for ns in namespaces:
            _sh("ip", "netns", "del", ns, check=False)  # also removes the veth pair
        _sh("ip", "link", "del", veths[0], check=False)


def run_on_two_hosts(command: Sequence[str], rate: str, timeout_s: float, port: str = "29611") -> list[str]:
    """Run ``command`` (a Python script and its arguments) once in each of :func:`two_hosts`' namespaces as
    ranks 0 and 1 of a Gloo job over the shaped veth pair; return their outputs (SystemExit if one fails)."""
    with two_hosts(rate) as (namespaces, veths):
        procs: list[subprocess.Popen[str]] = []
        try:
            for rank, (ns, veth) in enumerate(zip(namespaces, veths, strict=True)):
                env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
                env.update(MASTER_ADDR=ADDRESSES[0], MASTER_PORT=port, RANK=str(rank), LOCAL_RANK="0",
                           WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GLOO_SOCKET_IFNAME=veth, OMP_NUM_THREADS="1",
                           PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
                               os.path.abspath(__file__))), env.get("PYTHONPATH")])))
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *command], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
            for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
                if p.returncode != 0:
                    raise SystemExit(f"rank {rank} failed (exit {p.returncode}):\n{out[-4000:]}")
            return outputs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Set up the hosts, run one worker in each, return rank 0's result."""
    outputs = run_on_two_hosts([os.path.abspath(__file__), "--worker", *_forwarded(args)], args.rate, args.timeout_s)
    for line in outputs[0].splitlines():
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG):]))
    raise SystemExit(f"rank 0 printed no result:\n{outputs[0][-4000:]}")


def _forwarded(args: argparse.Namespace) -> list[str]:
    return ["--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--algorithms", ",".join(args.algorithms), "--rate", args.rate]


# --- one rank ---------------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    from bagua_lightning.engine.algorithms.base import get_algorithm_class
    from bagua_lightning.engine.comm import CommContext
    from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    comm = CommContext.build(local_size=1)  # one rank per "host": two nodes of one rank
    rank = dist.get_rank()

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(args.width, 1))

    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))
               for _ in range(4)]

    def run(name: str) -> list[tuple[float, float, float, float]]:
        """(step, forward, backward, optimizer) seconds of each timed step; ``local``: no communication."""
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ddp: nn.Module = model
        if name != LOCAL:
            ddp = BaguaDistributedDataParallel(model, get_algorithm_class(name).from_kwargs(), comm,
                                               optimizers=[opt])
        times = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            x, y = batches[i % len(batches)]
            loss = nn.functional.mse_loss(ddp(x), y)
            t_fwd = time.perf_counter()
            loss.backward()
            t_bwd = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=False)
            end = time.perf_counter()
            if i >= args.warmup:
                times.append((end - start, t_fwd - start, t_bwd - t_fwd, end - t_bwd))
        if isinstance(ddp, BaguaDistributedDataParallel):
            ddp.teardown()
        return times

    names = [*args.algorithms, LOCAL]
    samples: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            samples[name] += run(name)
    params = sum(p.numel() for p in make_model().parameters())

    def median(name: str, part: int) -> float:
        return statistics.median(t[part] for t in samples[name])

    step_s = {name: median(name, 0) for name in args.algorithms}
    breakdown = {name: {part: median(name, i) for i, part in enumerate(PARTS, start=1)} for name in names}
    if rank == 0:
        base = step_s.get("gradient_allreduce")
        result = {
            "rate": args.rate, "params": params, "fp32_mb": params * 4 / 1e6, "batch": args.batch,
            "steps_per_algorithm": args.steps * args.rounds,
            "step_s": step_s,
            "speedup_vs_gradient_allreduce": {n: base / t for n, t in step_s.items()} if base else {},
            "no_communication_step_s": median(LOCAL, 0),
            "breakdown_s": breakdown,
        }
        print(RESULT_TAG + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> None:
    print(f"link {result['rate']}, model {result['params'] / 1e6:.1f}M params ({result['fp32_mb']:.0f} MB fp32), "
          f"batch {result['batch']}, {result['steps_per_algorithm']} timed steps per algorithm, "
          f"1-min load average before/after {result.get('load_avg_1min')}")
    print(f"{'algorithm':<30}{'step (s)':>10}{'speed-up vs gradient_allreduce':>34}"
          f"{'forward':>10}{'backward':>10}{'optimizer':>11}")
    parts = result["breakdown_s"]
    for name, t in [*result["step_s"].items(), (LOCAL, result["no_communication_step_s"])]:
        ratio = result["speedup_vs_gradient_allreduce"].get(name)
        split = "".join(f"{parts[name][p]:>{10 if p != 'optimizer' else 11}.3f}" for p in PARTS)
        print(f"{name:<30}{t:>10.3f}{(f'{ratio:.2f}x' if ratio else '-'):>34}{split}")
    base = result["step_s"].get("gradient_allreduce")
    if base:
        share = 1 - result["no_communication_step_s"] / base
        print(f"gradient_allreduce spends {share:.0%} of its step communicating (step minus the step "
              "without communication)")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rate", default="1gbit", help="tc rate of each veth end (default: 1gbit)")
    p.add_argument("--width", type=int, default=2048, help="width of the Linear layers")
    p.add_argument("--layers", type=int, default=3, help="number of width x width Linear layers")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per algorithm per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per algorithm per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all algorithms taking turns")
    p.add_argument("--algorithms", type=lambda s: s.split(","), default=list(ALGORITHMS),
                   help="comma-separated algorithm names (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=900, help="give up on the workers after this long")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.algorithms) - set(ALGORITHMS))
    if unknown:
        p.error(f"unknown algorithm(s) {unknown}; choose from {list(ALGORITHMS)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()[0]
    result = drive(args)
    # Other work on the machine slows the CPU-bound parts (compression); say how busy it was.
    result["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    report(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
