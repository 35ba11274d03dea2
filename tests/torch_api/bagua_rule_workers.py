"""Rank program for ``test_bagua_compat_lpd.py``: ``python bagua_rule_workers.py OUT_DIR``, one per rank.

Trains one small model twice from the same start and the same batches: through
``with_bagua`` + ``LowPrecisionDecentralizedAlgorithm``, and through an independent
reference of Bagua's low-precision decentralized step written here with numpy
float32 arithmetic (nothing of ``bagua_lightning``'s compression). Writes
``OUT_DIR/rankN.json`` with, per communication interval, whether the weights and the
ring replicas agree exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import bagua_lightning.torch_api as bagua
from bagua_lightning.torch_api.algorithms.decentralized import LowPrecisionDecentralizedAlgorithm

F32 = np.float32
STEPS = 10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=True)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


def encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bagua's MinMax uint8 rule on a float32 vector: ``([min, max], levels)``."""
    lo, hi = x.min(), x.max()
    scale = F32(1) / (hi - lo + F32(1e-7)) * F32(255)
    lower = np.rint(hi * scale) - F32(255)
    levels = np.clip(np.rint(x * scale) - lower, 0, 255).astype(np.uint8)
    return np.array([lo, hi], dtype=F32), levels


def decode(header: np.ndarray, levels: np.ndarray) -> np.ndarray:
    lo, hi = header
    scale = F32(1) / (hi - lo + F32(1e-7)) * F32(255)
    lower = np.rint(hi * scale) - F32(255)
    return (levels.astype(F32) + lower) / scale


class Reference:
    """Bagua's low-precision decentralized SGD on a ring, the whole model as one chunk."""

    def __init__(self, params: list[torch.Tensor], interval: int) -> None:
        self.params, self.interval, self.steps = params, interval, 0
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.weight = self.flat()
        self.left, self.right = self.weight.copy(), self.weight.copy()

    def flat(self) -> np.ndarray:
        return np.concatenate([p.detach().numpy().reshape(-1) for p in self.params]).astype(F32)

    def after_optimizer_step(self) -> None:
        if self.steps % self.interval == 0:
            x = self.flat()
            x = x + F32(1 / 3) * self.left
            x = x + F32(1 / 3) * self.right
            x = x - F32(5 / 3) * self.weight
            header, levels = encode(x)
            headers = [torch.empty(2) for _ in range(self.world)]
            payloads = [torch.empty(levels.size, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(headers, torch.from_numpy(header))
            dist.all_gather(payloads, torch.from_numpy(levels))
            left, right = (self.rank - 1) % self.world, (self.rank + 1) % self.world
            self.left = self.left + decode(headers[left].numpy(), payloads[left].numpy())
            self.right = self.right + decode(headers[right].numpy(), payloads[right].numpy())
            self.weight = self.weight + decode(header, levels)
            offset = 0
            with torch.no_grad():
                for p in self.params:
                    p.copy_(torch.from_numpy(self.weight[offset : offset + p.numel()]).view_as(p))
                    offset += p.numel()
        self.steps += 1


def sorted_values(t: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.sort(torch.as_tensor(t).reshape(-1)).values


def train(interval: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    ours = Net()
    ref_model = Net()
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    ours = ours.with_bagua([opt], LowPrecisionDecentralizedAlgorithm(hierarchical=False,
                                                                     communication_interval=interval))
    ref_model.load_state_dict(ours.state_dict())  # rank 0's weights, broadcast by with_bagua
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    reference = Reference(list(ref_model.parameters()), interval)
    for _ in range(STEPS):
        data, target = torch.randn(4, 2), torch.randn(4, 4)
        for model, o in ((ours, opt), (ref_model, ref_opt)):
            o.zero_grad()
            F.mse_loss(model(data), target).backward()
            o.step()
        reference.after_optimizer_step()
    bucket = ours.bagua_buckets[0]
    pairs = zip(ours.parameters(), ref_model.parameters(), strict=True)
    return {
        "buckets": len(ours.bagua_buckets),
        "moved": max((a.detach() - b).abs().max().item() for a, b in zip(ours.parameters(),
                                                                        Net().parameters(), strict=True)),
        "max_difference": max((a.detach() - b.detach()).abs().max().item() for a, b in pairs),
        "weights_equal": all(torch.equal(a.detach(), b.detach())
                             for a, b in zip(ours.parameters(), ref_model.parameters(), strict=True)),
        "replicas_equal": [
            torch.equal(sorted_values(bucket._weight), sorted_values(reference.weight)),
            torch.equal(sorted_values(bucket._left_peer_weight), sorted_values(reference.left)),
            torch.equal(sorted_values(bucket._right_peer_weight), sorted_values(reference.right)),
        ],
    }


def main() -> None:
    out = Path(sys.argv[1])
    bagua.init_process_group()
    results = {str(interval): train(interval) for interval in (1, 2)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
