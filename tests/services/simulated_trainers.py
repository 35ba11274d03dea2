"""Simulated trainers for the autotune service tests: a model of five tensors (:func:`abcde`), a score peaking
at 20 MB buckets, simulated jobs, and the functions spawned processes run as trainer ranks (they launch nothing)."""

from __future__ import annotations

import math
import threading
from typing import Any

from bagua_lightning.client.autotune import AutotuneClient
from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration
from bagua_lightning.services.autotune.simulator import SimulatedJob, bandwidth_scenario, compute_proportional

MB = 1024**2


def abcde() -> list[TensorDeclaration]:
    return [TensorDeclaration(n, s * MB // 4, "f32") for n, s in zip("ABCDE", [4, 8, 12, 16, 20], strict=True)]


def peak_at_20mb(plan: BucketPlan) -> float:
    """Speed (> 0) that peaks when buckets are cut at 20 MB (log-quadratic), flat reduce 10% faster."""
    return 1000.0 / (1.0 + 0.04 * math.log2(plan.bucket_size / (20 * MB)) ** 2) \
        * (0.9 if plan.is_hierarchical_reduce else 1.0)


def speed_only_rank(target: str, model: str, ranks: list[int], iters: int) -> dict[str, Any]:
    """Ranks (threads) that ask every iteration and report the speed of the plan in use, until completed."""
    results: dict[int, list[tuple[int, str, int, bool]]] = {}

    def one(rank: int) -> None:
        seen: list[tuple[int, str, int, bool]] = []
        with AutotuneClient(target=target) as client:
            for it in range(iters):
                reply = client.ask_hyperparameters(model, rank, it)
                plan = reply.plan
                seen.append((it, plan.fingerprint(), plan.version, reply.completed))
                if reply.completed:
                    break
                client.report_metrics(model, rank, it, plan, peak_at_20mb(plan))
        results[rank] = seen

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"results": results}


def sim_job(seed: int, tensors: list[TensorDeclaration] | None = None) -> SimulatedJob:
    tensors = tensors or [TensorDeclaration(f"layer{i}.weight", (1 + i % 5) * 256 * 1024, "f32") for i in range(40)]
    flat, hier = bandwidth_scenario(1.0, 0.3, nodes=2)
    return SimulatedJob(tensors=tensors, compute_ms=compute_proportional(tensors, 40.0), flat=flat,
                        hierarchical=hier, forward_ms=10.0, seed=seed)


def tune_to_completion(client: Any, job: SimulatedJob, model: str, answer: Any, job_id: str,
                       rounds: int = 12) -> Any:
    """Rank 0 of ``job`` measuring each plan the service hands out (starting from ``answer``) and reporting
    it, until the service says the tuning is complete or ``rounds`` run out; the last answer."""
    for it in range(1, rounds):
        if answer.completed:
            break
        speed, timings, backward_ms = job.measure(answer.plan)
        client.report_metrics(model, 0, it, answer.plan, speed, timings, backward_ms=backward_ms, job_id=job_id)
        answer = client.ask_hyperparameters(model, 0, it, job_id=job_id)
    return answer


def timed_ranks(target: str, models: list[str], ranks: list[int], world_size: int, rounds: int,
                steps_per_round: int = 10) -> dict[str, Any]:
    """For each model, threads acting as ``ranks``: register, then rounds of ask + report with bucket timings.

    Returns every plan each rank got per train_iter, every report's accepted flag, and errors.
    """
    job_tensors = sim_job(0).tensors
    out: dict[str, Any] = {"plans": [], "accepted": [], "duplicates": [], "errors": []}
    lock = threading.Lock()

    def one(model: str, rank: int) -> None:
        job = sim_job(rank)
        try:
            with AutotuneClient(target=target) as client:
                client.register_tensors(model, [t.to_dict() for t in job_tensors], world_size=world_size,
                                        nproc_per_node=world_size // 2)
                for r in range(rounds):
                    it = r * steps_per_round
                    plan = client.ask_hyperparameters(model, rank, it).plan
                    speed, timings, backward_ms = job.measure(plan)
                    acc = client.report_metrics(model, rank, it, plan, speed, timings, backward_ms=backward_ms)
                    dup = client.report_metrics(model, rank, it, plan, speed, timings, backward_ms=backward_ms)
                    with lock:
                        out["plans"].append((model, it, rank, plan.fingerprint(), plan.version))
                        out["accepted"].append(acc)
                        out["duplicates"].append(dup)
        except Exception as exc:  # collected and asserted on by the test
            with lock:
                out["errors"].append(f"{model} rank {rank}: {exc!r}")

    threads = [threading.Thread(target=one, args=(m, r)) for m in models for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
