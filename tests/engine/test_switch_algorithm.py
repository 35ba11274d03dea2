"""What an algorithm's teardown and ``switch_algorithm`` leave on the module: gradients of their own, one
hook per parameter, no leftover communication thread, a checkpoint with the module's keys."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from bagua_lightning.engine.algorithms.base import get_algorithm_class
from bagua_lightning.engine.comm import CommContext
from bagua_lightning.engine.ddp import BaguaDistributedDataParallel

COMM = CommContext(rank=0, world_size=1, local_rank=0, local_size=1)  # one rank: collectives are no-ops


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(wrapped: BaguaDistributedDataParallel, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        wrapped(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()


def _wrap(model: nn.Module, name: str) -> tuple[BaguaDistributedDataParallel, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return BaguaDistributedDataParallel(model, get_algorithm_class(name).from_kwargs(), COMM, optimizers=[opt]), opt


def _buffers(wrapped: BaguaDistributedDataParallel) -> list[torch.Tensor]:
    """The algorithm's flat bucket buffers (kept referenced by the caller, so no new buffer reuses their memory)."""
    return [b.flat for b in wrapped.algorithm.engine.buckets]  # type: ignore[attr-defined]


def _storages(buffers: list[torch.Tensor]) -> set[int]:
    return {b.untyped_storage().data_ptr() for b in buffers}


def _comm_threads() -> int:
    return sum(t.name.startswith("bagua-comm") for t in threading.enumerate())


def test_teardown_hands_back_gradients_of_their_own() -> None:
    model = _model()
    wrapped, opt = _wrap(model, "gradient_allreduce")
    _train(wrapped, opt, 2)
    held = _buffers(wrapped)
    buffers = _storages(held)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    assert all(p.grad is not None and p.grad._base is not None for p in model.parameters())  # bucket views
    wrapped.teardown()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad._base is None and p.grad.is_contiguous(), n
        assert p.grad.untyped_storage().data_ptr() not in buffers, n
        torch.testing.assert_close(p.grad, before[n])  # values kept
    assert _comm_threads() == 0


@pytest.mark.parametrize("new", ["bytegrad", "decentralized"])
def test_switch_leaves_nothing_of_the_previous_algorithm(new: str) -> None:
    model = _model()
    wrapped, opt = _wrap(model, "gradient_allreduce")
    _train(wrapped, opt, 2)
    held = _buffers(wrapped)
    old = _storages(held)
    wrapped.switch_algorithm(get_algorithm_class(new).from_kwargs())
    for n, p in model.named_parameters():  # between the steps, with the last step's gradients
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() not in old, n
    _train(wrapped, opt, 2, seed=2)
    owned = _storages(_buffers(wrapped)) if new == "bytegrad" else set()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.is_contiguous(), n
        storage = p.grad.untyped_storage().data_ptr()
        assert storage not in old, f"{n}'s gradient still lives in gradient_allreduce's bucket buffer"
        if new == "bytegrad":
            assert storage in owned, n  # the new algorithm's buckets hold it
        else:
            assert p.grad._base is None, n
        assert len(p._post_accumulate_grad_hooks or {}) == 1, n  # the new driver's hook only
    assert _comm_threads() <= 1  # at most the new algorithm's communication thread
    wrapped.teardown()
    assert _comm_threads() == 0


def test_switched_model_trains_as_a_freshly_wrapped_one() -> None:
    """GA for 3 steps, then bytegrad: the same parameters as GA, teardown, a fresh bytegrad wrapper."""
    switched, fresh = _model(), _model()
    a, opt_a = _wrap(switched, "gradient_allreduce")
    b, opt_b = _wrap(fresh, "gradient_allreduce")
    _train(a, opt_a, 3)
    _train(b, opt_b, 3)
    a.switch_algorithm(get_algorithm_class("bytegrad").from_kwargs())
    b.teardown()
    b = BaguaDistributedDataParallel(fresh, get_algorithm_class("bytegrad").from_kwargs(), COMM,
                                     optimizers=[opt_b], broadcast_state=False)
    _train(a, opt_a, 3, seed=2)
    _train(b, opt_b, 3, seed=2)
    for (n, p), q in zip(switched.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=n)
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert a.step == 6 and b.step == 3
    a.teardown()
    b.teardown()


def test_checkpoint_keys_are_the_modules() -> None:
    model = _model()
    wrapped, _ = _wrap(model, "gradient_allreduce")
    state = wrapped.state_dict()
    assert list(state) == list(model.state_dict())
    wrapped.load_state_dict(state)
    wrapped.teardown()
