"""``CachedDataset(hosts=None)`` on two nodes: one store over both nodes' servers.

Two network namespaces joined by a veth pair stand for two hosts (one rank each, each with its own state
folder, as on separate machines). Through ``job_servers`` the ranks exchange their node-local servers'
addresses and one password over the job's ``torch.distributed`` store; a sample computed by node 0's rank
is then a hit for node 1's rank in the same job, and in the next job (which reuses both servers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_lightning.core.local_redis import stop_server
from tests.integration.cache_two_nodes import SAMPLES
from tests.integration.netns import connected_hosts, netns_usable
from tests.procs import free_port

pytestmark = pytest.mark.netns
ADDRESSES = ("10.124.0.1", "10.124.0.2")  # only inside the namespaces this test creates


def _job(job: int, namespaces: list[str], veths: list[str], states: list[Path]) -> list[dict[str, object]]:
    port = str(free_port())
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank, (ns, veth, state) in enumerate(zip(namespaces, veths, states, strict=True)):
            env = {k: v for k, v in os.environ.items() if not k.startswith("BAGUA_LIGHTNING_")}
            env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=ADDRESSES[0], MASTER_PORT=port,
                       GLOO_SOCKET_IFNAME=veth, OMP_NUM_THREADS="1", XDG_STATE_HOME=str(state),
                       BAGUA_LIGHTNING_SERVICES_FILE=str(state / "none.json"))
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.integration.cache_two_nodes", str(job)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          cwd=Path(__file__).resolve().parents[2]))
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    results = []
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} of job {job} failed:\n{out[-4000:]}"
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


@pytest.mark.skipif(not netns_usable(), reason="needs root, `ip netns` and redis-server")
def test_a_sample_computed_on_node_0_is_a_hit_on_node_1_now_and_in_the_next_job(tmp_path: Path) -> None:
    states = [tmp_path / "node0", tmp_path / "node1"]
    try:
        with connected_hosts("blcn", ADDRESSES) as (namespaces, veths):
            first = _job(0, namespaces, veths, states)
            assert first[0]["computed"] == list(range(SAMPLES))  # node 0's rank computed every sample
            assert first[1]["computed"] == []  # ... and node 1's rank found all of them
            hosts = first[0]["hosts"]
            assert hosts == first[1]["hosts"] and [h["host"] for h in hosts] == list(ADDRESSES)  # type: ignore[index]
            assert first[0]["started_here"] and first[1]["started_here"]  # one server per node
            assert all(r["values_ok"] for r in first)

            second = _job(1, namespaces, veths, states)  # node 1's rank reads first this time
            assert second[1]["computed"] == [] and second[0]["computed"] == []
            assert second[0]["hosts"] == hosts and not second[0]["started_here"] and not second[1]["started_here"]
            assert all(r["values_ok"] for r in second)
    finally:
        for state in states:
            stop_server(state / "bagua-lightning" / "redis-local")
    assert not (states[0] / "bagua-lightning" / "redis-local").exists()
