"""``algorithm="auto"``'s choice on the autotune service: reported, shown by ``autotune show``, exported as
metrics, kept with the shape's best plan across a restart, and bad reports refused with INVALID_ARGUMENT."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.engine.autotune.selection import Selection
from bagua_lightning.engine.autotune.worker import AutotuneWorker, Job
from bagua_lightning.proto.autotune.v1 import autotune_pb2 as pb
from tests.procs import free_port
from tests.services import simulated_trainers
from tests.services.conftest import FAST, raw_stub

STEP_MS = {"gradient_allreduce": 170.0, "bytegrad": 48.125}
REASON = "bytegrad: 48.1 ms/step (kept); gradient_allreduce: 170.0 ms/step (3.53x slower)"


def _tune_to_completion(client: AutotuneClient, tensors: list[dict[str, object]], job_id: str) -> None:
    job = simulated_trainers.sim_job(0)
    answer = client.ask_hyperparameters("net", 0, 0, job_id=job_id)
    for it in range(1, 12):
        if answer.completed:
            return
        speed, timings, backward_ms = job.measure(answer.plan)
        client.report_metrics("net", 0, it, answer.plan, speed, timings, backward_ms=backward_ms, job_id=job_id)
        answer = client.ask_hyperparameters("net", 0, it, job_id=job_id)
    assert answer.completed


def _show(target: str) -> str:
    show = subprocess.run([sys.executable, "-m", "bagua_lightning.cli", "autotune", "show", "net", "--job", "run-1",
                           "--target", target], capture_output=True, text=True, timeout=120)
    assert show.returncode == 0, show.stderr
    return show.stdout


def test_the_choice_is_shown_exported_and_survives_a_restart(start_service, tmp_path: Path) -> None:
    tensors = [t.to_dict() for t in simulated_trainers.sim_job(0).tensors]
    metrics_port = free_port()
    args = (*FAST, "--max-samples", "3", "--state", str(tmp_path / "plans"))
    with start_service(*args, "--metrics-port", str(metrics_port)) as (target, _), \
            AutotuneClient(target=target) as client:
        assert client.register_job("net", tensors, job_id="run-1", world_size=2).selection is None
        _tune_to_completion(client, tensors, "run-1")  # the shape's best plan is stored
        client.report_algorithm_selection("net", "bytegrad", STEP_MS, REASON, 52, job_id="run-1")
        d = client.describe_model("net", "run-1")
        assert d.selection is not None
        assert (d.selection.chosen, d.selection.step, d.selection.reason, d.selection.job_id) == (
            "bytegrad", 52, REASON, "run-1")
        assert d.selection.step_ms == tuple(STEP_MS.items())
        assert d.summary.algorithm == "bytegrad"
        assert [m.algorithm for m in client.list_models()] == ["bytegrad"]
        out = _show(target)
        assert "algorithm: bytegrad (algorithm='auto', chosen at step 52)" in out
        lines = out.splitlines()
        kept = next(line for line in lines if line.strip().startswith("bytegrad"))
        slower = next(line for line in lines if line.strip().startswith("gradient_allreduce"))
        assert "48.12 ms/step" in kept and "(kept)" in kept
        assert "170.00 ms/step" in slower and "3.53x" in slower
        assert f"reason: {REASON}" in out
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'bagua_autotune_algorithm_step_ms{algorithm="bytegrad",job="run-1",model="net"} 48.125' in text
        assert 'bagua_autotune_algorithm_step_ms{algorithm="gradient_allreduce",job="run-1",model="net"} 170.0' in text
        assert 'bagua_autotune_algorithm_chosen{algorithm="bytegrad",job="run-1",model="net"} 1.0' in text
        assert 'bagua_autotune_algorithm_chosen{algorithm="gradient_allreduce"' not in text
    # A new service process on the same state: the job registers again and its choice is back.
    with start_service(*args) as (target, _), AutotuneClient(target=target) as client:
        again = client.register_job("net", tensors, job_id="run-1", world_size=2)
        assert again.selection is not None and again.selection.step_ms == tuple(STEP_MS.items())
        d = client.describe_model("net", "run-1")
        assert d.selection is not None and (d.selection.chosen, d.selection.step) == ("bytegrad", 52)
        assert "algorithm: bytegrad (algorithm='auto', chosen at step 52)" in _show(target)
        # Another job of the shape starts from that plan and says whose measurement the choice is; a trainer's
        # worker (rank 0) keeps it for the end-of-fit advice of a fixed algorithm.
        worker = AutotuneWorker(Job(address=target, model_name="net", tensors=simulated_trainers.sim_job(0).tensors, rank=0,
                                    world_size=2, nproc_per_node=2, job_id="run-2"),
                                lambda: AutotuneClient(target=target))
        try:
            worker.register_now()
            assert worker.registered
            assert worker.earlier_selection == Selection(step_ms=STEP_MS, chosen="bytegrad", decided_at=52,
                                                         job_id="run-1")
        finally:
            worker.close()
        d = client.describe_model("net", "run-2")
        assert d.selection is not None and d.selection.job_id == "run-1"
        assert d.summary.algorithm == ""  # run-2 chose nothing itself


def _selection(chosen: str = "bytegrad", step: int = 3, reason: str = "r",
               candidates: list[tuple[str, float]] | None = None) -> pb.AlgorithmSelection:
    pairs = candidates if candidates is not None else list(STEP_MS.items())
    return pb.AlgorithmSelection(chosen=chosen, step=step, reason=reason,
                                 candidates=[pb.AlgorithmCandidate(algorithm=n, step_ms=ms) for n, ms in pairs])


BAD = [
    ("control character", _selection("byte\ngrad", candidates=[("byte\ngrad", 1.0)]),
     "selection.candidates[0].algorithm 'byte\\ngrad' is not an algorithm name"),
    ("unknown chosen", _selection("fastest"), "selection.chosen 'fastest' is not among the candidates"),
    ("negative time", _selection(candidates=[("bytegrad", -4.0)]), "step_ms=-4.0 for 'bytegrad'"),
    ("NaN time", _selection(candidates=[("bytegrad", float("nan"))]), "must be finite, > 0"),
    ("too many", _selection(candidates=[(f"algo_{i}", 1.0) for i in range(17)]), "17 entries, more than 16"),
    ("none", _selection(candidates=[]), "selection.candidates is empty"),
    ("duplicate", _selection(candidates=[("bytegrad", 1.0), ("bytegrad", 2.0)]), "'bytegrad' is a duplicate"),
    ("negative step", _selection(step=-1), "selection.step=-1"),
    ("reason with a newline", _selection(reason="a\nb"), "one printable line"),
]


@pytest.mark.parametrize(("case", "selection", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_selections_are_invalid_arguments(shared_service: str, case: str, selection: pb.AlgorithmSelection,
                                              message: str) -> None:
    tensors = [t.to_dict() for t in simulated_trainers.abcde()]
    with AutotuneClient(target=shared_service) as client:
        client.register_job("selected", tensors, job_id="bad-input", world_size=4)
    channel, stub = raw_stub(shared_service)
    with channel:
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.ReportAlgorithmSelection(pb.ReportAlgorithmSelectionRequest(
                model_name="selected", job_id="bad-input", selection=selection), timeout=10)
        assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in excinfo.value.details()
        with pytest.raises(grpc.RpcError) as excinfo:  # an unknown model is NOT_FOUND, not recorded anywhere
            stub.ReportAlgorithmSelection(pb.ReportAlgorithmSelectionRequest(
                model_name="never-registered", selection=_selection()), timeout=10)
        assert excinfo.value.code() == grpc.StatusCode.NOT_FOUND
