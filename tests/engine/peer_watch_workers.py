"""Rank programs for tests/engine/test_peer_watch*.py: ``python peer_watch_workers.py SCENARIO ARGS``.

The failing rank is always 1. Scenarios:

* ``train FAILURE``: ``with_bagua`` training (gradient_allreduce, a 64-256-1 MLP, 10 ms of sleep a step), the
  job of issue reports: at step 5 rank 1 SIGKILLs itself (``kill``) or raises (``raise``); the other ranks
  train until the watch ends them. Ranks come from the environment (env variables, torchrun);
* ``fit FAILURE``: the same in a Lightning ``Trainer(devices=2, strategy=BaguaStrategy(...))``, run once:
  Lightning's own launcher starts rank 1;
* ``finish``: every rank trains, passes a last barrier and leaves at its own time in its own way (rank 3 at
  once with ``os._exit`` and no exit mark, rank 2 after 1 s destroying its group then ``os._exit``, rank 1 after
  2 s destroying its group and returning); rank 0 keeps working 4 s and prints the peers its watch saw leave;
* ``mp SCENARIO WORLD``: run the ranks of ``train_*``/``finish_mp`` in processes forked by ``multiprocessing``,
  as Bagua's tests do; prints each rank's exit code (``exit codes [..]``). ``finish_mp``: rank 1 returns at
  once after the last barrier (its exit mark is the multiprocessing finaliser's), rank 0 keeps working 4 s.

Every rank prints ``rank R finished`` when it ends by itself.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import torch
from torch import nn

FAILING_RANK = 1
FAIL_AT_STEP = 5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))


def _fail(rank: int, step: int, failure: str) -> None:
    if rank != FAILING_RANK or step != FAIL_AT_STEP:
        return
    print(f"rank {rank}: failing ({failure}) at step {step}", flush=True)
    if failure == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"boom at step {step} of rank {rank}")


def train(failure: str) -> None:
    import bagua_lightning.torch_api as bagua
    from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    x = torch.randn(32, 64)
    for step in range(100_000):
        _fail(rank, step, failure)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        time.sleep(0.01)
    print(f"rank {rank} finished", flush=True)


def fit(failure: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from bagua_lightning.strategy import BaguaStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            _fail(self.global_rank, batch_idx, failure)
            time.sleep(0.01)
            x, y = batch
            return (self.model(x) - y).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(1 << 16, 64), torch.randn(1 << 16, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=BaguaStrategy(algorithm="gradient_allreduce"),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), DataLoader(data, batch_size=32))
    print(f"rank {trainer.global_rank} finished", flush=True)


def _work(seconds: float) -> None:
    """Local work (no collective) for ``seconds``, as a rank does after its last collective."""
    w = torch.randn(64, 64)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        w = torch.tanh(w @ w.T / 64)
        time.sleep(0.02)


def _last_steps() -> int:
    import torch.distributed as dist

    import bagua_lightning.torch_api as bagua
    from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([opt], GradientAllReduceAlgorithm())
    for _ in range(10):
        opt.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
    dist.barrier()  # the last collective
    return rank


def _report_departed(rank: int) -> None:
    from bagua_lightning.engine import peer_watch

    seen = {r: f.how for r, f in sorted(peer_watch.departed().items())}
    print(f"rank {rank} saw leave: {seen}; failure: {peer_watch.failure()}", flush=True)


def finish() -> None:
    import torch.distributed as dist

    rank = _last_steps()
    if rank == 3:
        print(f"rank {rank} finished", flush=True)
        os._exit(0)  # no exit mark, nothing destroyed
    _work({0: 4.0, 1: 2.0, 2: 1.0}[rank])
    if rank == 0:
        _report_departed(rank)
    dist.destroy_process_group()  # writes the exit mark
    print(f"rank {rank} finished", flush=True)
    if rank == 2:
        os._exit(0)


def finish_mp() -> None:
    rank = _last_steps()
    if rank == 0:
        _work(4.0)
        _report_departed(rank)
    print(f"rank {rank} finished", flush=True)
    # returns: multiprocessing's exit (os._exit after its finalisers, no atexit) ends the rank


def _forked_rank(rank: int, world_size: int, port: int, scenario: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)
    if scenario == "finish_mp":
        finish_mp()
    else:
        train(scenario.removeprefix("train_"))


def in_processes(scenario: str, world_size: str) -> None:
    """Bagua's tests' way: the ranks are ``multiprocessing.Process`` children of one process."""
    from tests.procs import free_port

    ctx = multiprocessing.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_forked_rank, args=(r, int(world_size), port, scenario)) for r in range(int(world_size))]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(150)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(10)
    print(f"exit codes {[p.exitcode for p in procs]}", flush=True)


if __name__ == "__main__":
    scenarios = {"train": train, "fit": fit, "finish": finish, "mp": in_processes}
    scenarios[sys.argv[1]](*sys.argv[2:])
