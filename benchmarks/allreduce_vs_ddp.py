"""Training throughput of Bagua's algorithms against PyTorch DDP, in one run, on the same batches.

Launch with torchrun (NCCL on GPUs, Gloo on CPU)::

    torchrun --nproc_per_node 2 benchmarks/allreduce_vs_ddp.py                 # ~110M-param transformer
    torchrun --nproc_per_node 2 benchmarks/allreduce_vs_ddp.py --model tiny    # CPU smoke check

Every variant trains its own copy of the same model (same initial weights, same
batches, same AdamW); all copies live side by side, warm up for ``--warmup`` steps,
then take turns in timed blocks of ``--steps`` steps for ``--rounds`` rounds (order
rotated every round) so that drift of the machine hits all of them alike. The median
samples/s per variant is reported with its ratio to DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
from bagua_lightning.errors import ConfigurationError

SIZES = {  # vocab, width, layers, heads
    "100m": (32000, 768, 12, 12),
    "tiny": (1000, 64, 2, 4),
}


class Transformer(nn.Module):
    """A GPT-style stack (pre-norm encoder layers, tied embedding) built in code: no downloads."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(tokens) + self.pos)
        return self.norm(h) @ self.embed.weight.t()


def build(variant: str, args: argparse.Namespace, device: torch.device, comm: CommContext) -> tuple[nn.Module, Any]:
    vocab, width, layers, heads = SIZES[args.model]
    torch.manual_seed(0)
    model = Transformer(vocab, width, layers, heads, args.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if variant == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        name, bucket_size = parse_variant(variant, args.bucket_size)
        algo = get_algorithm_class(name).from_kwargs()
        wrapped = BaguaDistributedDataParallel(model, algo, comm, bucket_size=bucket_size, optimizers=[opt])
    return wrapped, opt


def parse_variant(variant: str, default_bucket: int) -> tuple[str, int]:
    """``"name"`` or ``"name+25MiB"`` (another bucket size)."""
    name, _, size = variant.partition("+")
    return name, int(float(size.removesuffix("MiB")) * 1024**2) if size else default_bucket


class Runner:
    """One variant: its own model copy, optimizer and wrapper, trained in timed blocks of steps."""

    def __init__(self, variant: str, args: argparse.Namespace, device: torch.device, comm: CommContext,
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.variant, self.args, self.device, self.comm, self.batches = variant, args, device, comm, batches
        self.model, self.opt = build(variant, args, device, comm)
        self.i = 0
        self.block(args.warmup)

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def block(self, steps: int) -> float:
        """Samples/s (all ranks) over ``steps`` steps."""
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return steps * self.args.batch_size * self.comm.world_size / (time.perf_counter() - t0)

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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SIZES), default="100m")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank (default 16 GPU, 4 CPU)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512 GPU, 32 CPU)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8, help="timed blocks per variant")
    p.add_argument("--bucket-size", type=int, default=10 * 1024**2, help="bytes per Bagua bucket")
    p.add_argument("--variants", default="ddp,gradient_allreduce,bytegrad,decentralized")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    args.batch_size = args.batch_size or (16 if cuda else 4)
    args.seq_len = args.seq_len or (512 if cuda else 32)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    comm = CommContext.build(local_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    variants = []
    for v in args.variants.split(","):
        try:
            if v != "ddp":
                get_algorithm_class(parse_variant(v, 0)[0])
            variants.append(v)
        except ConfigurationError:
            if comm.rank == 0:
                print(f"skipping {v!r}: not available")
    vocab = SIZES[args.model][0]
    g = torch.Generator().manual_seed(1 + comm.rank)
    batches = [(torch.randint(vocab, (args.batch_size, args.seq_len), generator=g).to(device),
                torch.randint(vocab, (args.batch_size, args.seq_len), generator=g).to(device)) for _ in range(4)]
    # All variants live side by side and take turns in short blocks (order rotated every
    # round), so that clock and thermal drift of the machine hit them alike.
    runners = [Runner(v, args, device, comm, batches) for v in variants]
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for k in range(len(runners)):
            runner = runners[(k + r) % len(runners)]
            samples[runner.variant].append(runner.block(args.steps))
    timings = {runner.variant: runner.timings() for runner in runners}
    for runner in runners:
        runner.close()
    if comm.rank == 0:
        n_params = sum(p.numel() for p in Transformer(*SIZES[args.model], args.seq_len).parameters())
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        print(f"model {args.model} ({n_params / 1e6:.1f}M params), {comm.world_size} x {name}, "
              f"batch {args.batch_size}x{args.seq_len} per rank, {args.steps} steps x {args.rounds} rounds")
        base = statistics.median(samples["ddp"]) if "ddp" in samples else None
        result = {}
        for v in variants:
            med = statistics.median(samples[v])
            ratio = med / base if base else float("nan")
            result[v] = {"samples_per_s": med, "ratio_vs_ddp": ratio, "all": samples[v]}
            print(f"{v:>28}: {med:10.1f} samples/s  x{ratio:.3f} vs DDP  (rounds: "
                  + ", ".join(f"{s:.1f}" for s in samples[v]) + ")")
            if timings.get(v):
                print(f"{'':>30}last measured step: {timings[v]}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"world_size": comm.world_size, "device": name, "params": n_params,
                           "args": vars(args), "results": result}, fh, indent=1)
    comm.destroy_groups()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
