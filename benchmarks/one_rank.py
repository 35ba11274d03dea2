"""One rank: ``BaguaStrategy`` against Lightning's single-device strategy (the goal: >= 0.98x).

With one rank there is nothing to communicate, so a strategy costs what it adds to Lightning's own step.
Every variant fits its own copy of the same model (same initial weights, same batches) with its own
``Trainer(devices=1)`` in this one process; Lightning strategies cannot share a step, so whole fits alternate
(``docs/../shared/MEASURING.md``, 6): each round runs one fit of every variant in an order shuffled per round
(``benchmarks/interleaved.py``'s ``round_order``), each fit ``--steps`` training steps of which the first
``--warmup`` are dropped. A step's time is the time between two ends of training batches (data loading, every
hook and the optimizer step included), with a device synchronisation at each end on CUDA. Reported: the median
step time per variant and its speed against the single-device strategy: the median over rounds of each
round's median, with a 95 % bootstrap interval over rounds resampled in pairs (``bootstrap_ratio(paired=True)``
on the rounds' medians: the drift between rounds, which whole fits cannot interleave away, hits both alike).

    python benchmarks/one_rank.py                              # CPU: ResNet-18 on 32 px images, batch 32
    python benchmarks/one_rank.py --device cuda                # one GPU: ResNet-18, 224 px, batch 64 (< 2 min)
    python benchmarks/one_rank.py --rounds 16 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved import Speed, bootstrap_ratio, round_order

VARIANTS = ("single", "bagua", "bytegrad", "auto")


class Block(nn.Module):
    """ResNet's basic block (two 3x3 convolutions and a shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet18(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def _module(state: dict[str, torch.Tensor]) -> Any:
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = resnet18()
            self.net.load_state_dict(state)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Net()


def _strategy(name: str) -> Any:
    from bagua_lightning.strategy import BaguaStrategy

    return {"single": "auto", "bagua": "bagua", "bytegrad": BaguaStrategy("bytegrad"),
            "auto": BaguaStrategy("auto")}[name]


def fit(name: str, state: dict[str, torch.Tensor], batches: list[Any], args: argparse.Namespace) -> list[float]:
    """One fit of variant ``name``: the times of its steps after the warm-up, in milliseconds."""
    import lightning as L

    cuda = args.device == "cuda"
    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, *_: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=_strategy(name),
                        benchmark=args.cudnn_benchmark or None,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[Clock()])
    loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)  # type: ignore[arg-type]
    trainer.fit(_module(state), loader)
    return [(b - a) * 1e3 for a, b in zip(ends[args.warmup:], ends[args.warmup + 1:], strict=False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    p.add_argument("--rounds", type=int, default=12, help="fits of every variant (alternated)")
    p.add_argument("--steps", type=int, default=0, help="steps per fit (0: 30 on CUDA, 16 on CPU)")
    p.add_argument("--warmup", type=int, default=4, help="steps of each fit not timed")
    p.add_argument("--batch", type=int, default=0, help="batch size (0: 64 on CUDA, 32 on CPU)")
    p.add_argument("--image", type=int, default=0, help="image side in pixels (0: 224 on CUDA, 32 on CPU)")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="every variant's Trainer(benchmark=True): cuDNN times its algorithms in each fit's warm-up "
                        "instead of picking them by heuristics")
    p.add_argument("--batches-on-device", action="store_true",
                   help="CUDA: the batches made on the GPU, so that no step copies its batch (38 MB at the "
                        "defaults) from pageable host memory: the step is the model's and the strategy's alone")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.steps = args.steps or (30 if cuda else 16)
    args.batch = args.batch or (64 if cuda else 32)
    args.image = args.image or (224 if cuda else 32)
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "single" not in names:
        p.error(f"--variants={args.variants}: give names from {VARIANTS}, 'single' (the baseline) among them")
    if args.warmup + 2 > args.steps:
        p.error(f"--steps={args.steps} leaves no timed steps after --warmup={args.warmup}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import lightning  # noqa: F401  (its loggers exist from here on)

    for logger in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in resnet18().state_dict().items()}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, 3, args.image, args.image, generator=g),
                torch.randint(0, 1000, (args.batch,), generator=g)) for _ in range(8)]
    if cuda and args.batches_on_device:
        batches = [(x.cuda(), y.cuda()) for x, y in batches]
    batches = [batches[i % len(batches)] for i in range(args.steps)]
    rounds: dict[str, list[float]] = {n: [] for n in names}  # each round's median step time, per variant
    started = time.perf_counter()
    for r in range(args.rounds):
        for name in round_order(names, r):
            rounds[name].append(statistics.median(fit(name, state, batches, args)))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.1f} ms" for n, v in rounds.items()),
              file=sys.stderr, flush=True)
    results = []
    for name, series in rounds.items():
        ratio, low, high = bootstrap_ratio(rounds["single"], series, paired=True)
        results.append(Speed(name, statistics.median(series), ratio, low, high, len(series)))
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"one rank on {device}: ResNet-18, batch {args.batch}, {args.image} px, {args.rounds} rounds x "
          f"{args.steps - args.warmup - 1} timed steps per fit ({time.perf_counter() - started:.0f} s)")
    for s in results:
        print(s.row())
    if args.json:
        args.json.write_text(json.dumps({"device": device, "args": {k: str(v) for k, v in vars(args).items()},
                                         "speeds": {s.variant: s.to_json() for s in results},
                                         "round_median_ms": rounds},
                                        indent=2))


if __name__ == "__main__":
    main()
