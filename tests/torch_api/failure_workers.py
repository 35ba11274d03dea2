"""Jobs in which one rank fails on purpose (tests/torch_api/test_rank_failure.py).

``python failure_workers.py CASE``, one process per rank (tests.ranks sets RANK, WORLD_SIZE, ...;
``BAGUA_TEST_BACKEND`` is nccl or gloo). Every case loops until something ends it; the rank that fails is 1:

* ``killed``: rank 1 is SIGKILLed while the ranks run allreduce after allreduce (communication primitives);
* ``forward``: ``with_bagua`` training; rank 1 raises in its forward pass at step 5;
* ``strategy``: a Lightning fit with ``BaguaStrategy``; rank 1 raises in ``training_step`` at step 5.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from torch import nn

FAILING_RANK = 1
FAIL_AT_STEP = 5


def _device() -> torch.device:
    if os.environ.get("BAGUA_TEST_BACKEND") == "nccl":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def killed() -> None:
    import bagua_lightning.torch_api as bagua

    bagua.init_process_group()
    rank = bagua.get_rank()
    tensor = torch.ones(1 << 16, device=_device())
    if rank == FAILING_RANK:
        def kill() -> None:
            time.sleep(2.0)  # by then the ranks are in their loop of allreduces
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
    for i in itertools.count():
        bagua.allreduce_inplace(tensor)
        tensor.div_(2)
        if i % 200 == 0:
            print(f"rank {rank}: {i} allreduces", flush=True)
        if tensor.is_cuda:
            torch.cuda.synchronize()


class Failing(nn.Module):
    """A small model whose forward pass raises on the failing rank at step ``FAIL_AT_STEP``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.rank, self.step = rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        if self.rank == FAILING_RANK and self.step == FAIL_AT_STEP:
            raise RuntimeError(f"boom in the forward pass of rank {self.rank}")
        return self.net(x)


def forward() -> None:
    import bagua_lightning.torch_api as bagua
    from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    bagua.init_process_group()
    rank, device = bagua.get_rank(), _device()
    model = Failing(rank).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
    x = torch.randn(32, 16, device=device)
    for step in itertools.count():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if step % 50 == 0:
            print(f"rank {rank}: step {step}", flush=True)


def strategy() -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from bagua_lightning.strategy import BaguaStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Failing(int(os.environ["RANK"]))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return (self.model(x) - y).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    accelerator = "gpu" if os.environ.get("BAGUA_TEST_BACKEND") == "nccl" else "cpu"
    trainer = L.Trainer(accelerator=accelerator, devices=int(os.environ["WORLD_SIZE"]),
                        strategy=BaguaStrategy(algorithm="gradient_allreduce"), max_epochs=1000, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    {"killed": killed, "forward": forward, "strategy": strategy}[sys.argv[1]]()
