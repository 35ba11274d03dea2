"""``with_bagua`` and Bagua's algorithm objects on real Gloo ranks (2 and 4, one or two "nodes")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ranks import run_ranks

WORKERS = Path(__file__).with_name("module_workers.py")


def run(case: str, tmp_path: Path, world_size: int, local_size: int | None = None,
        timeout_s: float = 240, cuda: bool = False) -> list[dict[str, Any]]:
    """Run ``case`` on ``world_size`` ranks, ``local_size`` per node; every rank's JSON result.

    CUDA is hidden (Gloo) unless ``cuda``.
    """
    run_ranks(str(WORKERS), [case, str(tmp_path)], world_size=world_size, log_dir=tmp_path, timeout_s=timeout_s,
              local_size=local_size, hide_cuda=not cuda, log_name=f"{case}-rank")
    return [json.loads((tmp_path / f"{case}-rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_switching_algorithms_on_one_model(tmp_path: Path, world_size: int) -> None:
    results = run("switch", tmp_path, world_size)
    # gradient_allreduce (third in the sequence) starts from decentralized's "all" average and keeps
    # replicas identical; every algorithm trained without error.
    assert all(r["gradient_allreduce"] == results[0]["gradient_allreduce"] for r in results)
    assert results[0]["decentralized"] != results[1]["decentralized"]  # each rank applies its own gradient
    assert results[0]["buckets"] == [4]


def test_wrapping_broadcasts_parameters_and_optimizer_state(tmp_path: Path) -> None:
    results = run("broadcast", tmp_path, 2)
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["momentum"] == results[1]["momentum"]
    assert any(abs(x) > 0 for x in results[0]["momentum"])
    for name in ("Adam", "Rprop"):
        assert results[0][name] == results[1][name], name


def test_one_algorithm_object_serves_two_models(tmp_path: Path) -> None:
    for res in run("shared", tmp_path, 2):
        for ours, torch_ddp in zip(res["bagua"], res["torch"], strict=True):
            assert ours == torch_ddp  # exactly PyTorch DDP's weights


def test_a_users_algorithm_impl_runs(tmp_path: Path) -> None:
    results = run("custom", tmp_path, 2)
    assert results[0]["grads"] == results[1]["grads"]
    assert results[0]["compressed"] == results[1]["compressed"]


@pytest.mark.parametrize("local_size", [4, 2])
def test_hierarchical_has_baguas_meaning(tmp_path: Path, local_size: int) -> None:
    results = run("hierarchical", tmp_path, 4, local_size=local_size)
    for res in results:
        if local_size == 4:
            # One node: bytegrad compresses nothing (exactly gradient_allreduce).
            assert res["bytegrad"] == res["gradient_allreduce"]
        else:
            assert res["bytegrad"] != res["gradient_allreduce"]
    for name in ("bytegrad", "gradient_allreduce"):
        assert all(r[name] == results[0][name] for r in results)
    # Low precision communicates after the optimizer step: every rank of a node ends with its node's weights.
    name = "low_precision_decentralized"
    assert all(results[r][name] == results[r - r % local_size][name] for r in range(4))
    if local_size == 2:
        assert results[0]["low_precision_decentralized"] != results[2]["low_precision_decentralized"]


def test_async_on_a_group_without_the_last_rank(tmp_path: Path) -> None:
    results = run("partial", tmp_path, 3)
    assert [r["in_group"] for r in results] == [True, True, False]
    # The members' weights moved by averaging; the last rank's are exactly those of training alone.
    assert [r["as_local_training"] for r in results] == [False, False, True]


@pytest.mark.parametrize("n", [2, 4])
def test_bucket_state_under_baguas_names(tmp_path: Path, n: int) -> None:
    results = run("bucket_state", tmp_path, n)  # each rank also checks _peer_weight against a torch reference
    half = n // 2
    for r in range(n):
        assert results[r]["all"] == results[0]["all"]  # "all": every rank holds the same average
        last_peer = half + (r + 5) % half if r < half else (r - half - 5) % half  # "shift_one" at step 5
        assert results[r]["shift_one"] == results[last_peer]["shift_one"]
        # Low precision: a rank's public weights are exactly what its ring neighbours hold for it.
        lp, left, right = (results[x]["low_precision"] for x in (r, (r - 1) % n, (r + 1) % n))
        assert lp["_weight"] == left["_right_peer_weight"] == right["_left_peer_weight"]


def test_find_unused_parameters(tmp_path: Path) -> None:
    results = run("unused", tmp_path, 2)
    for res in results:
        assert res["True"] == ["fc1.weight", "fc2.weight"]
        assert res["False"] == ["fc1.weight", "fc2.weight", "fc3.weight"]
    assert results[0]["gradTrue"] == results[1]["gradTrue"]


def test_bagua_style_script_reaches_ddps_loss(tmp_path: Path) -> None:
    res = run("acceptance", tmp_path, 2)[0]
    assert res["gradient_allreduce"] == res["ddp"], res
    for name in ("bytegrad", "decentralized", "low_precision_decentralized",
                 "bytegrad_flat", "decentralized_flat", "low_precision_decentralized_flat"):
        assert abs(res[name] - res["ddp"]) <= 0.02 * res["ddp"], (name, res)
    for name in ("qadam", "qadam_flat"):
        assert abs(res[name] - res["ddp_adam"]) <= 0.02 * res["ddp_adam"], (name, res)
    # async never waits: how many averaging rounds land in a run depends on the machine's load, so its
    # loss is only held to training well (DDP's loss starts near 0.6 on this data).
    assert res["async"] < 2 * res["ddp"], res


def test_expert_parameters_stay_each_ranks_own(tmp_path: Path) -> None:
    results = run("experts", tmp_path, 2)
    for name, res in results[0].items():
        assert res["expert"] != results[1][name]["expert"], name
    for name in ("gradient_allreduce", "bytegrad", "qadam"):  # replicas of the shared layer stay identical
        assert results[0][name]["shared"] == results[1][name]["shared"], name


def test_main_thread_collectives_during_backward(tmp_path: Path) -> None:
    # Each rank checks its weights against a reference with plain allreduce (see the worker).
    results = run("backward_collectives", tmp_path, 2)
    assert results[0]["gradient_allreduce"] < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_every_algorithm_on_nccl_with_one_gpu(tmp_path: Path) -> None:
    res = run("nccl_one_gpu", tmp_path, 1, cuda=True)[0]
    assert res["backend"] == "nccl"
    # One rank: gradient algorithms are local SGD/Adam, whatever the layout.
    assert res["bytegrad/True"] == res["gradient_allreduce/False"] == res["bytegrad/False"]
