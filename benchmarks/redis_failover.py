"""Failover time of the default Redis deployment: kill -9 one master, time until every slot is served again.

For each run: a fresh local cluster as ``bagua-lightning up`` starts it (3 masters, 1 replica each, TLS
bus), kill -9 of one master, then poll a live node every 10 ms until it reports ``cluster_state:ok`` and
``CLUSTER SLOTS`` assigns all 16384 slots to live masters (none to the killed address). Prints one line per
run and the median. Everything started is stopped after each run.

    python benchmarks/redis_failover.py --runs 5 [--node-timeout-ms 2000] [--replicas 1]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bagua_lightning.core.redis_server import CLUSTER_SLOTS, client_for, cluster_info
from bagua_lightning.services.redis_cluster import ClusterSpec, running_cluster


def served_by_live_masters(host: str, port: int, dead_port: int, password: str) -> bool:
    with client_for(host, port, password, timeout_s=0.5) as c:
        if cluster_info(c).get("cluster_state") != "ok":
            return False
        covered = 0
        for lo, hi, master_port in _slots(c):
            if master_port == dead_port:
                return False
            covered += hi - lo + 1
        return covered == CLUSTER_SLOTS


def _slots(c: object) -> list[tuple[int, int, int]]:
    # Raw reply: [[lo, hi, [host, port, id, ...], replicas...], ...]
    raw = c.execute_command("CLUSTER SLOTS")  # type: ignore[attr-defined]
    if isinstance(raw, dict):  # redis-py parses it into {(lo, hi): {"primary": (host, port), ...}}
        return [(lo, hi, int(v["primary"][1])) for (lo, hi), v in raw.items()]
    return [(int(e[0]), int(e[1]), int(e[2][1])) for e in raw]


def one_run(port: int, replicas: int, node_timeout_ms: int, state: Path) -> float:
    spec = ClusterSpec(nodes=3, replicas=replicas, port=port, password="failover-bench", bus_tls=True,
                       node_timeout_ms=node_timeout_ms, state_root=state, timeout_s=120)
    with running_cluster(spec) as info:
        victim = info.masters[1]
        witness = info.masters[0]
        time.sleep(1.0)  # let replication settle, as in a running deployment
        killed = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        while True:
            try:
                if served_by_live_masters(witness.host, witness.port, victim.port, "failover-bench"):
                    return time.monotonic() - killed
            except OSError:
                pass
            if time.monotonic() - killed > 120:
                raise TimeoutError("no failover within 120 s")
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--node-timeout-ms", type=int, default=ClusterSpec.node_timeout_ms)
    parser.add_argument("--port", type=int, default=24100, help="first port (bus +10000, TLS +20000)")
    args = parser.parse_args()
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            t = one_run(args.port, args.replicas, args.node_timeout_ms, Path(tmp) / str(i))
            times.append(t)
            print(f"run {i}: all {CLUSTER_SLOTS} slots served by live masters {t:.2f} s after kill -9", flush=True)
    print(f"node-timeout {args.node_timeout_ms} ms, replicas {args.replicas}: median {statistics.median(times):.2f} s, "
          f"min {min(times):.2f} s, max {max(times):.2f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
