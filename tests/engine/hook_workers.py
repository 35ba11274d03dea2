"""Worker for tests/engine/test_hooks.py: DDP with ``bytegrad_hook`` against plain DDP, one JSON per rank.

``python hook_workers.py OUT_DIR`` under torchrun's environment (Gloo). Two copies of
one model (an odd parameter count: the hook pads its bucket) see the same batches;
one reduces its gradients with the hook, the other with DDP's allreduce.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bagua_lightning.engine.chunk_format import LEVELS
from bagua_lightning.hooks import ByteGradState, bytegrad_hook


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 31), nn.Tanh(), nn.Linear(31, 3))  # 403 + 96 = 499 parameters: odd


def flat_grads(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict[str, Any] = {"steps": []}
    try:
        hooked = DistributedDataParallel(model())
        hooked.register_comm_hook(ByteGradState(), bytegrad_hook)
        stateless = DistributedDataParallel(model())
        stateless.register_comm_hook(None, bytegrad_hook)  # DDP's own hooks take a group or None
        plain = DistributedDataParallel(model())
        result["numel"] = sum(p.numel() for p in plain.parameters())
        optimisers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (hooked, stateless, plain)]
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(3):
            x, y = torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)
            losses = []
            for m, opt in zip((hooked, stateless, plain), optimisers, strict=True):
                opt.zero_grad()
                loss = nn.functional.mse_loss(m(x), y)
                loss.backward()
                losses.append(float(loss))
            # The bound of ByteGrad: half a level of every rank's chunk (averaged), then of the reduced chunk.
            local = plain.module  # plain DDP averaged in place: recompute this rank's own gradient for widths
            own = model()
            own.load_state_dict(local.state_dict())
            nn.functional.mse_loss(own(x), y).backward()
            width = torch.tensor([float(flat_grads(own).max() - flat_grads(own).min())])
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            exact = flat_grads(plain.module)
            bound = (float(width) + float(exact.max() - exact.min())) / (2 * LEVELS) * 1.01 + 1e-6
            compressed = flat_grads(hooked.module)
            same = compressed.clone()
            dist.broadcast(same, src=0)
            result["steps"].append({
                "err": float((compressed - exact).abs().max()),
                "bound": bound,
                "stateless_equal": bool(torch.equal(flat_grads(stateless.module), compressed)),
                "identical_on_ranks": bool(torch.equal(same, compressed)),
                "losses": losses,
            })
            for opt in optimisers:
                opt.step()
            # Keep the three replicas on the same weights: the test is about one step's gradients.
            for m in (hooked, stateless):
                m.module.load_state_dict(plain.module.state_dict())
    except Exception:  # reported to the test
        result["error"] = traceback.format_exc()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
