"""Optimizer step time: ``fuse_optimizer`` + ``fuse_step`` against torch's for-loop and ``foreach`` steps.

One process, no communication: a 24-layer transformer (>= 290 parameter tensors) gets fixed random
gradients; each variant owns an identical copy of the model and steps it ``--steps`` times per round,
variants taking turns for ``--rounds`` rounds (order rotated, so drift of the machine hits all alike).
Reported: the median step time per variant and its ratio to the for-loop step and to ``foreach``::

    python benchmarks/fused_optimizer.py                     # CPU, width 128
    python benchmarks/fused_optimizer.py --device cuda --width 1024

Variants per optimizer (SGD with momentum, Adam, AdamW):

- ``loop``: torch's single-tensor implementation (``foreach=False``), one set of kernels per tensor;
- ``foreach``: torch's multi-tensor implementation (``foreach=True``);
- ``fused``: ``fuse_optimizer(opt(foreach=False))``, stepped with ``fuse_step``: one flat tensor per group;
- ``torch-fused`` (CUDA, Adam/AdamW/SGD): torch's own single-kernel ``fused=True``, for reference.

Gradients stay where the first fused step put them (the ``zero_grad(set_to_none=False)`` pattern); with
``set_to_none=True`` each fused step first copies the fresh gradients in (one ``foreach`` copy).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bagua_lightning.engine.contrib.fused_optimizer import fuse_optimizer, fuse_step

OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
    "Adam": (torch.optim.Adam, dict(lr=1e-4)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.01)),
}


def build_model(width: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Embedding(1000, width), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                          nn.LayerNorm(width), nn.Linear(width, 1000)).to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    return model


def make_variant(kind: str, name: str, width: int, layers: int,
                 device: torch.device) -> tuple[Callable[[], Any], nn.Module]:
    cls, kwargs = OPTIMIZERS[name]
    model = build_model(width, layers, device)
    if kind == "loop":
        return cls(model.parameters(), foreach=False, **kwargs).step, model
    if kind == "foreach":
        return cls(model.parameters(), foreach=True, **kwargs).step, model
    if kind == "torch-fused":
        return cls(model.parameters(), fused=True, **kwargs).step, model
    opt = fuse_optimizer(cls(model.parameters(), foreach=False, **kwargs))
    return (lambda: fuse_step(opt)), model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--optimizers", default="SGD,Adam,AdamW")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (intra-op)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    probe = build_model(args.width, args.layers, device)
    n_tensors = sum(1 for _ in probe.parameters())
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, {args.layers} layers width {args.width}: {n_tensors} tensors, "
          f"{n_params / 1e6:.1f}M parameters; {args.rounds} rounds x {args.steps} steps")
    kinds = ["loop", "foreach", "fused"] + (["torch-fused"] if device.type == "cuda" else [])
    for name in args.optimizers.split(","):
        variants = {k: make_variant(k, name, args.width, args.layers, device) for k in kinds}
        steps = {k: v[0] for k, v in variants.items()}
        for step in steps.values():  # warm-up: state allocated, gradients gathered, kernels compiled
            for _ in range(3):
                step()
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for k in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
                sync()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    steps[k]()
                sync()
                times[k].append((time.perf_counter() - t0) / args.steps * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = "  ".join(f"{k} {med[k]:.3f} ms" for k in kinds)
        print(f"{name:6s} {cells}  | loop/fused {med['loop'] / med['fused']:.2f}x  "
              f"foreach/fused {med['foreach'] / med['fused']:.2f}x"
              + (f"  torch-fused/fused {med['torch-fused'] / med['fused']:.2f}x" if "torch-fused" in med else ""),
              flush=True)
        # Every variant took the same steps from the same start: the fused result must be the loop's.
        diff = max(float((p - q).detach().abs().max()) for p, q in
                   zip(variants["loop"][1].parameters(), variants["fused"][1].parameters(), strict=True))
        print(f"       max |fused - loop| after {3 + args.rounds * args.steps} steps: {diff:.1e}", flush=True)
        del steps, variants


if __name__ == "__main__":
    main()
