"""What a lost node costs: fault-tolerant training against torchrun's restart-from-checkpoint way.

    python benchmarks/failover_training.py                       # 2 nodes x 1 rank on CPU, Gloo
    python benchmarks/failover_training.py --samples 4800 --kill-at 20 --down-s 10 --json out.json

Four whole jobs on the same seeded task (a regression MLP, ``examples/elastic_train.py``'s), one after the
other on the same machine (different launchers cannot share a process: ../shared/MEASURING.md, item 6):

(a) fault tolerant, uninterrupted;
(b) fault tolerant, node1 killed (kill -9 of its launcher and ranks) after its ``--kill-at``-th committed
    step and started again ``--down-s`` seconds later: it heals from node0;
(c0) the anchor, uninterrupted: Lightning under ``torchrun --nnodes 1:2`` (c10d rendezvous), a checkpoint
    every ``--ckpt-every`` steps;
(c) the anchor with the same failure: the job ends, and is launched again whole ``--down-s`` later; it
    resumes from its last checkpoint. (With ``--max-restarts 3`` the survivor's re-rendezvous counted the
    dead agent in and timed out after 60 s, in 3 runs of 3 on this host: see ``run_anchor``.)

Reported per failure: the time lost (wall time of the failed run minus its uninterrupted one), the steps
redone, and the final loss (MSE of the final weights on the whole data set) against the uninterrupted run.
One run of each: the wall times carry the machine's drift (a few seconds on a shared 2-core VM).
The per-step cost of fault tolerance when nothing fails is measured interleaved, in the same processes, by
``benchmarks/ft_step_cost.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Proc:
    """A launcher we started, in a session of its own; signalled with its children (its ranks)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._fh = log.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self) -> None:
        if self.proc.poll() is not None:
            return
        children = psutil.Process(self.proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._fh.flush()


def _job_ended(node0: _Proc, node1: _Proc, start: float) -> float:
    """Wait for node0 to finish the job (then node1); the job's wall time since ``start``."""
    if node0.wait(900) != 0:
        raise RuntimeError(f"node0 failed; see {node0.log}")
    wall = time.monotonic() - start
    node1.wait(120)
    return wall


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _final_loss(weights: Path, samples: int, hidden: int, seed: int) -> float:
    from bagua_lightning.examples.elastic_train import _data

    x, y = _data(samples, 16, seed)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    state = torch.load(weights, weights_only=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


# ---------------------------------------------------------------------------- (a), (b): fault tolerant


def run_fault_tolerant(work: Path, args: argparse.Namespace, fail: bool) -> dict[str, Any]:
    out = work / "out"
    port = _free_port()
    lighthouse = _Proc([sys.executable, "-m", "bagua_lightning.cli", "lighthouse", "--port", str(port),
                        "--heartbeat-timeout-ms", "1500"], _env({}), work / "lighthouse.log")
    job = ["--out", str(out), "--samples", str(args.samples), "--step-sleep", str(args.step_sleep),
           "--timeout", "5"]

    def node(i: int, tag: str) -> _Proc:
        env = _env({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "BAGUA_LIGHTNING_NODE_ID": f"node{i}"})
        return _Proc([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                      str(_free_port()), "--max-restarts", "0", "-m", "bagua_lightning.examples.elastic_train",
                      *job], env, work / f"node{i}{tag}.log")

    procs = [lighthouse]
    try:
        _wait_for(lambda: b"listening" in (work / "lighthouse.log").read_bytes(), 60, "the lighthouse")
        start = time.monotonic()
        node0, node1 = node(0, ""), node(1, "")
        procs += [node0, node1]
        if fail:
            _wait_for(lambda: _lines(out / "node1-0.jsonl") >= args.kill_at, 300, "node1's kill step")
            node1.kill()
            time.sleep(args.down_s)
            node1 = node(1, "-back")
            procs.append(node1)
        wall = _job_ended(node0, node1, start)
    finally:
        for p in reversed(procs):
            p.kill()
    redone = sum(int(line.rsplit("redone ", 1)[1]) for line in (work / "node0.log").read_text().splitlines()
                 if "redone " in line)
    # The stall: node0's longest gap between two committed steps, less its median gap (detection, the new
    # quorum, a redone step; healing when node1 returns).
    times = [json.loads(line)["t"] for line in (out / "node0-0.jsonl").read_text().splitlines()]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    stall = gaps[-1] - gaps[len(gaps) // 2] if gaps else 0.0
    return {"wall_s": wall, "steps_redone": redone, "stall_s": stall,
            "final_loss": _final_loss(out / "node0-0.final.pt", args.samples, 64, 0)}


# ---------------------------------------------------------------------------- (c0), (c): the anchor


ANCHOR = r'''
import os, sys, json, time
from pathlib import Path
import torch, lightning as L
from torch import nn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from bagua_lightning.examples.elastic_train import _data

out, samples, batch, every, sleep = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
x, y = _data(samples, 16, 0)

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    def training_step(self, b, i):
        time.sleep(sleep)
        return nn.functional.mse_loss(self.model(b[0]), b[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

class Progress(Callback):
    def on_train_batch_end(self, trainer, *a):
        if trainer.global_rank == 0:
            with (out / "progress.jsonl").open("a") as f:
                f.write(json.dumps({"step": trainer.global_step, "t": time.time(), "pid": os.getpid()}) + "\n")

torch.manual_seed(0)
world = int(os.environ["WORLD_SIZE"])
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True)
ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=every, save_last=True, save_top_k=0)
trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=world, strategy="ddp", max_steps=samples // (batch * 2),
                    callbacks=[ckpt, Progress()], logger=False, enable_progress_bar=False,
                    enable_model_summary=False, use_distributed_sampler=True)
last = out / "ckpt" / "last.ckpt"
trainer.fit(Net(), data, ckpt_path=str(last) if last.exists() else None)
if trainer.global_rank == 0:
    torch.save(trainer.lightning_module.state_dict(), out / "final.pt")
'''


def run_anchor(work: Path, args: argparse.Namespace, fail: bool) -> dict[str, Any]:
    out = work / "out"
    out.mkdir(parents=True)
    script = work / "anchor.py"
    script.write_text(ANCHOR)

    def node(i: int, tag: str, port: int) -> _Proc:
        # Each agent its own loopback address: on one address both take themselves for the rendezvous host.
        # --max-restarts 0: with restarts, the survivor's agent re-rendezvoused with the dead agent still
        # counted in and timed out after 60 s (3 runs of 3, also with a 5 s monitor interval and 3 s keep-alive);
        # so a failed job is relaunched whole, as its scheduler (or Bagua's elastic example) does.
        return _Proc([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
                      "--local-addr", f"127.0.0.{i + 1}", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"127.0.0.1:{port}", "--max-restarts", "0", "--rdzv-conf", "join_timeout=60,last_call_timeout=1",
                      str(script), str(out), str(args.samples), str(args.batch_size), str(args.ckpt_every),
                      str(args.step_sleep)], _env({}), work / f"anchor{i}{tag}.log")

    progress = out / "progress.jsonl"

    def step() -> int:
        lines = progress.read_text().splitlines() if progress.exists() else []
        return json.loads(lines[-1])["step"] if lines else 0

    procs: list[_Proc] = []
    try:
        start = time.monotonic()
        port = _free_port()
        node0 = node(0, "", port)
        time.sleep(0.5)  # node0 hosts the rendezvous store
        node1 = node(1, "", port)
        procs += [node0, node1]
        if fail:
            _wait_for(lambda: step() >= args.kill_at, 300, "the anchor's kill step")
            node1.kill()
            node0.wait(120)  # its worker's collective fails; without restarts the job ends
            time.sleep(args.down_s)
            port = _free_port()
            node0 = node(0, "-again", port)  # the whole job again, resuming from the last checkpoint
            time.sleep(0.5)
            node1 = node(1, "-back", port)
            procs += [node0, node1]
        wall = _job_ended(node0, node1, start)
    finally:
        for p in reversed(procs):
            p.kill()
    steps = [json.loads(line)["step"] for line in progress.read_text().splitlines()]
    redone = sum(max(0, prev - cur + 1) for prev, cur in itertools.pairwise(steps) if cur <= prev)
    return {"wall_s": wall, "steps_redone": redone,
            "final_loss": _final_loss(out / "final.pt", args.samples, 64, 0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--kill-at", type=int, default=40, help="node1's committed steps before it is killed")
    p.add_argument("--down-s", type=float, default=10.0, help="seconds before the killed node starts again")
    p.add_argument("--ckpt-every", type=int, default=25, help="the anchor's checkpoint interval in steps")
    p.add_argument("--only", default="a,b,c0,c")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    runs = {"a": (run_fault_tolerant, False), "b": (run_fault_tolerant, True),
            "c0": (run_anchor, False), "c": (run_anchor, True)}
    results: dict[str, dict[str, Any]] = {}
    for name in args.only.split(","):
        fn, fail = runs[name]
        work = Path(tempfile.mkdtemp(prefix=f"failover-{name}-"))
        results[name] = fn(work, args, fail)  # on a failure the folder (its logs) is kept and named
        shutil.rmtree(work, ignore_errors=True)
        print(f"({name}) {results[name]}", flush=True)
    if {"a", "b"} <= results.keys():
        lost = results["b"]["wall_s"] - results["a"]["wall_s"]
        print(f"fault tolerant: time lost per failure {lost:.1f} s, steps redone {results['b']['steps_redone']}, "
              f"final loss {results['b']['final_loss']:.4f} vs {results['a']['final_loss']:.4f} uninterrupted")
        results["ft_lost_s"] = {"value": lost}
    if {"c0", "c"} <= results.keys():
        lost_c = results["c"]["wall_s"] - results["c0"]["wall_s"]
        print(f"torchrun restart: time lost per failure {lost_c:.1f} s, steps redone {results['c']['steps_redone']}, "
              f"final loss {results['c']['final_loss']:.4f} vs {results['c0']['final_loss']:.4f} uninterrupted")
        results["anchor_lost_s"] = {"value": lost_c}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
