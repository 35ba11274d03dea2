"""A real service process: metrics over HTTP, ls/show/plot, the token file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
from PIL import Image

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.core.errors import AutotuneAuthenticationError, ModelNotRegisteredError
from bagua_lightning.services.autotune.samplelog import log_file_name
from tests.procs import free_port, wait_until
from tests.services import simulated_trainers
from tests.services.conftest import FAST, no_retry_client

MODEL = "obs/model-a"


def _tune(target: str, model: str = MODEL, rounds: int = 6, token: str | None = None) -> None:
    job = simulated_trainers.sim_job(0)
    with AutotuneClient(target=target, token=token) as client:
        client.register_tensors(model, job.tensors, world_size=2, nproc_per_node=2)
        for it in range(rounds):
            answer = client.ask_hyperparameters(model, 0, it)
            if answer.completed:
                break
            speed, timings, backward_ms = job.measure(answer.plan)
            client.report_metrics(model, 0, it, answer.plan, speed, timings, backward_ms=backward_ms, ranks=2,
                                  speed_min=speed * 0.9, speed_max=speed * 1.1, speed_stddev=speed * 0.05)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "autotune", *args], capture_output=True,
                          text=True, timeout=120, env=env or dict(os.environ))


def test_metrics_ls_show_and_plot_against_a_real_service(start_service, tmp_path: Path) -> None:
    metrics_port = free_port()
    logs = tmp_path / "samples"
    with start_service(*FAST, "--max-samples", "4", "--metrics-port", str(metrics_port), "--log-dir",
                       str(logs)) as (target, _):
        _tune(target)
        with no_retry_client(target) as client, pytest.raises(Exception):  # noqa: B017
            client.ask_hyperparameters("nobody", 0, 0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'bagua_autotune_rpcs_total{code="OK",method="ReportMetrics"}' in text
        assert 'bagua_autotune_rpcs_total{code="NOT_FOUND",method="AskHyperparameters"} 1.0' in text
        assert 'bagua_autotune_rpc_seconds_bucket{le="0.001",method="AskHyperparameters"}' in text
        assert "bagua_autotune_models 1.0" in text and "bagua_autotune_healthy 1.0" in text
        plans_issued = next(line for line in text.splitlines() if line.startswith("bagua_autotune_plans_issued_"))
        assert float(plans_issued.split()[-1]) >= 2

        ls = _cli("ls", "--target", target)
        assert ls.returncode == 0, ls.stderr
        assert MODEL in ls.stdout and "completed" in ls.stdout
        show = _cli("show", MODEL, "--target", target)
        assert show.returncode == 0, show.stderr
        assert "best plan v" in show.stdout and show.stdout.count("\n") >= 8  # header, plans, 4 samples
        missing = _cli("show", "nobody", "--target", target)
        assert missing.returncode != 0 and "'nobody' is not registered" in missing.stderr
        png = tmp_path / "plot.png"
        plot = _cli("plot", MODEL, "-o", str(png), "--target", target)
        assert plot.returncode == 0, plot.stderr
        assert Image.open(png).size[0] > 400
    # From the sample log once the service is gone.
    offline = tmp_path / "offline.png"
    plot = _cli("plot", MODEL, "-o", str(offline), "--log-file", str(logs / log_file_name(MODEL)))
    assert plot.returncode == 0, plot.stderr
    assert Image.open(offline).size == Image.open(png).size


def test_token_file_protects_every_call_but_health(start_service, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")
    token_file.chmod(0o644)  # readable by others: refused, in one line naming the file and the fix
    shared = _cli("serve", "--port", str(free_port()), "--token-file", str(token_file))
    assert shared.returncode != 0 and str(token_file) in shared.stderr and "chmod go-rwx" in shared.stderr
    assert "Traceback" not in shared.stderr
    token_file.chmod(0o600)
    with start_service("--token-file", str(token_file), *FAST) as (target, _):
        with no_retry_client(target) as anonymous:
            assert anonymous.health_check() is True
            with pytest.raises(AutotuneAuthenticationError):
                anonymous.list_models()
        _tune(target, token="tok-123", rounds=2)
        env = {**os.environ, "BAGUA_LIGHTNING_AUTOTUNE_TOKEN": "tok-123"}
        assert MODEL in _cli("ls", "--target", target, env=env).stdout
        assert _cli("ls", "--target", target).returncode != 0
    token_file.write_text("")
    empty = _cli("serve", "--port", str(free_port()), "--token-file", str(token_file))
    assert empty.returncode != 0 and "is empty" in empty.stderr


@pytest.mark.parametrize("kind", ["threads", "aio"])
def test_both_server_kinds_serve_refuse_and_check_tokens(start_service, tmp_path: Path, kind: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-9")
    token_file.chmod(0o600)
    with start_service("--server", kind, "--token-file", str(token_file), *FAST) as (target, _):
        with no_retry_client(target) as anonymous:
            assert anonymous.health_check() is True
            with pytest.raises(AutotuneAuthenticationError):
                anonymous.register_tensors("m", simulated_trainers.abcde())
        with AutotuneClient(target=target, token="tok-9") as client:
            plan = client.register_tensors("m", simulated_trainers.abcde(), world_size=1)
            assert client.report_metrics("m", 0, 0, plan, 10.0) is True
            with pytest.raises(ModelNotRegisteredError):
                client.describe_model("other")
            assert client.describe_model("m").summary.reports_accepted == 1


def test_tuning_workers_exit_with_a_killed_service(start_service) -> None:
    with start_service("--warmup-time-s", "0", "--sampling-confidence-time-s", "0", "--tuning-processes", "1") \
            as (target, proc):
        _tune(target, rounds=8)  # proposals: the worker process is started
        workers = psutil.Process(proc.pid).children(recursive=True)  # type: ignore[attr-defined]
        assert workers
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        proc.wait(timeout=10)  # type: ignore[attr-defined]
        wait_until(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 30.0,
                   "the tuning workers to exit after their service")
