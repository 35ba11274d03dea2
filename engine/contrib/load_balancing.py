"""Samplers that give every rank's step a similar amount of work (Bagua's load-balancing data loader).

With variable-size samples (sentences, utterances) a ``DistributedSampler`` hands each rank a random slice, so
at every step the rank with the longest samples holds the others up at the gradient exchange. Here every
sample's complexity is measured once; each epoch the samples are sorted by it (plus a little noise when
``random_level > 0``) and cut into *chunks* of ``num_replicas`` neighbours; the chunks are shuffled and rank
``r`` takes the ``r``-th sample of every chunk. The ``k``-th samples of all ranks then come from one chunk:
neighbours in complexity, so per-step work is nearly equal on every rank, while which chunks a step sees
is still random.

``LoadBalancingDistributedBatchSampler`` cuts each rank's list into batches with a user ``batch_fn`` (e.g.
by a token budget) and pads every rank to the same number of batches, so no rank waits at the last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.data.sampler import Sampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]


class LoadBalancingDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that deals samples so every rank's ``k``-th sample has similar complexity.

    Args:
        dataset: The dataset (constant size); ``complexity_fn`` is called once on every sample.
        complexity_fn: A sample's computational complexity, a number (e.g. its length in tokens).
        num_replicas: Ranks taking part; default: the default process group's world size.
        rank: This rank; default: its rank in the default process group.
        shuffle: Shuffle the chunk order (and break complexity ties at random) every epoch.
        seed: Seed of the shuffle; the same on every rank.
        drop_last: Drop samples so the dataset divides evenly among the ranks (random ones when
            shuffling, the most complex ones otherwise) instead of repeating some.
        random_level: In [0, 1]: noise of up to ``random_level * (max - min)`` complexity added before
            sorting; 0 gives the best balance, 1 the most randomness.

    Raises:
        ValueError: ``random_level`` outside [0, 1], ``rank`` outside ``[0, num_replicas)``, or an empty dataset.

    Call :meth:`set_epoch` at the start of every epoch (Lightning does) for a new order per epoch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        complexity_fn: Callable[[Any], float],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
    ) -> None:
        if not 0.0 <= float(random_level) <= 1.0:
            raise ValueError(f"random_level must be in [0, 1], got {random_level}.")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        n = len(dataset)  # type: ignore[arg-type]
        if n == 0:
            raise ValueError("LoadBalancingDistributedSampler needs a non-empty dataset.")
        self.complexities: list[float] = [float(complexity_fn(dataset[i])) for i in range(n)]
        self.random_level = float(random_level)
        spread = max(self.complexities) - min(self.complexities)
        # Integer noise, as Bagua draws it: randint(int(spread * level) + 1) per sample.
        self.random_number = int(spread * self.random_level + 1)

    def _ordered_indices(self) -> list[int]:
        """All sample indices by (noisy) complexity, cut to ``total_size`` (dropped or wrapped)."""
        n = len(self.complexities)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            noise = torch.randint(self.random_number, (n,), generator=g).tolist()
            tie = torch.randperm(n, generator=g).tolist()
            keys = [(c + z, t) for c, z, t in zip(self.complexities, noise, tie, strict=True)]
            order = sorted(range(n), key=keys.__getitem__)
            if self.drop_last and self.total_size < n:
                keep = set(torch.randperm(n, generator=g)[: self.total_size].tolist())
                order = [i for i in order if i in keep]
        else:
            order = sorted(range(n), key=self.complexities.__getitem__)
        if len(order) < self.total_size:  # wrap around: the chunks stay neighbours in complexity
            order = (order * math.ceil(self.total_size / len(order)))[: self.total_size]
        return order[: self.total_size]

    def chunks(self) -> list[list[int]]:
        """This epoch's chunks (``num_replicas`` indices each) in the order the ranks walk them."""
        order = self._ordered_indices()
        r = self.num_replicas
        chunks = [order[i : i + r] for i in range(0, self.total_size, r)]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch + 1_000_003)
            chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]
        return chunks

    def indices_of(self, rank: int) -> list[int]:
        """The sample indices ``rank`` gets this epoch, in order."""
        return [chunk[rank] for chunk in self.chunks()]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices_of(self.rank))

    def __len__(self) -> int:
        return self.num_samples


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Batches of a :class:`LoadBalancingDistributedSampler`'s indices, the same number on every rank.

    Args:
        sampler: The load-balancing sampler (with ``drop_last=False``).
        batch_fn: ``batch_fn(indices) -> list of batches`` (each a list of indices), e.g. by a token budget;
            it is called with every rank's indices so every rank knows every rank's batch count.
        drop_last: Cut every rank to the smallest batch count instead of repeating batches up to the largest.

    Raises:
        TypeError: ``sampler`` is not a :class:`LoadBalancingDistributedSampler`.
        ValueError: ``sampler.drop_last`` is True.
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], Sequence[Sequence[int]]],
        drop_last: bool = False,
    ) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(f"sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}.")
        if sampler.drop_last:
            raise ValueError("the sampler of a LoadBalancingDistributedBatchSampler must have drop_last=False; "
                             "use the batch sampler's drop_last instead.")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self._epoch: int | None = None
        self.generate_batches()

    def generate_batches(self) -> None:
        """Cut every rank's indices for the sampler's current epoch; pad or trim to one batch count."""
        chunks = self.sampler.chunks()
        per_rank = [[list(b) for b in self.batch_fn([c[r] for c in chunks])] for r in range(self.num_replicas)]
        counts = [len(b) for b in per_rank]
        if min(counts) == 0:
            raise ValueError(f"batch_fn returned no batch for some rank (batch counts per rank: {counts}).")
        self.total_batch = min(counts) if self.drop_last else max(counts)
        mine = per_rank[self.rank]
        self.padded_batches = [mine[i % len(mine)] for i in range(self.total_batch)]
        self._epoch = self.sampler.epoch

    def __iter__(self) -> Iterator[list[int]]:
        if self._epoch != self.sampler.epoch:  # the sampler's epoch was set directly
            self.generate_batches()
        return iter(self.padded_batches)

    def __len__(self) -> int:
        if self._epoch != self.sampler.epoch:
            self.generate_batches()
        return self.total_batch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the wrapped sampler (a new order per epoch when it shuffles)."""
        self.sampler.set_epoch(epoch)
        self.generate_batches()

