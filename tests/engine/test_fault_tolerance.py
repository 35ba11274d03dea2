"""Fault-tolerant training with real processes: a Lighthouse, nodes launched by torchrun, real kills.

Every node is its own ``torchrun`` in its own process group (what a node is: one launcher); killing a
node is ``killpg`` of that group. Every wait is bounded and every process is stopped after the test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.fault_tolerance import (
    ElasticSampler,
    FaultTolerance,
    Membership,
    PeerCheckpointTransport,
)
from tests.procs import free_port, stop_process, wait_until
from tests.ranks import job_env

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- without processes


def test_settings_are_checked_naming_the_value(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # no deployment's services file names a Lighthouse
    monkeypatch.delenv("BAGUA_LIGHTNING_SERVICES_FILE", raising=False)
    with pytest.raises(ConfigurationError, match=r"min_nodes=0.*>= 1"):
        FaultTolerance(min_nodes=0)
    with pytest.raises(ConfigurationError, match=r"max_nodes=1.*min_nodes=2"):
        FaultTolerance(min_nodes=2, max_nodes=1)
    with pytest.raises(ConfigurationError, match=r"timeout_s=0"):
        FaultTolerance(timeout_s=0)
    with pytest.raises(ConfigurationError, match=r"node_id='node'.*ending in"):
        FaultTolerance(node_id="node")
    with pytest.raises(ConfigurationError, match="TORCHFT_LIGHTHOUSE"):
        FaultTolerance(node_id="node0").resolved()


def test_the_sampler_re_deals_the_rest_of_the_epoch_over_the_nodes_left() -> None:
    sampler = ElasticSampler(50, 3, seed=7)
    seen: list[int] = []
    counts = [3, 3, 2, 2, 2, 1, 1, 2, 3, 3, 3, 3, 3, 3]  # nodes of each step: some leave, some come back
    step = 0
    while not sampler.epoch_done:
        count = counts[min(step, len(counts) - 1)]
        membership = Membership(index=0, count=count, step=step, nodes=())
        for node in range(count):
            for rank in range(2):
                seen += sampler.indices(Membership(node, count, step, ()), rank, 2)
        if step % 4 == 3:  # a step that failed is redone: nothing recorded, the position stays
            seen = seen[: len(seen) - len([i for n in range(count) for r in range(2)
                                           for i in sampler.indices(Membership(n, count, step, ()), r, 2)])]
        else:
            sampler.advance(membership, 2)
        step += 1
    assert sorted(seen) == list(range(50))
    assert sampler.state_dict() == {"epoch": 0, "position": 50}
    sampler.next_epoch()
    assert sampler.state_dict() == {"epoch": 1, "position": 0} and not sampler.epoch_done


@pytest.mark.parametrize("name", ["qadam", "low_precision_decentralized", "async"])
def test_algorithms_that_cannot_are_refused_at_construction_with_the_reason(name: str) -> None:
    from bagua_lightning.engine.algorithms.base import get_algorithm_class
    from bagua_lightning.engine.elastic import ElasticTraining

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cls = get_algorithm_class(name)
    algorithm = cls() if name != "qadam" else cls.__new__(cls)  # qadam's own constructor needs its optimizer
    with pytest.raises(ConfigurationError, match=f"algorithm '{name}' cannot train fault-tolerantly: "):
        ElasticTraining(model, optimizer, algorithm, ElasticSampler(8, 2), FaultTolerance(node_id="node0"))


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/bagua-lightning-pwned",))


def test_healing_state_is_loaded_as_tensors_and_values_never_as_a_pickle() -> None:
    from datetime import timedelta

    server = PeerCheckpointTransport("127.0.0.1", timedelta(seconds=5))
    try:
        state = {"w": torch.arange(4.0), "step": 3, "plan": {"buckets": [["a", "b"]]}}
        server.send_checkpoint([1], 3, state, timedelta(seconds=5))
        got = server.recv_checkpoint(0, server.metadata(), 3, timedelta(seconds=5))
        assert torch.equal(got["w"], state["w"]) and got["step"] == 3 and got["plan"] == state["plan"]
        assert server.metadata().startswith("http://127.0.0.1:")
        # A peer that serves a pickle of anything else is refused, and nothing of it runs.
        buffer = io.BytesIO()
        torch.save({"x": _Evil()}, buffer)
        with server._lock:
            server._payload, server._step, server._allowed = buffer.getvalue(), 4, True
        with pytest.raises(pickle.UnpicklingError, match=r"Weights only load failed|Unsupported global"):
            server.recv_checkpoint(0, server.metadata(), 4, timedelta(seconds=5))
        assert not Path("/tmp/bagua-lightning-pwned").exists()
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------- real nodes


@contextlib.contextmanager
def _lighthouse(tmp_path: Path, min_nodes: int = 1) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = open(tmp_path / "lighthouse.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "bagua_lightning.cli", "lighthouse", "--port", str(port),
                             "--min-nodes", str(min_nodes), "--heartbeat-timeout-ms", "1500"],
                            env=job_env({}), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: b"listening" in (tmp_path / "lighthouse.log").read_bytes(), 60, "the lighthouse")
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_process(proc)
        log.close()


class _Node:
    """One node: a torchrun of ``ranks`` processes training examples/elastic_train.py, in its own group."""

    def __init__(self, tmp_path: Path, lighthouse: str, node: int, ranks: int, *args: str) -> None:
        self.name, self.ranks, self.out, self.lighthouse = f"node{node}", ranks, tmp_path / "out", lighthouse
        self.log_path = tmp_path / f"node{node}-{len(list(tmp_path.glob(f'node{node}*.log')))}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        env = job_env({"TORCHFT_LIGHTHOUSE": lighthouse, "BAGUA_LIGHTNING_NODE_ID": self.name,
                       "TORCHFT_MANAGER_PORT": str(free_port())})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
             str(free_port()), "--max-restarts", "0", "-m", "bagua_lightning.examples.elastic_train",
             "--out", str(self.out), *args],
            env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def committed(self) -> int:
        path = self.out / f"{self.name}-0.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def joint(self) -> int:
        """Steps this node committed in a quorum with another node (not alone, before the other joined)."""
        path = self.out / f"{self.name}-0.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return sum(1 for line in lines if json.loads(line)["count"] >= 2)

    def signal(self, sig: int) -> None:
        """``sig`` to the whole node: the torchrun we started and its ranks (torchrun starts each rank in a
        session of its own, so the ranks are found as its children, before the first signal)."""
        ranks = psutil.Process(self.proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        for child in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


@contextlib.contextmanager
def _nodes(*nodes: _Node) -> Iterator[None]:
    try:
        yield
    finally:
        for node in nodes:
            node.stop()


@contextlib.contextmanager
def _two_nodes(tmp_path: Path, ranks: int, args: tuple[str, ...], *, ready: tuple[int, int],
               min_nodes: int = 1) -> Iterator[tuple[_Node, _Node, subprocess.Popen[bytes]]]:
    """A Lighthouse and node0, node1 of ``ranks`` ranks each, yielded once node ``ready[0]`` has committed
    ``ready[1]`` steps together with the other (so no fault lands while a node is still joining); every
    process is stopped after the block."""
    with _lighthouse(tmp_path, min_nodes=min_nodes) as (lighthouse, lighthouse_proc):
        nodes = (_Node(tmp_path, lighthouse, 0, ranks, *args), _Node(tmp_path, lighthouse, 1, ranks, *args))
        with _nodes(*nodes):
            node, steps = ready
            wait_until(lambda: nodes[node].joint() >= steps, 180, f"node{node}'s step {steps} with the other")
            yield nodes[0], nodes[1], lighthouse_proc


def _records(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines()]


def _trained_indices(out: Path) -> list[int]:
    """Every index whose step's update lives on: per step number, the indices of the whole step as the last
    quorum that committed it recorded them (any rank of it: a rank that died after the step's allreduce
    wrote no record of its own share, though its gradients are in the update; a node that committed a
    step its peers redid died with that update)."""
    by_step: dict[int, dict[tuple[int, tuple[str, ...]], list[dict[str, object]]]] = {}
    for r in _records(out):
        by_step.setdefault(int(r["step"]), {}).setdefault((int(r["count"]), tuple(r["nodes"])), []).append(r)
    indices: list[int] = []
    for groups in by_step.values():
        latest = max(groups.values(), key=lambda rs: max(float(r["t"]) for r in rs))
        assert len({tuple(r["step_indices"]) for r in latest}) == 1, latest  # every rank of it agrees
        indices += latest[0]["step_indices"]
    return sorted(indices)


def _final(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.final.pt", weights_only=True)


def _assert_one_set_of_weights(out: Path, names: list[str]) -> None:
    """Every rank named ends with the same weights, bit for bit: the ranks inside a node and across nodes."""
    first = _final(out, names[0])
    for name in names[1:]:
        other = _final(out, name)
        assert all(torch.equal(first[k], other[k]) for k in first), f"{name} differs from {names[0]}"


@pytest.mark.slow
def test_nodes_that_start_together_hold_one_set_of_weights_on_every_rank(tmp_path: Path) -> None:
    """2 nodes x 2 ranks, different initial weights on every rank, joining the first quorum together (the
    Lighthouse waits for both): torchft's initial sync takes each local rank's state from a different node,
    and the node then gives its ranks local rank 0's; every rank checks its node's ranks after every step."""
    args = ("--samples", "320", "--step-sleep", "0", "--min-nodes", "2", "--check-ranks")
    with _lighthouse(tmp_path, min_nodes=2) as (lighthouse, _):
        nodes = [_Node(tmp_path, lighthouse, i, 2, *args) for i in range(2)]
        with _nodes(*nodes):
            for node in nodes:
                assert node.wait(240) == 0, node.text()[-4000:]
    first = json.loads((tmp_path / "out" / "node0-0.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["count"] == 2, first  # the first step was the two nodes' together
    assert "took local rank 0's state" in nodes[0].text() + nodes[1].text()
    assert _trained_indices(tmp_path / "out") == list(range(320))
    _assert_one_set_of_weights(tmp_path / "out", ["node0-0", "node0-1", "node1-0", "node1-1"])


@pytest.mark.slow
def test_a_killed_node_leaves_the_others_training_and_heals_from_a_live_peer_when_back(tmp_path: Path) -> None:
    """2 nodes x 2 ranks; kill -9 node1 mid-epoch; node0 trains on alone; node1 comes back, heals, and ends
    the epoch with node0's weights; every sample of the epoch was trained on exactly once."""
    args = ("--samples", "2400", "--step-sleep", "0.15", "--timeout", "5", "--check-ranks")
    with _two_nodes(tmp_path, 2, args, ready=(1, 8)) as (node0, node1, _):
        node1.signal(signal.SIGKILL)
        node1.wait(30)
        at_kill = node0.committed()
        wait_until(lambda: node0.committed() >= at_kill + 5, 60, "node0 training on without node1")
        alone = [r for r in _records(tmp_path / "out") if r["nodes"] == ["node0"]]
        assert alone, "node0 never trained in a quorum of its own"
        back = _Node(tmp_path, node0.lighthouse, 1, 2, *args)
        with _nodes(back):
            assert node0.wait(240) == 0, node0.text()[-4000:]
            assert back.wait(60) == 0, back.text()[-4000:]
            assert "healed from a live peer" in back.text()
    assert _trained_indices(tmp_path / "out") == list(range(2400))
    # One set of weights: the healed node's ranks equal the survivor's, and the ranks inside each node equal
    # each other (--check-ranks also checked the latter after every committed step).
    _assert_one_set_of_weights(tmp_path / "out", ["node0-0", "node0-1", "node1-0", "node1-1"])


@pytest.mark.slow
def test_decentralized_trains_on_without_a_killed_node_and_its_averages_cross_the_nodes(tmp_path: Path) -> None:
    """decentralized under fault tolerance, 2 nodes x 2 ranks: kill -9 node1, node0 trains on, node1 comes back
    and heals; every index once; the last committed step's averaged weights (applied on commit, before each
    rank's own optimizer step) are one set on all four ranks, so the average crossed the nodes."""
    args = ("--samples", "1600", "--step-sleep", "0.15", "--timeout", "5", "--algorithm", "decentralized")
    with _two_nodes(tmp_path, 2, args, ready=(1, 6)) as (node0, node1, _):
        node1.signal(signal.SIGKILL)
        node1.wait(30)
        at_kill = node0.committed()
        wait_until(lambda: node0.committed() >= at_kill + 4, 60, "node0 training on without node1")
        back = _Node(tmp_path, node0.lighthouse, 1, 2, *args)
        with _nodes(back):
            assert node0.wait(240) == 0, node0.text()[-4000:]
            assert back.wait(60) == 0, back.text()[-4000:]
            assert "healed from a live peer" in back.text()
    out = tmp_path / "out"
    assert _trained_indices(out) == list(range(1600))
    averages = {name: torch.load(out / f"{name}.peer.pt", weights_only=True)
                for name in ["node0-0", "node0-1", "node1-0", "node1-1"]}
    first = averages["node0-0"]
    assert first, "no averaged weights were applied"
    for name, other in averages.items():
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True)), f"{name}'s average differs"
    # each rank then applied its own gradient: the final weights are the rank's own, not one set
    finals = [_final(out, name) for name in averages]
    assert any(not torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])


@pytest.mark.slow
def test_below_min_nodes_the_job_ends_naming_the_lost_node(tmp_path: Path) -> None:
    args = ("--samples", "4000", "--step-sleep", "0.05", "--min-nodes", "2", "--timeout", "3",
            "--quorum-timeout", "6")
    with _two_nodes(tmp_path, 1, args, ready=(0, 5), min_nodes=2) as (node0, node1, _):
        node1.signal(signal.SIGKILL)
        code = node0.wait(90)  # bounded: quorum_timeout plus a step's timeout, not the default 60 s
    text = node0.text()
    assert code != 0
    assert "FaultToleranceError" in text and "min_nodes=2" in text and "lost: ['node1']" in text, text[-3000:]


@pytest.mark.slow
def test_a_killed_coordinator_ends_the_job_cleanly(tmp_path: Path) -> None:
    args = ("--samples", "4000", "--step-sleep", "0.05", "--timeout", "3", "--quorum-timeout", "6")
    with _two_nodes(tmp_path, 1, args, ready=(0, 5)) as (node0, node1, lighthouse_proc):
        os.killpg(lighthouse_proc.pid, signal.SIGKILL)
        codes = [node0.wait(90), node1.wait(90)]
    assert all(c != 0 for c in codes)
    for node in (node0, node1):
        assert "FaultToleranceError" in node.text() and "coordinator" in node.text(), node.text()[-3000:]


@pytest.mark.slow
def test_a_stopped_node_is_dropped_and_after_sigcont_heals_without_corrupting_the_group(tmp_path: Path) -> None:
    args = ("--samples", "1200", "--step-sleep", "0.05", "--timeout", "3")
    with _two_nodes(tmp_path, 1, args, ready=(1, 5)) as (node0, node1, _):
        node1.signal(signal.SIGSTOP)
        at_stop = node0.committed()
        wait_until(lambda: node0.committed() >= at_stop + 5, 60, "node0 training on while node1 is stopped")
        node1.signal(signal.SIGCONT)
        assert node0.wait(240) == 0, node0.text()[-4000:]
        assert node1.wait(60) == 0, node1.text()[-4000:]
    assert _trained_indices(tmp_path / "out") == list(range(1200))
    a, b = _final(tmp_path / "out", "node0-0"), _final(tmp_path / "out", "node1-0")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_single_killed_rank_takes_its_node_out_and_the_others_finish_the_epoch(tmp_path: Path) -> None:
    args = ("--samples", "800", "--step-sleep", "0.05", "--timeout", "5", "--check-ranks")
    with _two_nodes(tmp_path, 2, args, ready=(1, 5)) as (node0, node1, _):
        ranks = psutil.Process(node1.proc.pid).children(recursive=True)
        rank1 = next(p for p in ranks if "elastic_train" in " ".join(p.cmdline())
                     and p.environ().get("LOCAL_RANK") == "1")
        rank1.kill()  # one rank of node1; torchrun (no restarts) then ends the node's other rank
        assert node1.wait(60) != 0
        assert node0.wait(240) == 0, node0.text()[-4000:]
    assert _trained_indices(tmp_path / "out") == list(range(800))
    assert any(r["nodes"] == ["node0"] for r in _records(tmp_path / "out"))
    _assert_one_set_of_weights(tmp_path / "out", ["node0-0", "node0-1"])


@pytest.mark.slow
def test_a_node_lost_while_another_joins_leaves_one_healed_group(tmp_path: Path) -> None:
    """3 nodes; node2 is killed and started again, and node1 is killed while node2 is on its way back:
    node0 trains on, node2 heals from it, and they end the epoch with equal weights."""
    args = ("--samples", "1800", "--step-sleep", "0.1", "--timeout", "5")
    with _lighthouse(tmp_path) as (lighthouse, _):
        nodes = [_Node(tmp_path, lighthouse, i, 1, *args) for i in range(3)]
        with _nodes(*nodes):
            wait_until(lambda: nodes[2].committed() >= 5, 180, "node2's 5th committed step")
            nodes[2].signal(signal.SIGKILL)
            nodes[2].wait(30)
            back = _Node(tmp_path, lighthouse, 2, 1, *args)
            with _nodes(back):
                nodes[1].signal(signal.SIGKILL)  # while node2 starts up and heals
                nodes[1].wait(30)
                assert nodes[0].wait(300) == 0, nodes[0].text()[-4000:]
                assert back.wait(60) == 0, back.text()[-4000:]
                assert "healed from a live peer" in back.text()
    assert _trained_indices(tmp_path / "out") == list(range(1800))
    a, b = _final(tmp_path / "out", "node0-0"), _final(tmp_path / "out", "node2-0")
    assert all(torch.equal(a[k], b[k]) for k in a)
