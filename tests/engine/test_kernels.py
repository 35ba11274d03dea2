"""The fused Triton kernels against the CPU torch path, on CPU through Triton's interpreter.

The checks live in ``kernel_checks.py`` (also run on a GPU machine with
``--device cuda``); here they run once, in a subprocess with ``TRITON_INTERPRET=1``
set before Triton is imported, so no other test sees the variable. Shapes are tiny
and blocks small (16 elements) so every kernel loops over several blocks and programs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bagua_lightning.engine.algorithms.q_adam import QAdamOptimizer
from bagua_lightning.engine.compression import compress_chunks, decompress_chunks, max_quantisation_error
from tests.ranks import REPO, run_ranks

CHECKS = [
    "compress_matches_cpu_bytes",
    "decompress_matches_cpu_values",
    "constant_and_extreme_chunks",
    "non_finite_values_decode_non_finite",
    "unaligned_buffers_use_the_byte_layout",
    "owner_step_matches_decompress_sum_recompress",
    "weight_difference_matches_torch",
    "add_decompressed_matches_torch",
    "repeated_layouts_match_cpu",
    "bad_arguments_are_refused",
]
HERE = Path(__file__).parent


def _interpreter_env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, str(HERE / "kernel_checks.py"), "--device", "cpu", "--block", "16"],
        env=_interpreter_env(), cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"kernel checks printed nothing (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1])


@needs_triton
def test_every_check_ran(interpreted_results: dict[str, str]) -> None:
    assert sorted(interpreted_results) == sorted(CHECKS)


@needs_triton
@pytest.mark.parametrize("name", CHECKS)
def test_kernel_matches_cpu_path(interpreted_results: dict[str, str], name: str) -> None:
    assert interpreted_results[name] == "ok", interpreted_results[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("block", [None, 64])
def test_compiled_kernels_match_cpu_path_on_gpu(block: int | None) -> None:
    # The launchers' block size, and small blocks so that every kernel loops over several blocks.
    cmd = [sys.executable, str(HERE / "kernel_checks.py"), "--device", "cuda"] + (["--block", str(block)] if block else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert lines, f"kernel checks printed nothing (exit {done.returncode}):\n{done.stderr[-4000:]}"
    results = json.loads(lines[-1])
    assert sorted(results) == sorted(CHECKS)
    assert all(v == "ok" for v in results.values()), {k: v for k, v in results.items() if v != "ok"}


@needs_triton
def test_fused_exchange_on_two_gloo_ranks_equals_its_definition(tmp_path: Path) -> None:
    # Two ranks: the owner's float32 sum has one addition, so the result is exact, not just close.
    run_ranks(str(HERE / "kernel_exchange_workers.py"), [str(tmp_path)], world_size=2, log_dir=tmp_path,
              timeout_s=300, env={"TRITON_INTERPRET": "1"})
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in res, res["error"]
        assert len(res["cases"]) == 3
        for c in res["cases"]:
            assert c["identical_on_ranks"], c
            assert c["equal_to_reference"], c


def test_chunks_narrower_than_the_epsilon_round_trip_within_the_bound() -> None:
    # 255 / (max - min) alone would exceed float32 here; the 1e-7 added to the width keeps the scale finite.
    x = torch.cat([torch.linspace(1e-37, 2e-37, 16), torch.tensor([0.0, 1e-40] * 8)])
    y = decompress_chunks(compress_chunks(x, 2))
    assert torch.isfinite(y).all()
    assert (y - x).abs().max().item() <= max_quantisation_error(x, 2)


def _old_qadam_step(opt: QAdamOptimizer, momentum_is_external: bool) -> None:
    """QAdamOptimizer.step as a per-parameter loop: the reference for the multi-tensor step."""
    with torch.no_grad():
        for group in opt.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = opt.state[p]
                t = int(state["step"]) + 1
                state["step"] = t
                external = momentum_is_external and t > opt.warmup_steps
                if p.grad is None and not external:
                    continue
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if not external:
                    grad = p.grad if group["weight_decay"] == 0 else p.grad.add(p, alpha=group["weight_decay"])
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    if t <= opt.warmup_steps:
                        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1**t
                bias2 = 1 - beta2 ** min(t, opt.warmup_steps)
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-group["lr"] / bias1)


@pytest.mark.parametrize("external", [False, True])
def test_qadam_multi_tensor_step_equals_the_per_parameter_loop(external: bool) -> None:
    def build() -> tuple[list[torch.nn.Parameter], QAdamOptimizer]:
        g = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in [(5, 3), (7,), (2, 2), (4,)]]
        opt = QAdamOptimizer(
            [{"params": params[:3], "weight_decay": 0.01}, {"params": params[3:], "lr": 0.05}],
            lr=0.01, warmup_steps=2,
        )
        opt.momentum_is_external = external
        return params, opt

    new_params, new_opt = build()
    old_params, old_opt = build()
    for step in range(5):
        g = torch.Generator().manual_seed(100 + step)
        for i, (a, b) in enumerate(zip(new_params, old_params, strict=True)):
            grad = None if (i == 1 and step % 2 == 0) else torch.randn(a.shape, generator=g)  # a missing gradient
            a.grad = None if grad is None else grad.clone()
            b.grad = None if grad is None else grad.clone()
        new_opt.step()
        _old_qadam_step(old_opt, external)
        for a, b in zip(new_params, old_params, strict=True):
            assert torch.equal(a, b), (step, a, b)
            assert torch.equal(new_opt.state[a]["exp_avg"], old_opt.state[b]["exp_avg"])
            assert torch.equal(new_opt.state[a]["exp_avg_sq"], old_opt.state[b]["exp_avg_sq"])
    assert new_opt.completed_steps == 5


def _low_precision_through_kernels(comm: Any, kwargs: dict[str, Any], steps: int) -> dict[str, Any]:
    """low_precision_decentralized with its difference/apply on the (interpreted) kernels, CPU tensors."""
    os.environ["TRITON_INTERPRET"] = "1"  # before this process first imports triton (at the first launch)
    from bagua_lightning.engine import kernels
    from tests.engine.weight_averaging_workers import low_precision_trace

    kernels.enabled = lambda device: True  # type: ignore[assignment]  # this child only
    return low_precision_trace(comm, kwargs, steps)


@needs_triton
@pytest.mark.slow  # spawned ranks, each importing torch and interpreting the kernels
@pytest.mark.parametrize("world_size", [2, 3])  # one peer both sides; two distinct neighbours
def test_low_precision_ring_on_the_kernels_keeps_replicas_identical(world_size: int) -> None:
    from tests.engine.weight_averaging_workers import run_ranks as run_scenario

    results = run_scenario(_low_precision_through_kernels, world_size, {"hierarchical": False}, 4, timeout_s=300)
    for rank, r in enumerate(results):
        left, right = r["neighbours"]
        for mine, theirs in zip(r["replicas"]["left"], results[left]["replicas"]["weight"], strict=True):
            assert torch.equal(mine, theirs)  # bit-identical: every rank applies a message the same way
        for mine, theirs in zip(r["replicas"]["right"], results[right]["replicas"]["weight"], strict=True):
            assert torch.equal(mine, theirs)
        assert r["worst_excess"] <= 1e-6, (rank, r["worst_excess"])  # within the quantisation bound
        assert r["model_equals_replica"]
        assert r["end_loss"] < r["start_loss"]


@pytest.mark.parametrize("n", [1, 3, 4, 37, 64, 203, 4096, 100_003])
@pytest.mark.parametrize("block", [4, 16, 64])
def test_compression_spans_cover_each_row_once_in_whole_blocks(n: int, block: int) -> None:
    # The span passes: program p of a row covers elements [p * span, min((p + 1) * span, n)) in `iters` blocks;
    # spans are whole words (the word layout stores 4 levels at a time) and every program has elements.
    from bagua_lightning.engine import kernels

    plan = kernels._plan(torch.device("cpu"), n, 2, block, 4, 8, 2048)
    assert plan.span % 4 == 0
    assert (plan.span_programs - 1) * plan.span < n <= plan.span_programs * plan.span
    assert plan.iters * plan.block >= plan.span > (plan.iters - 1) * plan.block
    assert plan.span_pb >= plan.span_programs and plan.span_pb & (plan.span_pb - 1) == 0
    one_block = kernels._plan(torch.device("cpu"), n, 2, block, 4, 0, 2048)  # decompress: one block a program
    assert (one_block.span, one_block.iters) == (block, 1)
