"""The speed-only baseline: Bayesian optimisation over (log2 bucket size, hierarchical), as Bagua's.

Bagua searched ``bucket_size_2p`` and ``is_hierarchical_reduce`` with
scikit-optimize, which is no longer maintained. This is a small Gaussian process
of our own on numpy/scipy (Matern 5/2 kernel with one length scale per
dimension, fitted by maximum marginal likelihood) with expected improvement over
a dense grid: a two-dimensional space does not need more, and it adds no
dependency to the torch-free service image. The log2 bucket size is continuous
so that bucket sizes between powers of two (e.g. 20 MiB) are reachable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...proto.plan import BucketPlan, TensorDeclaration, split_into_buckets
from .costmodel import Sample
from .proposal import Proposal

_SQRT5 = math.sqrt(5.0)


def _matern52(a: np.ndarray, b: np.ndarray, lengthscales: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.sum(((a[:, None, :] - b[None, :, :]) / lengthscales) ** 2, axis=-1))
    return (1.0 + _SQRT5 * d + 5.0 / 3.0 * d**2) * np.exp(-_SQRT5 * d)


class GaussianProcess:
    """GP regression on inputs in [0, 1]^d with normalised outputs; hyperparameters by max likelihood."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        from scipy.linalg import cho_factor, cho_solve  # lazily: scipy takes seconds to import
        if x.ndim != 2 or len(x) != len(y) or len(y) == 0:
            raise ValueError(f"need x of shape (n, d) and y of shape (n,), got {x.shape} and {y.shape}")
        self.x = x
        self._mean = float(np.mean(y))
        self._scale = float(np.std(y)) or 1.0
        self.y = (y - self._mean) / self._scale
        self.lengthscales, self.noise = self._fit()
        k = _matern52(x, x, self.lengthscales) + (self.noise + 1e-8) * np.eye(len(x))
        self._chol = cho_factor(k, lower=True)
        self._alpha = cho_solve(self._chol, self.y)

    def _nll(self, params: np.ndarray) -> float:
        from scipy.linalg import cho_factor, cho_solve
        lengthscales, noise = np.exp(params[:-1]), math.exp(params[-1])
        k = _matern52(self.x, self.x, lengthscales) + (noise + 1e-8) * np.eye(len(self.x))
        try:
            chol = cho_factor(k, lower=True)
        except np.linalg.LinAlgError:
            return 1e10
        alpha = cho_solve(chol, self.y)
        return float(0.5 * self.y @ alpha + np.sum(np.log(np.diag(chol[0]))))

    def _fit(self) -> tuple[np.ndarray, float]:
        from scipy.optimize import minimize
        d = self.x.shape[1]
        bounds = [(math.log(0.05), math.log(5.0))] * d + [(math.log(1e-4), math.log(1.0))]
        best: tuple[float, np.ndarray] | None = None
        for start in (0.2, 0.6):
            x0 = np.array([math.log(start)] * d + [math.log(0.01)])
            result = minimize(self._nll, x0, method="L-BFGS-B", bounds=bounds)
            if best is None or result.fun < best[0]:
                best = (float(result.fun), result.x)
        assert best is not None
        return np.exp(best[1][:-1]), float(math.exp(best[1][-1]))

    def predict(self, xq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation, in the units of the training outputs."""
        from scipy.linalg import cho_solve
        ks = _matern52(xq, self.x, self.lengthscales)
        mean = ks @ self._alpha
        v = cho_solve(self._chol, ks.T)
        var = np.clip(1.0 - np.sum(ks * v.T, axis=1), 1e-12, None)
        return mean * self._scale + self._mean, np.sqrt(var) * self._scale


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float, xi: float = 0.01) -> np.ndarray:
    """Expected improvement over ``best`` when maximising."""
    from scipy.stats import norm
    z = (mean - best - xi) / std
    return (mean - best - xi) * norm.cdf(z) + std * norm.pdf(z)


class BayesianTuner:
    """Bagua's search: greedy cuts at ``2**log2_size`` bytes in ready order, plus the hierarchical flag.

    Args:
        order: tensors in gradient-ready order (else registration order).
        hierarchical_allowed: whether hierarchical reduce is a choice (more than one node).
        whether_to_bucket: False keeps one bucket per dtype group.
        min_log2: smallest log2 bucket size searched (bytes).
        max_log2: largest log2 bucket size searched (bytes).
        n_initial: samples (the initial plan included) taken at random before the GP guides.
        seed: seed of the random initial points.
    """

    def __init__(self, order: Sequence[TensorDeclaration], *, hierarchical_allowed: bool,
                 whether_to_bucket: bool = True, min_log2: float = 16.0, max_log2: float = 30.0,
                 n_initial: int = 5, seed: int = 0) -> None:
        if not min_log2 < max_log2:
            raise ValueError(f"need min_log2 < max_log2, got {min_log2} and {max_log2}")
        self.order = tuple(order)
        self.hierarchical_allowed = hierarchical_allowed
        self.whether_to_bucket = whether_to_bucket
        self.min_log2, self.max_log2 = min_log2, max_log2
        self.n_initial = max(1, n_initial)
        self.seed = seed

    def plan_for(self, log2_size: float, hierarchical: bool) -> BucketPlan:
        size = max(1, round(2.0**log2_size))
        buckets = split_into_buckets(self.order, size, whether_to_bucket=self.whether_to_bucket)
        return BucketPlan(buckets=buckets, bucket_size=size, is_hierarchical_reduce=hierarchical)

    def _encode(self, plan: BucketPlan) -> list[float]:
        u = (math.log2(plan.bucket_size) - self.min_log2) / (self.max_log2 - self.min_log2)
        return [min(max(u, 0.0), 1.0), float(plan.is_hierarchical_reduce)]

    def final(self, samples: Sequence[Sample]) -> Sample:
        """Bagua's choice: the best measured score."""
        return max(samples, key=lambda s: s.score)

    def propose(self, samples: Sequence[Sample]) -> Proposal:
        """The next (bucket size, hierarchical) to measure given every sample so far."""
        if not samples:
            raise ValueError("the Bayesian tuner proposes from measured samples; got none")
        dims = 1 if self.whether_to_bucket else 0
        if dims == 0 and not self.hierarchical_allowed:
            return Proposal(plan=max(samples, key=lambda s: s.score).plan, converged=True, reason="nothing-to-tune")
        span = self.max_log2 - self.min_log2
        if len(samples) < self.n_initial:
            rng = np.random.default_rng([self.seed, len(samples)])
            # Stratified draw: the k-th initial point lands in the k-th slice of the range.
            u = (len(samples) - 1 + rng.random()) / max(1, self.n_initial - 1)
            hierarchical = bool(rng.integers(2)) if self.hierarchical_allowed else False
            return Proposal(plan=self.plan_for(self.min_log2 + min(u, 1.0) * span, hierarchical),
                            reason="initial")
        x = np.array([self._encode(s.plan) for s in samples])
        y = np.array([s.score for s in samples], dtype=float)
        gp = GaussianProcess(x, y)
        grid_u = np.linspace(0.0, 1.0, 281) if self.whether_to_bucket else np.array([0.5])
        modes = [0.0, 1.0] if self.hierarchical_allowed else [0.0]
        grid = np.array([[u, m] for m in modes for u in grid_u])
        mean, std = gp.predict(grid)
        ei = expected_improvement(mean, std, float(np.max(y)))
        # Skip points already measured: the same (size, mode) again teaches the GP nothing.
        seen = {(round(a, 3), b) for a, b in x}
        for index in np.argsort(-ei):
            u, m = grid[index]
            if (round(float(u), 3), float(m)) not in seen:
                break
        plan = self.plan_for(self.min_log2 + float(u) * span, bool(m))
        return Proposal(plan=plan, reason="ei")
