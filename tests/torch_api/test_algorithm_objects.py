"""Bagua's object model in one process: defaults, factories, tensors, buckets and the errors users see."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import bagua_lightning.torch_api as bagua
from bagua_lightning.core.errors import ConfigurationError
from bagua_lightning.engine.algorithms.gradient_allreduce import (
    GradientAllReduceAlgorithm as EngineAllReduce,
)
from bagua_lightning.engine.algorithms.q_adam import QAdamOptimizerError
from bagua_lightning.engine.buckets import trainable_parameters
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel
from bagua_lightning.torch_api.algorithms import Algorithm, AlgorithmImpl
from bagua_lightning.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua_lightning.torch_api.algorithms.bytegrad import ByteGradAlgorithm
from bagua_lightning.torch_api.algorithms.decentralized import (
    DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
)
from bagua_lightning.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_lightning.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
from bagua_lightning.torch_api.bucket import BaguaBucket

# Seed 004's signatures.
DEFAULTS: list[tuple[type, dict[str, Any]]] = [
    (GradientAllReduceAlgorithm, {"hierarchical": False, "average": True}),
    (ByteGradAlgorithm, {"hierarchical": True, "average": True}),
    (DecentralizedAlgorithm, {"hierarchical": True, "peer_selection_mode": "all", "communication_interval": 1}),
    (LowPrecisionDecentralizedAlgorithm, {"hierarchical": True, "communication_interval": 1}),
    (QAdamAlgorithm, {"q_adam_optimizer": inspect.Parameter.empty, "hierarchical": True}),
    (AsyncModelAverageAlgorithm, {"peer_selection_mode": "all", "sync_interval_ms": 500, "warmup_steps": 0}),
    (QAdamOptimizer, {"params": inspect.Parameter.empty, "lr": 0.001, "warmup_steps": 100, "betas": (0.9, 0.999),
                      "eps": 1e-08, "weight_decay": 0.0}),
]


@pytest.mark.parametrize(("cls", "defaults"), DEFAULTS, ids=lambda x: getattr(x, "__name__", ""))
def test_signatures_are_baguas(cls: type, defaults: dict[str, Any]) -> None:
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop("self")
    assert {k: v.default for k, v in params.items()} == defaults


def test_reify_gives_each_model_its_own_implementation() -> None:
    algorithm = GradientAllReduceAlgorithm(average=False)
    group: Any = object()
    a, b = algorithm.reify(group), algorithm.reify(group)
    assert isinstance(algorithm, Algorithm) and isinstance(a, AlgorithmImpl)
    assert a is not b and a.engine is not b.engine
    assert a.process_group is group and a.engine.average is False
    assert bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm is GradientAllReduceAlgorithm


def test_an_engine_algorithm_instance_drives_one_module() -> None:
    comm = CommContext(rank=0, world_size=1, local_rank=0, local_size=1)
    engine = EngineAllReduce()
    first = BaguaDistributedDataParallel(nn.Linear(2, 2), engine, comm)
    with pytest.raises(ConfigurationError, match="already drives another module"):
        BaguaDistributedDataParallel(nn.Linear(2, 2), engine, comm)
    first.teardown()
    BaguaDistributedDataParallel(nn.Linear(2, 2), engine, comm).teardown()  # free again after teardown


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(QAdamOptimizerError, match="QAdamOptimizer"):
        QAdamAlgorithm(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="peer_selection_mode='ring'"):
        DecentralizedAlgorithm(peer_selection_mode="ring")
    with pytest.raises(TypeError, match=r"must be a bagua_lightning\.torch_api\.algorithms\.Algorithm"):
        nn.Linear(2, 2).with_bagua([], "gradient_allreduce")  # type: ignore[operator]


def test_bagua_tensors_and_a_flattened_bucket() -> None:
    model = nn.Linear(3, 2)
    tensors = []
    for name, p in model.named_parameters():
        p.bagua_ensure_grad()  # type: ignore[operator]
        tensors.append(p.ensure_bagua_tensor(name, "m", getter_closure=lambda t: t.grad,  # type: ignore[operator]
                                             setter_closure=lambda t, g: setattr(t, "grad", g)))
    assert all(t.is_bagua_tensor() for t in tensors)
    bucket = BaguaBucket(tensors, "b0", flatten=True, alignment=4)
    assert bucket.check_flatten()
    flat = bucket.flattened_tensor()
    assert flat.numel() == 8 and flat.data_ptr() == model.weight.grad.data_ptr()  # type: ignore[union-attr]
    assert bucket.bytes() == 8 * 4
    seen: list[str] = []
    bucket.append_python_op(seen.append)
    for t in tensors:
        t.bagua_mark_communication_ready()  # type: ignore[operator]
    assert seen == ["b0"]
    with pytest.raises(ValueError, match="compression='zip'"):
        bucket.append_centralized_synchronous_op(compression="zip")
    with pytest.raises(NotImplementedError, match="DecentralizedAlgorithm"):
        bucket.append_decentralized_synchronous_op(flat)
    copy = model.weight.to_bagua_tensor("copy")  # type: ignore[operator]
    assert copy.is_bagua_tensor() and copy.data_ptr() == model.weight.data_ptr()


def test_experts_and_ignored_names_are_not_communicated() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight.expert = True  # type: ignore[union-attr]
    model._bagua_params_and_buffers_to_ignore = ["0.bias"]  # type: ignore[assignment]
    assert [n for n, _ in trainable_parameters(model)] == ["0.weight", "1.bias"]
    assert [n for n, _ in model.bagua_build_params()] == ["0.weight", "1.bias"]  # type: ignore[operator]
