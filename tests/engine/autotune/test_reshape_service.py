"""A job that changes shape, as the real autotune service sees it: a real server process on a free port.

The job re-registers with another world size (an elastic resize); the new shape starts from the plan
jobs share for it; ``autotune show`` lists the job's shapes and ``/metrics`` counts its reshapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from typing import Any

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.proto.plan import TensorDeclaration
from tests.procs import free_port
from tests.services.conftest import FAST

TENSORS = [TensorDeclaration(f"layer{i}.weight", 1000 * (i + 1)) for i in range(6)]
MODEL = "reshape-net"


def _show(target: str, job: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BAGUA_LIGHTNING_")}
    result = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "autotune", "show", MODEL, "--job", job,
                             "--target", target], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _reshapes(metrics_port: int, job: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("bagua_autotune_job_reshapes_total{") and f'job="{job}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _measure(client: AutotuneClient, job: str, train_iter: int) -> None:
    """One report of the plan in use and an ask: the session takes the sample and shares it as its best."""
    plan = client.ask_hyperparameters(MODEL, 0, train_iter, job_id=job).plan
    client.report_metrics(MODEL, 0, train_iter, plan, 100.0, job_id=job)
    client.ask_hyperparameters(MODEL, 0, train_iter + 1, job_id=job)


def test_a_reshaped_job_starts_from_the_shapes_shared_plan_and_shows_its_shapes(
        start_service: Callable[..., Any]) -> None:
    metrics_port = free_port()
    with start_service(*FAST, "--metrics-port", str(metrics_port)) as (target, _), \
            AutotuneClient(target=target) as client:
        # Job "a" tunes the 2 x 2 shape: its best plan becomes that shape's shared plan.
        client.register_job(MODEL, TENSORS, job_id="a", world_size=4, nproc_per_node=2)
        _measure(client, "a", 10)
        (shared,) = [p for p in client.list_jobs()[1] if p.key.endswith("-w4-n2")]
        assert shared.job_id == "a"

        # Job "b" starts on 3 nodes x 2 ranks (nothing shared for that shape), then loses a node.
        first = client.register_job(MODEL, TENSORS, job_id="b", world_size=6, nproc_per_node=2)
        _measure(client, "b", 20)
        version_before = client.describe_model(MODEL, "b").current.version
        again = client.register_job(MODEL, TENSORS, job_id="b", world_size=4, nproc_per_node=2)
        assert again.plan.version > version_before  # versions go on: the trainer re-buckets
        assert again.plan.same_layout(client.describe_model(MODEL, "a").best)  # the shape's shared plan
        # The same shape again is the same session (every node's leader may register it): no reshape.
        assert client.register_job(MODEL, TENSORS, job_id="b", world_size=4, nproc_per_node=2).plan == again.plan

        described = client.describe_model(MODEL, "b")
        assert described.summary.reshapes == 1 and described.summary.world_size == 4
        assert [(s.world_size, s.nproc_per_node, s.started_from) for s in described.shapes] == [
            (6, 2, "default"), (4, 2, "shared")]
        assert described.shapes[0].plan_version == first.plan.version
        assert described.shapes[1].plan_version == again.plan.version
        assert described.shapes[1].shared_key == shared.key
        assert _reshapes(metrics_port, "b") == 1.0
        assert _reshapes(metrics_port, "a") == 0.0

        text = _show(target, "b")
        assert "shapes: 1 reshape(s)" in text, text
        assert "world size    6 (2 per node, 3 node(s)): started on v0 (default plan)" in text, text
        assert f"world size    4 (2 per node, 2 node(s)): started on v{again.plan.version} (shared plan " \
               f"{shared.key})" in text, text
        assert "shapes:" not in _show(target, "a")  # a job that never changed shape shows none
