"""Training throughput of Bagua's algorithms against PyTorch DDP, in one run, on the same batches.

Launch with torchrun (NCCL on GPUs, Gloo on CPU)::

    torchrun --nproc_per_node 2 benchmarks/allreduce_vs_ddp.py                 # ~110M-param transformer
    torchrun --nproc_per_node 2 benchmarks/allreduce_vs_ddp.py --model tiny    # CPU smoke check
    torchrun --nproc_per_node 2 benchmarks/allreduce_vs_ddp.py --model resnet50  # torchvision, synthetic images

Each GPU as its own "node" over a shaped link: ``benchmarks/device_suite.sh OUT twonode``; on CPU, two
ranks in two network namespaces joined by a veth pair shaped to ``--rate`` (root, iproute2)::

    python benchmarks/allreduce_vs_ddp.py --netns --rate 1gbit --model mlp --variants gradient_allreduce,bytegrad,auto

(``--model mlp``: 25.2M parameters and little compute, so at 1 Gbit/s the step is gradient communication;
``--model wide``: a 10M-parameter transformer whose CPU backward is a sizeable part of the step.)

Variants: ``ddp``; an algorithm's name, optionally with keyword arguments and another bucket size,
``name:key=value/key=value+25MiB`` (``bytegrad:hierarchical=0`` is flat bytegrad); ``auto`` (or
``auto:bytegrad+decentralized+...`` for other candidates), the registered engine algorithm ``auto`` that
``BaguaStrategy(algorithm="auto")`` and ``with_bagua`` use: during its warm-up it measures its candidates
in flight (``--auto-warmup`` untimed steps a visit, ``--auto-trials`` timed steps each, forward start to
optimizer step end), in untimed interleaved rounds of every variant run exactly as the timed ones (so its
trial sees the regime that the rounds then time), and hands the model to the fastest (reported with the step
at which it settled); its timed steps are then interleaved with the other variants' like any other. Its
choice joins the run as a variant of its own when it is not one already, and ``auto`` is reported against it (what a choice costs once
made) and against the best of its candidates in the run (what the choice is worth).

``--model`` takes a comma-separated list: one process measures each model in turn (one JSON per model,
``--json`` with ``_<model>`` before its suffix).

Every variant trains its own copy of the same model (same initial weights, same
batches, same AdamW, fused where torch has it); all copies live side by side and warm up for ``--warmup`` steps
(on CPU then as many more as an ``auto`` variant's selection took, so all start timing at the same step).
Then each of ``--rounds`` rounds runs ONE step of every variant, in an order shuffled
per round (the same on every rank), each step timed between two device synchronisations
(``benchmarks/interleaved.py``); a step's time is then that of its slowest rank (one all-reduce after the
rounds: a decentralized step can end early on one rank and leave the wait to the next variant), rank 0's own
in the JSON beside it. Reported per variant: the median step time and the speed
against DDP, ``median(DDP) / median(variant)``, with its 95 % bootstrap interval; an
interval that contains 1 is "no difference".
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

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms.auto import AutoAlgorithm
from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved import (  # a sibling module of the benchmarks
    bootstrap_ratio,
    interleave,
    slowest_rank,
    speeds,
)

SIZES = {  # vocab, width, layers, heads
    "100m": (32000, 768, 12, 12),
    "tiny": (1000, 64, 2, 4),
    "wide": (32000, 256, 2, 4),  # 10M parameters, mostly the tied embedding: communication-bound on CPU
}
VISION = ("resnet50", "vgg16")  # torchvision models on synthetic 224x224 images, 1000 classes
#: width, layers: ``layers`` x Linear(width, width) with ReLU between, the last one the classifier over
#: ``width`` classes. 'mlp' has 25.2M parameters (101 MB fp32) and little compute per step (batch 4 on CPU):
#: at 1 Gbit/s its step is gradient communication, as a GPU's step is at 10 Gbit/s.
MLPS = {"mlp": (2048, 6)}


class Transformer(nn.Module):
    """A GPT-style stack (pre-norm encoder layers, tied embedding) built in code: no downloads."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq_len: int, embed_std: float = 0.02
                 ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        # GPT-2's embedding init. nn.Embedding's N(0, 1), tied to the output, makes logits of std ~sqrt(width)
        # (initial loss ~235 instead of ln(vocab) ~10 at width 256): their softmax then underflows into
        # subnormal floats after a few dozen steps, which Intel CPUs compute 10x slower (switch_diagnose.py).
        nn.init.normal_(self.embed.weight, std=embed_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(tokens) + self.pos)
        return self.norm(h) @ self.embed.weight.t()


def make_model(args: argparse.Namespace) -> nn.Module:
    if args.model in VISION:
        import torchvision

        return getattr(torchvision.models, args.model)(weights=None)
    if args.model in MLPS:
        width, layers = MLPS[args.model]
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else [])
        return nn.Sequential(*blocks)
    return Transformer(*SIZES[args.model], args.seq_len, embed_std=getattr(args, "embed_std", 0.02))


def make_batches(args: argparse.Namespace, device: torch.device, g: torch.Generator
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four synthetic (input, target) batches of ``args.model``, from generator ``g``."""
    if args.model in VISION:
        return [(torch.randn(args.batch_size, 3, 224, 224, generator=g).to(device),
                 torch.randint(1000, (args.batch_size,), generator=g).to(device)) for _ in range(4)]
    if args.model in MLPS:
        width = MLPS[args.model][0]
        return [(torch.randn(args.batch_size, width, generator=g).to(device),
                 torch.randint(width, (args.batch_size,), generator=g).to(device)) for _ in range(4)]
    vocab = SIZES[args.model][0]
    return [(torch.randint(vocab, (args.batch_size, args.seq_len), generator=g).to(device),
             torch.randint(vocab, (args.batch_size, args.seq_len), generator=g).to(device))
            for _ in range(4)]


def build(variant: str, args: argparse.Namespace, device: torch.device, comm: CommContext) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = make_model(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adamw(device))
    if variant == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    elif variant.startswith("auto"):
        wrapped = BaguaDistributedDataParallel(model, auto_algorithm(variant, args), comm,
                                               bucket_size=args.bucket_size, optimizers=[opt])
    else:
        name, kwargs, bucket_size = parse_variant(variant, args.bucket_size)
        algo = get_algorithm_class(name).from_kwargs(**kwargs)
        wrapped = BaguaDistributedDataParallel(model, algo, comm, bucket_size=bucket_size, optimizers=[opt])
    return wrapped, opt


def fused_adamw(device: torch.device) -> bool:
    """Whether torch has a fused AdamW for ``device`` (CUDA; CPU since torch 2.4, ~10x faster than foreach there)."""
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def auto_algorithm(variant: str, args: argparse.Namespace) -> AutoAlgorithm:
    """``auto`` or ``auto:a+b+c`` -> the registered ``auto`` over those candidates (default: its own)."""
    _, _, names = variant.partition(":")
    return AutoAlgorithm(candidates=names.split("+") if names else None,
                         warmup_steps=getattr(args, "auto_warmup", 3), trial_steps=getattr(args, "auto_trials", 10))


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("1", "true", "0", "false"):
        return low in ("1", "true")
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_variant(variant: str, default_bucket: int) -> tuple[str, dict[str, Any], int]:
    """``"name"``, ``"name+25MiB"`` (another bucket size), ``"name:key=value/key=value"`` (its arguments)."""
    head, _, size = variant.partition("+")
    name, _, options = head.partition(":")
    kwargs = {k: _value(v) for k, _, v in (o.partition("=") for o in options.split("/") if o)}
    return name, kwargs, int(float(size.removesuffix("MiB")) * 1024**2) if size else default_bucket


class Runner:
    """One variant: its own model copy, optimizer and wrapper, trained in timed blocks of steps."""

    def __init__(self, variant: str, args: argparse.Namespace, device: torch.device, comm: CommContext,
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.variant, self.args, self.device, self.comm, self.batches = variant, args, device, comm, batches
        self.model, self.opt = build(variant, args, device, comm)
        self.i = 0
        self.auto: AutoAlgorithm | None = None
        if variant.startswith("auto"):
            assert isinstance(self.model, BaguaDistributedDataParallel)
            self.auto = self.model.algorithm  # type: ignore[assignment]
            assert isinstance(self.auto, AutoAlgorithm)
        self.warm_up(args.warmup)

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(x)
        if logits.dim() == 3:  # tokens: (batch, seq, vocab)
            logits = logits.flatten(0, 1)
        loss = nn.functional.cross_entropy(logits.float(), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def warm_up(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
        sync(self.device)

    def selection(self) -> str | None:
        return self.auto.selection.line() if self.auto is not None else None

    def timings(self) -> str | None:
        if not isinstance(self.model, BaguaDistributedDataParallel):
            return None
        t = self.model.last_step_timings()
        if t is None:
            return None
        return (f"{len(t.buckets)} buckets, backward {t.backward_ms:.1f} ms, comm "
                f"{sum(b.comm_ms for b in t.buckets):.1f} ms, exposed wait "
                f"{max((b.wait_ms for b in t.buckets), default=0):.1f} ms")

    def close(self) -> None:
        if isinstance(self.model, BaguaDistributedDataParallel):
            self.model.teardown()


def select(runners: list[Runner], device: torch.device, seed: int) -> None:
    """Untimed interleaved rounds of every variant until each ``auto`` has chosen.

    auto's trial steps then run in the regime of the timed rounds (one step of each variant per round, a device
    synchronisation around each step: a step that starts on an idle device after another model's step pays
    its launch latency and cold caches, one queued behind its own last step does not). auto measures the
    regime it runs in; alone, in consecutive steps, it would measure another one than the rounds time.
    """
    rounds = 0
    while any(r.auto is not None and r.auto.selection.chosen is None for r in runners):  # decided on every rank alike
        rounds += 1
        interleave({r.variant: r.step for r in runners}, 1, sync=lambda: sync(device), seed=seed + 7919 * rounds)
    for r in runners:  # handed over: the wrapper drives the chosen algorithm itself from now on
        assert r.auto is None or not isinstance(r.model.algorithm, AutoAlgorithm), "auto did not hand its choice over"


def sync(device: torch.device) -> None:
    """Wait for the device (no barrier: the ranks are in lockstep through the step's collectives)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def auto_report(times: dict[str, list[float]], runners: list[Runner]) -> dict[str, Any]:
    """Each ``auto`` variant against its choice and against the best of its candidates, in the same run."""
    out: dict[str, Any] = {}
    for runner in runners:
        if runner.auto is None or runner.variant not in times:
            continue
        chosen = runner.auto.selection.chosen
        present = [c for c in runner.auto.candidates if c in times]
        best = min(present, key=lambda c: statistics.median(times[c])) if present else None
        entry: dict[str, Any] = {"chosen": chosen, "best_candidate": best}
        for key, other in (("vs_chosen", chosen), ("vs_best", best)):
            if other is not None and other in times:
                ratio, low, high = bootstrap_ratio(times[other], times[runner.variant])
                _, plow, phigh = bootstrap_ratio(times[other], times[runner.variant], paired=True)
                entry[key] = {"variant": other, "ratio": ratio, "ci95": [low, high], "ci95_paired": [plow, phigh]}
        out[runner.variant] = entry
    return out


def run_model(args: argparse.Namespace, comm: CommContext, device: torch.device, cuda: bool) -> dict[str, Any]:
    """Measure every variant on ``args.model``; rank 0 prints the table; returns the JSON document."""
    args.batch_size = args.batch_size_arg or ((64 if args.model in VISION else 16) if cuda else 4)
    args.seq_len = args.seq_len_arg or (512 if cuda else 32)
    variants = []
    for v in args.variants.split(","):
        try:
            if v.startswith("auto"):
                auto_algorithm(v, args)
            elif v != "ddp":
                name, kwargs, _ = parse_variant(v, 0)
                get_algorithm_class(name).from_kwargs(**kwargs)
            variants.append(v)
        except ConfigurationError as exc:
            if comm.rank == 0:
                print(f"skipping {v!r}: {exc}")
    batches = make_batches(args, device, torch.Generator().manual_seed(1 + comm.rank))
    runners = [Runner(v, args, device, comm, batches) for v in variants]
    select(runners, device, args.seed)
    for runner in list(runners):  # auto's choice joins the run when it is not a variant already
        chosen = runner.auto.selection.chosen if runner.auto is not None else None
        if chosen is not None and chosen not in [r.variant for r in runners]:
            runners.append(Runner(chosen, args, device, comm, batches))
    # On CPU the same training progress for all before timing: every variant trained through auto's selection
    # rounds, but its choice, when it joins the run only now, did not (gradients and optimizer state change
    # with progress, and their values can change a CPU's speed: subnormal floats), so it catches up first. A
    # GPU's speed does not depend on the values.
    most = max(runner.i for runner in runners)
    for runner in runners if not cuda else ():
        runner.warm_up(most - runner.i)
    own = interleave({r.variant: r.step for r in runners}, args.rounds, sync=lambda: sync(device), seed=args.seed)
    times = slowest_rank(own, device if cuda else None)
    timings = {runner.variant: runner.timings() for runner in runners}
    selections = {runner.variant: runner.selection() for runner in runners}
    autos = auto_report(times, runners)
    n_params = sum(p.numel() for p in runners[0].model.parameters())
    for runner in runners:
        runner.close()
    del runners
    if cuda:
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    doc: dict[str, Any] = {"world_size": comm.world_size, "nodes": comm.num_nodes, "device": name,
                           "params": n_params, "args": vars(args), "auto": autos}
    if comm.rank != 0:
        return doc
    print(f"model {args.model} ({n_params / 1e6:.1f}M params), {comm.world_size} x {name} on {comm.num_nodes} "
          f"node(s), batch {args.batch_size}{'' if args.model in VISION + tuple(MLPS) else f'x{args.seq_len}'} "
          f"per rank, {args.rounds} interleaved steps per variant, each step's time that of its slowest rank; "
          "speed vs DDP = median(DDP) / median(variant) [95 % bootstrap interval]")
    baseline = "ddp" if "ddp" in times else next(iter(times))
    result = {}
    for sp in speeds(times, baseline):
        result[sp.variant] = {**sp.to_json(), "samples_per_s":
                              1000.0 * args.batch_size * comm.world_size / sp.median_ms,
                              "step_ms": times[sp.variant], "rank0_step_ms": own[sp.variant],
                              "rank0_median_ms": statistics.median(own[sp.variant])}
        print(sp.row())
        if selections.get(sp.variant):
            print(f"{'':>32}{selections[sp.variant]}")
            result[sp.variant]["selection"] = selections[sp.variant]
        if timings.get(sp.variant):
            print(f"{'':>32}last measured step: {timings[sp.variant]}")
    for variant, entry in autos.items():
        for key, what in (("vs_chosen", "its choice"), ("vs_best", "the best of its candidates")):
            if key in entry:
                c = entry[key]
                print(f"{variant} against {what} ({c['variant']}): {c['ratio']:.3f}x "
                      f"[{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}], rounds paired [{c['ci95_paired'][0]:.3f}, "
                      f"{c['ci95_paired'][1]:.3f}] (median({c['variant']}) / median({variant}))")
    doc.update(baseline=baseline, results=result)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="100m", help=f"comma-separated, of {sorted(SIZES) + list(MLPS) + list(VISION)}")
    p.add_argument("--batch-size", dest="batch_size_arg", type=int, default=None,
                   help="sequences per rank (default 16 GPU, 4 CPU; 64 images for vision models on GPU)")
    p.add_argument("--seq-len", dest="seq_len_arg", type=int, default=None,
                   help="tokens per sequence (default 512 GPU, 32 CPU)")
    p.add_argument("--auto-warmup", type=int, default=3, help="auto: untimed steps after each switch")
    p.add_argument("--auto-trials", type=int, default=10, help="auto: timed steps per candidate")
    p.add_argument("--warmup", "--steps", type=int, default=5, help="untimed steps per variant first")
    p.add_argument("--rounds", type=int, default=60, help="timed steps per variant (one per round)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle (same on every rank)")
    p.add_argument("--bucket-size", type=int, default=10 * 1024**2, help="bytes per Bagua bucket")
    p.add_argument("--variants", default="ddp,gradient_allreduce,bytegrad,decentralized")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    p.add_argument("--netns", action="store_true", help="CPU: two ranks in two shaped network namespaces")
    p.add_argument("--rate", default="1gbit", help="veth rate with --netns (tc syntax)")
    args = p.parse_args()
    if args.netns and "RANK" not in os.environ:
        from slow_network import run_on_two_hosts

        argv = [a for a in sys.argv[1:] if a != "--netns"]
        print(run_on_two_hosts([os.path.abspath(__file__), *argv], args.rate, 3600, port="29617")[0])
        return
    models = args.model.split(",")
    for model in models:
        if model not in list(SIZES) + list(MLPS) + list(VISION):
            p.error(f"--model {model!r}: choose from {sorted(SIZES) + list(MLPS) + list(VISION)}")
    cuda = torch.cuda.is_available() and "GLOO_SOCKET_IFNAME" not in os.environ  # netns ranks are CPU hosts
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    comm = CommContext.build(local_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    for model in models:
        args.model = model
        doc = run_model(args, comm, device, cuda)
        if args.json and comm.rank == 0:
            path = Path(args.json)
            if len(models) > 1:
                path = path.with_name(f"{path.stem}_{model}{path.suffix}")
            path.write_text(json.dumps(doc, indent=1))
        args.model = ",".join(models)
    comm.destroy_groups()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
