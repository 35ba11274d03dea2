"""fuse_optimizer / fuse_step: bitwise the unfused step, one update per contiguous run, state_dict round trips."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.optim as optim

from bagua_lightning.engine.contrib import fused_optimizer
from bagua_lightning.engine.contrib.fused_optimizer import (
    calculate_mutual_groups,
    fuse_optimizer,
    fuse_step,
    is_fused_optimizer,
)

CASES: list[tuple[type[optim.Optimizer], dict[str, Any]]] = [
    (optim.Adam, dict(weight_decay=1.0, amsgrad=True)),
    (optim.Adam, dict(weight_decay=0.0, amsgrad=False)),
    (optim.AdamW, dict(weight_decay=1.0, amsgrad=True)),
    (optim.AdamW, dict(weight_decay=0.0)),
    (optim.SGD, dict(lr=0.2, momentum=1, dampening=0, weight_decay=1, nesterov=True)),
    (optim.SGD, dict(lr=0.2, momentum=1, dampening=0.5, weight_decay=1, nesterov=False)),
    (optim.SGD, dict(lr=0.1)),
    (optim.RMSprop, dict(weight_decay=1, momentum=1, centered=True)),
    (optim.RMSprop, dict(weight_decay=0, momentum=1, centered=False)),
    (optim.Rprop, dict(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50))),
    (optim.ASGD, dict(weight_decay=1)),
    (optim.Adamax, dict(weight_decay=1)),
    (optim.Adadelta, dict(weight_decay=1)),
    (optim.Adagrad, dict(lr=0.1)),
    (optim.NAdam, {}),
    (optim.RAdam, {}),
]


class CountingSGD(optim.Optimizer):
    """A user's own optimizer: plain SGD that records how many tensors each step updates."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))
        self.tensors_per_step: list[int] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        n = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
                    n += 1
        self.tensors_per_step.append(n)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1), torch.nn.Sigmoid())


def _train(model: torch.nn.Module, opt: optim.Optimizer, steps: int, fused: bool, set_to_none: bool = True) -> None:
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        model(x).sum().backward()
        if fused:
            fuse_step(opt)
        else:
            opt.step()


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
@pytest.mark.parametrize("warm", [0, 2], ids=["fresh", "with-state"])
def test_fused_step_is_bitwise_the_unfused_step(cls: type[optim.Optimizer], kwargs: dict[str, Any],
                                                warm: int) -> None:
    m1, m2 = _model(), _model()
    o1, o2 = cls(m1.parameters(), **kwargs), cls(m2.parameters(), **kwargs)
    _train(m1, o1, warm + 4, fused=False)
    _train(m2, o2, warm, fused=False)
    fuse_optimizer(o2)
    assert is_fused_optimizer(o2) and not is_fused_optimizer(o1)
    _train(m2, o2, 2, fused=True, set_to_none=False)
    _train(m2, o2, 2, fused=True, set_to_none=True)
    assert _equal(m1, m2)
    # state_dict has the unfused layout and values: load it into a fresh unfused optimizer, continue both.
    m3 = _model()
    m3.load_state_dict(m2.state_dict())
    o3 = cls(m3.parameters(), **kwargs)
    o3.load_state_dict(copy.deepcopy(o2.state_dict()))  # a checkpoint: no tensors shared with o2
    _train(m2, o2, 2, fused=True)
    _train(m3, o3, 2, fused=False)
    assert _equal(m2, m3)


def test_one_update_per_group_and_views_of_one_buffer() -> None:
    model = _model()
    opt = fuse_optimizer(CountingSGD(model.parameters()))
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == 1
    _train(model, opt, 2, fused=True)
    # Gradients autograd allocated were moved into one buffer: the next backward accumulates there.
    grad_ptrs = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}  # type: ignore[union-attr]
    assert len(grad_ptrs) == 1
    opt.fuse_step()  # type: ignore[attr-defined]
    opt.step()
    assert opt.tensors_per_step == [1, 1, 1, 6]


def test_frozen_and_gradless_parameters_stay_exact() -> None:
    m1, m2 = _model(), _model()
    for m in (m1, m2):
        m[2].weight.requires_grad_(False)  # type: ignore[index]
    o1 = optim.Adam(m1.parameters(), lr=0.1)
    o2 = fuse_optimizer(optim.Adam(m2.parameters(), lr=0.1))
    _train(m1, o1, 3, fused=False)
    _train(m2, o2, 3, fused=True)
    assert _equal(m1, m2)


def test_plain_step_and_fused_step_interleave() -> None:
    m1, m2 = _model(), _model()
    o1 = optim.Adam(m1.parameters(), lr=0.05)
    o2 = fuse_optimizer(optim.Adam(m2.parameters(), lr=0.05))
    _train(m1, o1, 6, fused=False)
    for fused in (True, False, True, True, False, True):
        _train(m2, o2, 1, fused=fused)
    assert _equal(m1, m2)
    assert o1.state_dict()["state"][0]["step"] == o2.state_dict()["state"][0]["step"] == 6


def test_unfused_state_dict_loads_into_fused_optimizer() -> None:
    m1, m2 = _model(), _model()
    o1 = optim.AdamW(m1.parameters(), lr=0.05)
    _train(m1, o1, 3, fused=False)
    m2.load_state_dict(m1.state_dict())
    o2 = fuse_optimizer(optim.AdamW(m2.parameters(), lr=0.05))
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    _train(m1, o1, 3, fused=False)
    _train(m2, o2, 3, fused=True)
    assert _equal(m1, m2)


def test_calculate_mutual_groups() -> None:
    tensor = torch.rand(100)
    pieces = [tensor[i * 10 : (i + 1) * 10] for i in range(10)]
    g1 = [pieces[3], pieces[1], pieces[2], pieces[0], pieces[8], pieces[9], torch.rand(10)]
    g2 = [torch.rand(10) for _ in g1]
    g3 = [pieces[3], pieces[1], pieces[2], pieces[0], torch.rand(10), torch.rand(10), torch.rand(10)]
    g4 = [torch.rand(10), pieces[1], pieces[2], pieces[0], pieces[8], pieces[9], torch.rand(10)]
    assert calculate_mutual_groups([g1, g2]) == []
    assert calculate_mutual_groups([g1, g3]) == [[3, 1, 2, 0]]
    assert calculate_mutual_groups([g1, g4]) == [[4, 5]]
    assert calculate_mutual_groups([g1, g1]) == [[3, 1, 2, 0], [4, 5]]
    with pytest.raises(ValueError, match="same length"):
        calculate_mutual_groups([g1, g1[:3]])


def test_errors_name_the_fix() -> None:
    model = _model()
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="fuse_optimizer"):
        fuse_step(opt)
    fuse_optimizer(opt)
    with pytest.raises(RuntimeError, match="already fused"):
        fuse_optimizer(opt)
    with pytest.raises(TypeError, match="element"):
        fuse_optimizer(optim.LBFGS(_model().parameters()))
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        fuse_optimizer(object())  # type: ignore[arg-type]


def test_gradients_in_someone_elses_buffer_stay_there() -> None:
    m1, m2 = _model(), _model()
    o1 = optim.Adam(m1.parameters(), lr=0.05)
    o2 = fuse_optimizer(optim.Adam(m2.parameters(), lr=0.05))
    params = list(m2.parameters())
    bucket = torch.zeros(sum(p.numel() for p in params))  # a communication bucket, reversed order
    views, offset = [], 0
    for p in reversed(params):
        views.append(bucket[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    views.reverse()
    for p, v in zip(params, views, strict=True):
        p.grad = v
    _train(m1, o1, 3, fused=False)
    _train(m2, o2, 3, fused=True, set_to_none=False)
    assert _equal(m1, m2)
    assert all(p.grad is v for p, v in zip(params, views, strict=True))


@pytest.mark.parametrize("warm", [0, 2])
def test_pieces_across_tensor_boundaries_stay_exact(monkeypatch: pytest.MonkeyPatch, warm: int) -> None:
    monkeypatch.setattr(fused_optimizer, "CPU_PIECE_NUMEL", 7)  # pieces cut through parameters
    for cls, kwargs in ((optim.Adam, dict(amsgrad=True)), (optim.RMSprop, dict(momentum=0.5, centered=True))):
        m1, m2 = _model(), _model()
        o1, o2 = cls(m1.parameters(), **kwargs), cls(m2.parameters(), **kwargs)  # type: ignore[operator]
        _train(m1, o1, warm + 4, fused=False)
        _train(m2, o2, warm, fused=False)
        fuse_optimizer(o2)
        _train(m2, o2, 4, fused=True)
        assert _equal(m1, m2)
    model = _model()
    opt = fuse_optimizer(CountingSGD(model.parameters()))
    _train(model, opt, 2, fused=True)
    total = sum(p.numel() for p in model.parameters())
    assert opt.tensors_per_step == [-(-total // 7)] * 2


def test_fused_optimizer_class_steps_fused_and_shares_state_with_the_wrapped_one() -> None:
    from bagua_lightning.torch_api.contrib import FusedOptimizer

    m1, m2 = _model(), _model()
    o1 = optim.Adam(m1.parameters(), lr=0.05)
    inner = CountingSGD(m2.parameters(), lr=0.05)
    fused = FusedOptimizer(inner, do_flatten=True)
    assert is_fused_optimizer(inner)
    assert fused.param_groups is inner.param_groups and fused.state is inner.state
    fused.step()  # no gradients yet: nothing to update, no error
    _train(m2, fused, 2, fused=False)  # fused.step() is the fused step: one tensor per group
    _train(m2, inner, 1, fused=False)  # the wrapped optimizer still steps tensor by tensor
    assert inner.tensors_per_step == [0, 1, 1, 6]
    # With a stateful optimizer the two steps interleave to the unfused result, bit for bit.
    m3 = _model()
    fused_adam = FusedOptimizer(optim.Adam(m3.parameters(), lr=0.05))
    _train(m1, o1, 4, fused=False)
    _train(m3, fused_adam, 2, fused=False)
    _train(m3, fused_adam.optimizer, 2, fused=False)
    assert _equal(m1, m3)
    assert fused_adam.state_dict()["state"][0]["step"] == 4
    with pytest.raises(RuntimeError, match="already fused"):
        FusedOptimizer(inner)


def test_fused_count_counts_groups_stepped_with_a_fused_run() -> None:
    model = _model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = fuse_optimizer(optim.SGD([{"params": weights}, {"params": biases, "lr": 0.05}], lr=0.1))
    assert opt._bagua_fused_count == 0  # type: ignore[attr-defined]
    _train(model, opt, 3, fused=True)
    assert opt._bagua_fused_count == 6  # two groups, each one fused run, three fused steps  # type: ignore[attr-defined]
    _train(model, opt, 2, fused=False)  # plain steps are not counted
    assert opt._bagua_fused_count == 6  # type: ignore[attr-defined]
    # Nothing contiguous (no flattening, separately allocated parameters): nothing fused, nothing counted.
    model2 = _model()
    opt2 = fuse_optimizer(optim.SGD(model2.parameters(), lr=0.1), do_flatten=False)
    _train(model2, opt2, 2, fused=True)
    assert opt2._bagua_fused_count == 0  # type: ignore[attr-defined]


def test_fused_qadam_steps_exactly_as_the_unfused_one() -> None:
    """QAdam's algorithm reads the optimizer's step count between steps (warm-up or not): a fuse_step must
    leave it where a plain step would (Bagua's test_fused_optimizer::test_qadam, on 2 Gloo ranks)."""
    from tests.contrib.fused_qadam_workers import qadam_plain_and_fused
    from tests.ranks import run_function

    runs = run_function(qadam_plain_and_fused, world_size=2)
    for rank, (plain, fused) in enumerate(runs):
        for a, b in zip(plain, fused, strict=True):
            assert torch.equal(a, b), (rank, a, b)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))  # replicas agree


def _bagua_qadam_run(fused: bool) -> tuple[list[torch.Tensor], int]:
    """Bagua's test_qadam on one rank: SGD's two param groups (weights with decay, biases without) handed to a
    QAdamOptimizer (warm-up 1), wrapped flat (plain) or with ``do_flatten=False`` then fused with
    ``do_flatten=True`` and stepped fused on even epochs; 101 epochs."""
    from bagua_lightning.engine.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer
    from bagua_lightning.engine.comm import CommContext
    from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid())
    groups = [{"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0}]
    opt: Any = QAdamOptimizer(optim.SGD(groups, lr=0.01).param_groups, warmup_steps=1)
    comm = CommContext(rank=0, world_size=1, local_rank=0, local_size=1)
    wrapped = BaguaDistributedDataParallel(model, QAdamAlgorithm(hierarchical=False), comm, flatten=not fused,
                                           optimizers=[opt])
    if fused:
        opt = fuse_optimizer(opt, do_flatten=True)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    for epoch in range(101):
        opt.zero_grad()
        wrapped(x).sum().backward()
        opt.fuse_step() if fused and epoch % 2 == 0 else opt.step()
    wrapped.driver.teardown()
    return [p.detach().clone() for p in model.parameters()], getattr(opt, "_bagua_fused_count", 0)


def test_fused_qadam_with_a_layout_of_its_own_equals_the_unfused_one() -> None:
    """Bagua's test_qadam: with ``do_flatten=False`` qadam leaves the first moment where the optimizer keeps it,
    so ``fuse_optimizer(do_flatten=True)`` lays weights and both moments out alike and every fused step fuses
    both groups (51 fused steps x 2 groups)."""
    plain, _ = _bagua_qadam_run(fused=False)
    fused, count = _bagua_qadam_run(fused=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, fused, strict=True))
    assert count == 102
