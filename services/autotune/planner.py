"""The model-based planner: bucket cut points from per-bucket timings.

From every measured sample it fits, per reduction mode (flat / hierarchical),
``comm_ms = latency + bytes / bandwidth`` and the ready time of every gradient;
then, for each dtype group in gradient-ready order, a dynamic programme over
the cut points minimises the moment the last bucket's communication finishes
(buckets go one after another, each once its last gradient is ready):

    finish(j) = min over i < j of  max(ready(j), finish(i)) + comm(bytes(i..j))

which is optimal because the right-hand side only grows with ``finish(i)``.
While the data cannot fit a mode's model yet (one bucket size seen), it
proposes a probe plan with many buckets of different sizes; a mode never
measured is tried once on the best plan of the other.

The model sees communication, not what each bucket costs the compute side (a
collective launched from the backward thread, SMs its kernel takes from
backward); on fast links that cost decides. So once the model has nothing
clearly better to offer, the *coarsening ladder* measures it: from the best
measured plan, the model's best plan with at most half as many buckets, again
and again while the measured speed holds. Measured speed picks the final plan.
It is plain Python: no server, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from ...proto.plan import BucketPlan, TensorDeclaration, split_into_buckets
from .costmodel import CommModel, ReadyModel, Sample, fit_comm_model, simulate_overlap
from .proposal import Proposal

Buckets = tuple[tuple[TensorDeclaration, ...], ...]


@dataclass(frozen=True, slots=True)
class FittedModels:
    """Everything the planner learnt from the samples."""

    comm: dict[bool, CommModel | None]  # by is_hierarchical_reduce
    measured_modes: frozenset[bool]
    ready: ReadyModel
    backward_ms: float  # backward with no bucket overhead (the fit's intercept)
    overhead_ms: float = 0.0  # what each bucket adds to backward (0 until two bucket counts were measured)


class ModelBasedPlanner:
    """Chooses bucket cut points that minimise exposed communication.

    Args:
        order: the model's tensors in gradient-ready order (else registration order).
        hierarchical_allowed: whether hierarchical reduce is a choice (more than one node).
        whether_to_bucket: False keeps one bucket per dtype group; only the mode is tuned.
        max_atoms: the dynamic programme cuts between at most this many consecutive
            runs of tensors per dtype group (bounds its O(n^2) cost on huge models).
        tolerance: relative predicted gain below which a new plan is not worth measuring.
        noise: relative speed difference below which two measured plans count as equal
            (a coarsening step that is slower by more ends the ladder).
    """

    def __init__(self, order: Sequence[TensorDeclaration], *, hierarchical_allowed: bool,
                 whether_to_bucket: bool = True, max_atoms: int = 512, tolerance: float = 0.01,
                 noise: float = 0.02) -> None:
        if not order:
            raise ValueError("the planner needs at least one tensor")
        if max_atoms < 1:
            raise ValueError(f"max_atoms must be >= 1, got {max_atoms}")
        if not 0 <= noise < 1:
            raise ValueError(f"noise must be a relative speed difference in [0, 1), e.g. 0.02, got {noise}")
        self.order = tuple(order)
        self.hierarchical_allowed = hierarchical_allowed
        self.whether_to_bucket = whether_to_bucket
        self.max_atoms = max_atoms
        self.tolerance = tolerance
        self.noise = noise
        self._index = {t.name: i for i, t in enumerate(self.order)}
        sizes = np.array([t.nbytes for t in self.order], dtype=float)
        self._end = np.cumsum(sizes)  # position of each tensor: cumulative bytes up to and including it
        self.total_bytes = float(self._end[-1])

    # -- fitting -----------------------------------------------------------------------------------
    def fit(self, samples: Sequence[Sample]) -> FittedModels:
        comm_points: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        ready_points: list[tuple[float, float]] = []
        backward_fit = _fit_bucket_overhead(samples)
        overhead_ms = backward_fit[1] if backward_fit else 0.0
        for sample in samples:
            mode = sample.plan.is_hierarchical_reduce
            for timing in sample.bucket_timings:
                if not 0 <= timing.bucket_index < len(sample.plan.buckets):
                    continue
                bucket = sample.plan.buckets[timing.bucket_index]
                nbytes = timing.bytes or sum(t.nbytes for t in bucket)
                comm_points[mode].append((float(nbytes), timing.comm_ms))
                positions = [self._end[self._index[t.name]] for t in bucket if t.name in self._index]
                if positions:
                    # Without the launches of the buckets before it, the gradient was ready this much sooner.
                    ready_points.append((float(max(positions)), timing.ready_ms - overhead_ms * timing.bucket_index))
        backward_ms = backward_fit[0] if backward_fit else max((ms for _, ms in ready_points), default=0.0)
        return FittedModels(
            comm={mode: fit_comm_model(points) for mode, points in comm_points.items()},
            measured_modes=frozenset(mode for mode, points in comm_points.items() if points),
            ready=ReadyModel(ready_points, self.total_bytes, backward_ms),
            backward_ms=backward_ms,
            overhead_ms=overhead_ms,
        )

    # -- planning ----------------------------------------------------------------------------------
    def _groups(self) -> list[list[TensorDeclaration]]:
        groups: dict[str, list[TensorDeclaration]] = {}
        for t in self.order:
            groups.setdefault(t.dtype, []).append(t)
        return list(groups.values())

    def _atoms(self, group: list[TensorDeclaration]) -> list[list[TensorDeclaration]]:
        if len(group) <= self.max_atoms:
            return [[t] for t in group]
        target = sum(t.nbytes for t in group) / self.max_atoms
        atoms: list[list[TensorDeclaration]] = [[]]
        acc = 0
        for t in group:
            atoms[-1].append(t)
            acc += t.nbytes
            if acc >= target:
                atoms.append([])
                acc = 0
        return [a for a in atoms if a]

    def optimal_buckets(self, comm: CommModel, ready: ReadyModel, max_buckets: int | None = None,
                        overhead_ms: float = 0.0, backward_ms: float = 0.0) -> Buckets:
        """The cut minimising the communication finish time under ``comm`` and ``ready``.

        ``max_buckets`` caps the number of buckets (shared among dtype groups in proportion
        to their bytes, at least one each): the best plan of at most that many buckets.
        ``overhead_ms`` > 0: each bucket delays every later gradient and the end of
        backward (``backward_ms`` without overhead) by that much; the step ends when both
        the communication and backward have.
        """
        if max_buckets is not None and max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1 (or None for no cap), got {max_buckets}")
        if overhead_ms < 0:
            raise ValueError(f"overhead_ms must be >= 0 ms per bucket, got {overhead_ms}")
        if not self.whether_to_bucket:
            return self._ordered([tuple(g) for g in self._groups()], ready)
        groups = self._groups()
        total = sum(t.nbytes for g in groups for t in g)
        buckets: list[tuple[TensorDeclaration, ...]] = []
        for group in groups:
            atoms = self._atoms(group)
            sizes = np.array([sum(t.nbytes for t in a) for a in atoms], dtype=float)
            ready_at = ready.ready_ms(np.array([self._end[self._index[a[-1].name]] for a in atoms]))
            budget = None if max_buckets is None else \
                max(1, round(max_buckets * float(sizes.sum()) / max(1, total)))
            for i, j in _cut(ready_at, sizes, comm, budget, overhead_ms, backward_ms):
                buckets.append(tuple(t for a in atoms[i:j] for t in a))
        return self._ordered(buckets, ready)

    def _ordered(self, buckets: list[tuple[TensorDeclaration, ...]], ready: ReadyModel) -> Buckets:
        # Across dtype groups, communicate buckets in the order they become ready.
        return tuple(sorted(buckets, key=lambda b: max(self._index[t.name] for t in b)))

    def predict_ms(self, buckets: Buckets, comm: CommModel, ready: ReadyModel, overhead_ms: float = 0.0,
                   backward_ms: float = 0.0) -> float:
        """Predicted communication finish time of ``buckets``, ms from the start of backward.

        With ``overhead_ms`` > 0 (see :meth:`optimal_buckets`): the later of that and the end
        of backward.
        """
        ends = np.array([max(self._end[self._index[t.name]] for t in b) for b in buckets])
        costs = [float(comm.cost_ms(sum(t.nbytes for t in b))) for b in buckets]
        ready_ms = ready.ready_ms(ends) + overhead_ms * np.arange(len(buckets))
        finish, _ = simulate_overlap(list(ready_ms), costs, 0.0)
        if overhead_ms > 0:
            finish = max(finish, backward_ms + overhead_ms * len(buckets))
        return finish

    def _predict(self, buckets: Buckets, comm: CommModel, fitted: FittedModels) -> float:
        return self.predict_ms(buckets, comm, fitted.ready, fitted.overhead_ms, fitted.backward_ms)

    def _optimal(self, comm: CommModel, fitted: FittedModels, max_buckets: int | None = None) -> Buckets:
        return self.optimal_buckets(comm, fitted.ready, max_buckets, fitted.overhead_ms, fitted.backward_ms)

    def _plan(self, buckets: Buckets, hierarchical: bool) -> BucketPlan:
        mean = int(sum(t.nbytes for b in buckets for t in b) / len(buckets))
        return BucketPlan(buckets=buckets, bucket_size=max(1, mean), is_hierarchical_reduce=hierarchical)

    def probe(self, measured: set[tuple[str, bool]], hierarchical: bool) -> BucketPlan | None:
        """A plan with many buckets of varied sizes, to separate latency from bandwidth."""
        for parts in (16, 64, 4, 256):
            buckets = split_into_buckets(self.order, max(1, int(self.total_bytes // parts)),
                                         whether_to_bucket=self.whether_to_bucket)
            plan = self._plan(self._ordered(list(buckets), ReadyModel([], 1.0, 0.0)), hierarchical)
            if (plan.fingerprint(), hierarchical) not in measured and len(plan.buckets) > 1:
                return plan
        return None

    def final(self, samples: Sequence[Sample]) -> Sample:
        """The measured sample with the best score.

        Measured speed decides, not the model: the model sees communication but not
        what each bucket costs the compute side (a launch on the backward thread, SMs
        taken by the collective), which is what the coarsening ladder measures.
        """
        if not samples:
            raise ValueError("no samples to choose from")
        return max(samples, key=lambda s: s.score)

    def propose(self, samples: Sequence[Sample]) -> Proposal:
        """The next plan to measure given every sample so far."""
        if not samples:
            raise ValueError("the planner proposes from measured samples; got none")
        fitted = self.fit(samples)
        measured = {(s.plan.fingerprint(), s.plan.is_hierarchical_reduce) for s in samples}
        modes = (False, True) if self.hierarchical_allowed else (False,)
        # 1. A measured mode whose model is not identifiable yet: probe it.
        for mode in modes:
            if mode in fitted.measured_modes and fitted.comm[mode] is None and self.whether_to_bucket:
                plan = self.probe(measured, mode)
                if plan is not None:
                    return Proposal(plan=plan, reason="explore")
        # 2. The best plan under each fitted mode.
        options: list[tuple[float, BucketPlan]] = []
        for mode in modes:
            comm = fitted.comm[mode]
            if comm is None and mode in fitted.measured_modes:
                comm = _one_point_model(samples, mode)
            if comm is None:
                continue
            buckets = self._optimal(comm, fitted)
            options.append((self._predict(buckets, comm, fitted), self._plan(buckets, mode)))
        if not options:  # no timings at all: nothing to model
            best = max(samples, key=lambda s: s.score)
            return Proposal(plan=best.plan, converged=True, reason="no-timings")
        predicted, plan = min(options, key=lambda o: o[0])
        # 3. A mode never measured: try it once on the best plan of the other.
        for mode in modes:
            if mode not in fitted.measured_modes:
                return Proposal(plan=self._plan(plan.buckets, mode), reason="explore-mode",
                                predicted_ms=None)
        # The model is done once it predicts no plan clearly better (1%) than one already measured:
        # chasing smaller predicted gains would only follow the noise.
        measured_best = min(
            (self._predict(s.plan.buckets, comm, fitted) for s in samples
             for comm in [fitted.comm[s.plan.is_hierarchical_reduce] or _one_point_model(samples, s.plan.is_hierarchical_reduce)]
             if comm is not None),
            default=float("inf"),
        )
        model_done = (plan.fingerprint(), plan.is_hierarchical_reduce) in measured \
            or predicted >= measured_best - self.tolerance * measured_best
        if not model_done:
            return Proposal(plan=plan, reason="model", predicted_ms=predicted)
        return self._coarsen(samples, fitted, measured)

    def _coarsen(self, samples: Sequence[Sample], fitted: FittedModels,
                 measured: set[tuple[str, bool]]) -> Proposal:
        """The coarsening ladder: from the best measured plan, halve the bucket count while speed holds.

        Each level is the model's best plan of at most half as many buckets as the level
        before; a level measured slower than the best plan by more than the noise ends the
        walk (converged), as does reaching one bucket per dtype group.
        """
        best = max(samples, key=lambda s: s.score)
        mode = best.plan.is_hierarchical_reduce
        comm = fitted.comm[mode] or _one_point_model(samples, mode)
        if comm is None or not self.whether_to_bucket:
            return Proposal(plan=best.plan, converged=True, reason="best")
        by_key = {(s.plan.fingerprint(), s.plan.is_hierarchical_reduce): s for s in samples}
        floor = len(self._groups())
        count = len(best.plan.buckets)
        seen: set[str] = {best.plan.fingerprint()}
        while count > floor:
            count = max(floor, -(-count // 2))
            plan = self._plan(self._optimal(comm, fitted, max_buckets=count), mode)
            key = (plan.fingerprint(), mode)
            if plan.fingerprint() in seen:
                continue
            seen.add(plan.fingerprint())
            if key not in measured:
                return Proposal(plan=plan, reason="coarsen",
                                predicted_ms=self._predict(plan.buckets, comm, fitted))
            if by_key[key].score < best.score - self.noise * abs(best.score):
                break  # clearly slower: coarser plans will not win either
            count = len(plan.buckets)
        return Proposal(plan=best.plan, converged=True, reason="best")


def _fit_bucket_overhead(samples: Sequence[Sample]) -> tuple[float, float] | None:
    """``(backward_ms, ms per bucket)``: least squares (both >= 0) of backward against the bucket count.

    (mean backward, 0) until backward was measured with two different bucket counts; None before any.
    """
    points = [(len(s.plan.buckets), s.backward_ms) for s in samples if s.backward_ms > 0]
    if not points:
        return None
    counts = np.array([c for c, _ in points], dtype=float)
    times = np.array([t for _, t in points])
    if len(set(counts)) < 2:
        return float(times.mean()), 0.0
    (base, per_bucket), _ = nnls(np.column_stack([np.ones_like(counts), counts]), times)
    return float(base), float(per_bucket)


# With a per-bucket overhead the programme is indexed by the bucket count: at most this many per dtype group.
MAX_BUCKETS_WITH_OVERHEAD = 64


def _cut(ready_at: np.ndarray, sizes: np.ndarray, comm: CommModel, budget: int | None, overhead_ms: float = 0.0,
         backward_ms: float = 0.0) -> list[tuple[int, int]]:
    """Bucket bounds ``[(i, j), ...]`` over consecutive atoms minimising the last bucket's finish time.

    ``finish(j) = min over i < j of max(ready(j), finish(i)) + comm(bytes(i..j))``; with a
    ``budget`` or an ``overhead_ms``, the same programme indexed by the number of buckets so
    far (at most ``budget``): the k-th bucket's gradients are ready ``(k - 1) * overhead_ms``
    later, and a plan of k buckets ends at the later of its finish and ``backward_ms + k *
    overhead_ms``. Ties go to the earliest cut and the fewest buckets.
    """
    n = len(sizes)
    prefix = np.concatenate([[0.0], np.cumsum(sizes)])
    if budget is None and overhead_ms <= 0:
        finish = np.zeros(n + 1)
        cut = np.zeros(n + 1, dtype=int)
        for j in range(1, n + 1):
            cand = np.maximum(ready_at[j - 1], finish[:j]) + comm.latency_ms + (prefix[j] - prefix[:j]) * comm.ms_per_byte
            best = int(np.argmin(cand))
            finish[j], cut[j] = cand[best], best
        bounds: list[tuple[int, int]] = []
        j = n
        while j > 0:
            bounds.append((int(cut[j]), j))
            j = int(cut[j])
        return list(reversed(bounds))
    k_max = max(1, min(budget if budget is not None else MAX_BUCKETS_WITH_OVERHEAD, n))
    # cost[i, j - 1]: bucket of atoms i..j-1; only i < j is a bucket.
    cost = comm.latency_ms + (prefix[None, 1:] - prefix[:-1, None]) * comm.ms_per_byte
    invalid = np.arange(n)[:, None] >= np.arange(1, n + 1)[None, :]
    finish_k = np.full((k_max + 1, n + 1), np.inf)
    finish_k[0, 0] = 0.0
    cut_k = np.zeros((k_max + 1, n + 1), dtype=int)
    cols = np.arange(n)
    for k in range(1, k_max + 1):
        cand = np.maximum(ready_at[None, :] + overhead_ms * (k - 1), finish_k[k - 1, :-1, None]) + cost
        cand[invalid] = np.inf
        best_i = np.argmin(cand, axis=0)
        finish_k[k, 1:] = cand[best_i, cols]
        cut_k[k, 1:] = best_i
    ends = np.maximum(finish_k[:, n], backward_ms + overhead_ms * np.arange(k_max + 1))
    ends[0] = np.inf
    k = int(np.argmin(ends))
    bounds = []
    j = n
    while j > 0:
        i = int(cut_k[k, j])
        bounds.append((i, j))
        j, k = i, k - 1
    return list(reversed(bounds))


def _one_point_model(samples: Sequence[Sample], mode: bool) -> CommModel | None:
    """Bandwidth-only model from one bucket size (no latency): the best guess when nothing varies."""
    points = [(t.bytes, t.comm_ms) for s in samples if s.plan.is_hierarchical_reduce == mode
              for t in s.bucket_timings if t.bytes > 0]
    if not points:
        return None
    per_byte = float(np.mean([c / b for b, c in points]))
    return CommModel(latency_ms=0.0, ms_per_byte=per_byte)
