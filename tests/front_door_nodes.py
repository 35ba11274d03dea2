"""The kill -9 and heal scenario of tests/engine/test_fault_tolerance.py, for the other front doors' examples.

Nodes are that file's ``_Node`` (one torchrun in its own process group; killing a node is ``killpg``)
launching another example module; the Lighthouse, the records and the checks are that file's too.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from tests.engine.test_fault_tolerance import (
    REPO,
    _final,
    _lighthouse,
    _Node,
    _nodes,
    _records,
    _trained_indices,
)
from tests.procs import free_port, wait_until
from tests.ranks import job_env


class DoorNode(_Node):
    """A ``_Node`` that trains ``module`` (an example taking ``--out`` and the same options) instead."""

    def __init__(self, tmp_path: Path, lighthouse: str, node: int, ranks: int, module: str, *args: str) -> None:
        self.name, self.ranks, self.out, self.lighthouse = f"node{node}", ranks, tmp_path / "out", lighthouse
        self.module = module
        self.log_path = tmp_path / f"node{node}-{len(list(tmp_path.glob(f'node{node}*.log')))}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        env = job_env({"TORCHFT_LIGHTHOUSE": lighthouse, "BAGUA_LIGHTNING_NODE_ID": self.name,
                       "TORCHFT_MANAGER_PORT": str(free_port())})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
             str(free_port()), "--max-restarts", "0", "-m", module, "--out", str(self.out), *args],
            env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def two_door_nodes(tmp_path: Path, module: str, args: tuple[str, ...], *,
                   ready: tuple[int, int]) -> Iterator[tuple[DoorNode, DoorNode]]:
    """A Lighthouse and node0, node1 of 2 ranks training ``module``, yielded once node ``ready[0]`` has
    committed ``ready[1]`` steps together with the other; every process is stopped after the block."""
    with _lighthouse(tmp_path) as (lighthouse, _):
        nodes = (DoorNode(tmp_path, lighthouse, 0, 2, module, *args), DoorNode(tmp_path, lighthouse, 1, 2, module, *args))
        with _nodes(*nodes):
            node, steps = ready
            wait_until(lambda: nodes[node].joint() >= steps, 180, f"node{node}'s step {steps} with the other")
            yield nodes


def kill_and_heal(tmp_path: Path, module: str, samples: int, *extra: str) -> tuple[DoorNode, DoorNode]:
    """kill -9 node1 (both ranks) mid-epoch; node0 trains on alone; node1 starts again and heals; both end.

    Checks what every front door promises: every index of the epoch trained exactly once (over the steps
    whose update lives on), node0 trained in a quorum of its own, the returning node healed from a live
    peer, and it ends with node0's weights, rank for rank. Returns the two nodes (node1: the returned one).
    A ``samples`` that is no multiple of a step's 8 or 16 indices leaves some ranks an empty share of the
    epoch's last step (they still take part in its collectives).
    """
    args = ("--samples", str(samples), "--step-sleep", "0.12", "--timeout", "5", *extra)
    out = tmp_path / "out"
    with two_door_nodes(tmp_path, module, args, ready=(1, 6)) as (node0, node1):
        node1.signal(signal.SIGKILL)
        node1.wait(30)
        at_kill = node0.committed()
        wait_until(lambda: node0.committed() >= at_kill + 5, 60, "node0 training on without node1")
        assert any(r["nodes"] == ["node0"] for r in _records(out)), "node0 never trained in a quorum of its own"
        back = DoorNode(tmp_path, node0.lighthouse, 1, 2, module, *args)
        with _nodes(back):
            assert node0.wait(240) == 0, node0.text()[-4000:]
            assert back.wait(60) == 0, back.text()[-4000:]
            assert "healed from a live peer" in back.text(), back.text()[-4000:]
    assert _trained_indices(out) == list(range(samples))
    for r in (0, 1):
        a, b = _final(out, f"node0-{r}"), _final(out, f"node1-{r}")
        assert all(torch.equal(a[k], b[k]) for k in a), f"local rank {r}: the healed node's weights differ"
    return node0, back
