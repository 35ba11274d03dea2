"""Autotuning follows a real fault-tolerant job: a Lighthouse, an autotune service and two torchrun nodes of
two ranks (``ElasticTraining(..., autotune=...)``); node1 is killed with SIGKILL mid-epoch.

Node0 then re-registers the job's new shape and starts on the plan another job shared for it; node1 comes
back and heals (its plan and tuner state from node0), a third shape; while both nodes trained, every step ran
one plan on every rank of both; ``autotune show`` lists the three shapes.
Every wait is bounded and every process is stopped after the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.engine.parameters import declare, trainable_parameters
from bagua_lightning.proto.plan import BucketPlan
from tests.engine.autotune.elastic_autotune_worker import JOB, MODEL, build_model
from tests.procs import free_port, stop_process, wait_until
from tests.ranks import job_env
from tests.services.conftest import FAST

WORKER = str(Path(__file__).with_name("elastic_autotune_worker.py"))
REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` in a session of its own, logging to ``log``; it and its children killed after the block."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            yield proc
        finally:
            _kill(proc)
            stop_process(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a torchrun we started and its ranks (each rank has a session of its own: found as children)."""
    if proc.poll() is not None:
        return
    children = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait(timeout=30)


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    path = out / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _seed_shared_plan(client: AutotuneClient) -> BucketPlan:
    """Another job measured one bucket per tensor on one node of two ranks: that shape's shared plan."""
    tensors = declare(trainable_parameters(build_model()))
    mine = BucketPlan(buckets=tuple((t,) for t in tensors), bucket_size=1024)
    client.register_job(MODEL, tensors, job_id="seed", world_size=2, nproc_per_node=2, resume=mine)
    client.report_metrics(MODEL, 0, 1, mine, 100.0, job_id="seed")
    client.ask_hyperparameters(MODEL, 0, 2, job_id="seed")
    wait_until(lambda: any(p.key.endswith("-w2-n2") for p in client.list_jobs()[1]), 30, "the seed's shared plan")
    return mine


@pytest.mark.slow
def test_a_killed_node_reshapes_the_job_on_the_service(tmp_path: Path, start_service: Callable[..., Any]) -> None:
    out = tmp_path / "out"
    with start_service(*FAST, "--max-samples", "4") as (target, _), AutotuneClient(target=target) as client:
        seed = _seed_shared_plan(client)
        port = free_port()
        lighthouse_cmd = [sys.executable, "-m", "bagua_lightning.cli", "lighthouse", "--port", str(port),
                          "--min-nodes", "1", "--heartbeat-timeout-ms", "1500"]
        with _process(lighthouse_cmd, tmp_path / "lighthouse.log", job_env({})):
            wait_until(lambda: b"listening" in (tmp_path / "lighthouse.log").read_bytes(), 60, "the lighthouse")
            nodes = []
            with contextlib.ExitStack() as stack:
                for i in range(2):
                    env = job_env({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
                                   "BAGUA_LIGHTNING_NODE_ID": f"node{i}", "TORCHFT_MANAGER_PORT": str(free_port())})
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "--max-restarts", "0", WORKER, "--out", str(out), "--address", target]
                    nodes.append(stack.enter_context(_process(cmd, tmp_path / f"node{i}.log", env)))

                def joint_retuned() -> bool:  # node1 ran steps with node0 on a second plan from the service
                    return sum(1 for r in _records(out, "node1-0.jsonl") if r["count"] == 2 and r["version"] >= 1) >= 2

                wait_until(joint_retuned, 240, "node1's steps together with node0 on a re-tuned plan")
                _kill(nodes[1])
                at_kill = len(_records(out, "node0-0.jsonl"))
                wait_until(lambda: sum(1 for r in _records(out, "node0-0.jsonl")[at_kill:] if r["count"] == 1) >= 15,
                           180, "node0 training alone")
                # node1 comes back: it heals from node0 (the plan and the tuner's state with it), a third shape.
                before = len(_records(out, "node1-0.jsonl"))
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                       str(free_port()), "--max-restarts", "0", WORKER, "--out", str(out), "--address", target]
                env = job_env({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "BAGUA_LIGHTNING_NODE_ID": "node1",
                               "TORCHFT_MANAGER_PORT": str(free_port())})
                back = stack.enter_context(_process(cmd, tmp_path / "node1-back.log", env))
                wait_until(lambda: sum(1 for r in _records(out, "node1-0.jsonl")[before:] if r["count"] == 2) >= 8,
                           180, "node1 training with node0 again")
                assert nodes[0].wait(300) == 0, (tmp_path / "node0.log").read_text()[-4000:]
                assert back.wait(60) == 0, (tmp_path / "node1-back.log").read_text()[-4000:]
                assert "healed from a live peer" in (tmp_path / "node1-back.log").read_text()

        # While both trained (before the kill, and after node1 healed), every rank of both nodes ran each step on
        # the same plan, with the same version.
        by_step: dict[int, set[tuple[int, str]]] = {}
        for name in ("node0-0", "node0-1", "node1-0", "node1-1"):
            for r in _records(out, f"{name}.jsonl"):
                if r["count"] == 2:
                    by_step.setdefault(r["step"], set()).add((r["version"], r["plan"]))
        assert by_step and all(len(plans) == 1 for plans in by_step.values()), by_step
        assert len({plan for p in by_step.values() for _, plan in p}) >= 2  # re-bucketed while both trained
        # Node0's two ranks ran alone on the same plan as each other, ending on the shared one's start.
        alone = [[(r["step"], r["plan"]) for r in _records(out, f"node0-{k}.jsonl") if r["count"] == 1]
                 for k in (0, 1)]
        assert alone[0] and alone[0] == alone[1]

        described = client.describe_model(MODEL, JOB)
        # node0 may have trained a few steps alone before node1 first joined: one more shape at the start.
        shapes = [(s.world_size, s.nproc_per_node) for s in described.shapes]
        assert shapes[-3:] == [(4, 2), (2, 2), (4, 2)] and shapes[:-3] in ([], [(2, 2)]), shapes
        assert described.shapes[-2].started_from == "shared" and described.summary.reshapes == len(shapes) - 1
        # After the kill node0 ran on the plan the 1-node shape started from: the seed's, unless node0's own
        # first steps alone shared a better one for that shape.
        alone_after = [r for r in _records(out, "node0-0.jsonl")[at_kill:] if r["count"] == 1]
        assert any(r["version"] == described.shapes[-2].plan_version for r in alone_after), alone_after
        if len(shapes) == 3:
            assert any(r["plan"] == seed.fingerprint() for r in alone_after)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BAGUA_LIGHTNING_")}
        show = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "autotune", "show", MODEL, "--job", JOB,
                               "--target", target], capture_output=True, text=True, timeout=120, env=env)
        assert show.returncode == 0, show.stderr
        assert f"shapes: {len(shapes) - 1} reshape(s)" in show.stdout, show.stdout
        assert "world size    4 (2 per node, 2 node(s))" in show.stdout, show.stdout
        assert "world size    2 (2 per node, 1 node(s))" in show.stdout and "(shared plan " in show.stdout
