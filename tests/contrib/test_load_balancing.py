"""Load-balancing samplers: Bagua's ordering, every sample dealt once, balanced steps, equal batch counts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from bagua_lightning.engine.contrib.load_balancing import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)


def _growing_batches(indices: list[int]) -> list[list[int]]:
    batches, batch, size = [], [], 1
    for i in indices:
        batch.append(i)
        if len(batch) == size:
            batches.append(batch)
            batch, size = [], size + 1
    if batch:
        batches.append(batch)
    return batches


def test_unshuffled_order_is_by_complexity() -> None:
    dataset = TensorDataset(torch.randn(10, 2), torch.randperm(10))
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda x: x[1], num_replicas=1, rank=0,
                                              shuffle=False)
    loader = DataLoader(dataset, batch_size=1, sampler=sampler)
    assert [int(d[1]) for d in loader] == list(range(10))


@pytest.mark.parametrize("replicas", [1, 4])
def test_batch_sampler_deals_neighbours(replicas: int) -> None:
    n = 15 * replicas
    dataset = TensorDataset(torch.randn(n, 2), torch.randperm(n))
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda x: x[1], num_replicas=replicas,
                                              rank=0, shuffle=False)
    loader = DataLoader(dataset, batch_sampler=LoadBalancingDistributedBatchSampler(sampler, _growing_batches))
    first = 0
    for i, (x, c) in enumerate(loader):
        assert x.shape[0] == i + 1 and int(c[0]) == first
        first += x.shape[0] * replicas
    assert i == 4


def _samplers(n: int, world: int, **kw: object) -> tuple[list[float], list[LoadBalancingDistributedSampler]]:
    torch.manual_seed(3)  # the same lengths on every call
    lengths = torch.distributions.LogNormal(3.0, 1.0).sample((n,)).round().clamp(min=1).tolist()
    dataset = [int(v) for v in lengths]
    return lengths, [LoadBalancingDistributedSampler(dataset, complexity_fn=float, num_replicas=world, rank=r,
                                                     **kw) for r in range(world)]  # type: ignore[arg-type]


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_and_steps_balanced(drop_last: bool) -> None:
    lengths, samplers = _samplers(1003, 4, drop_last=drop_last, seed=5)
    for s in samplers:
        s.set_epoch(2)
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    flat = [i for p in per_rank for i in p]
    if drop_last:
        assert len(flat) == 1000 and len(set(flat)) == 1000
    else:
        assert len(flat) == 1004 and set(flat) == set(range(1003))
    # Step k of every rank: samples of neighbouring complexity. Compare batches of 8 with DistributedSampler's.
    def imbalance(lists: list[list[int]]) -> float:
        ratios = []
        for k in range(0, len(lists[0]) - 7, 8):
            work = [sum(lengths[i] for i in p[k : k + 8]) for p in lists]
            ratios.append(max(work) / (sum(work) / len(work)))
        return sum(ratios) / len(ratios)
    plain = []
    for r in range(4):
        d = DistributedSampler(range(1003), num_replicas=4, rank=r, seed=5)  # type: ignore[arg-type]
        d.set_epoch(2)
        plain.append(list(d))
    assert imbalance(per_rank) < 1.05 < imbalance(plain)


def test_epochs_reshuffle_and_random_level_trades_balance() -> None:
    _, (s0,) = _samplers(200, 1)
    first = list(s0)
    assert list(s0) == first
    s0.set_epoch(1)
    assert list(s0) != first and sorted(s0) == sorted(first)
    with pytest.raises(ValueError, match="random_level"):
        _samplers(10, 1, random_level=1.5)
    lengths, calm = _samplers(400, 4, random_level=0.0)
    _, noisy = _samplers(400, 4, random_level=1.0)
    def spread(samplers: list[LoadBalancingDistributedSampler]) -> float:
        lists = [list(s) for s in samplers]
        return sum(max(lengths[p[k]] for p in lists) - min(lengths[p[k]] for p in lists) for k in range(100))
    assert spread(calm) < spread(noisy)


def test_batch_sampler_pads_or_trims_to_one_count() -> None:
    _, samplers = _samplers(101, 3, seed=1)
    def by_budget(indices: list[int]) -> list[list[int]]:  # batches with at most 200 length units
        out, cur, used = [], [], 0.0
        for i in indices:
            if cur and used + lengths[i] > 200:
                out.append(cur)
                cur, used = [], 0.0
            cur.append(i)
            used += lengths[i]
        return out + ([cur] if cur else [])
    lengths = [float(samplers[0].complexities[i]) for i in range(101)]
    padded = [LoadBalancingDistributedBatchSampler(s, by_budget) for s in samplers]
    trimmed = [LoadBalancingDistributedBatchSampler(s, by_budget, drop_last=True) for s in samplers]
    assert len({len(list(b)) for b in padded}) == 1 and len({len(b) for b in trimmed}) == 1
    assert len(padded[0]) >= len(trimmed[0])
    padded[0].set_epoch(4)
    assert samplers[0].epoch == 4
    with pytest.raises(TypeError, match="LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(DistributedSampler(range(4), 1, 0), by_budget)  # type: ignore[arg-type]
    _, (dropping,) = _samplers(10, 1, drop_last=True)
    with pytest.raises(ValueError, match="drop_last"):
        LoadBalancingDistributedBatchSampler(dropping, by_budget)
