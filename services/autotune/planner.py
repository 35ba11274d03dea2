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
measured is tried once on the best plan of the other. It is plain Python: no
server, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bagua_lightning.proto.plan import BucketPlan, TensorDeclaration, split_into_buckets

from .costmodel import CommModel, ReadyModel, Sample, fit_comm_model, simulate_overlap
from .proposal import Proposal

Buckets = tuple[tuple[TensorDeclaration, ...], ...]


@dataclass(frozen=True, slots=True)
class FittedModels:
    """Everything the planner learnt from the samples."""

    comm: dict[bool, CommModel | None]  # by is_hierarchical_reduce
    measured_modes: frozenset[bool]
    ready: ReadyModel
    backward_ms: float


class ModelBasedPlanner:
    """Chooses bucket cut points that minimise exposed communication.

    Args:
        order: the model's tensors in gradient-ready order (else registration order).
        hierarchical_allowed: whether hierarchical reduce is a choice (more than one node).
        whether_to_bucket: False keeps one bucket per dtype group; only the mode is tuned.
        max_atoms: the dynamic programme cuts between at most this many consecutive
            runs of tensors per dtype group (bounds its O(n^2) cost on huge models).
        tolerance: relative predicted gain below which a new plan is not worth measuring.
    """

    def __init__(self, order: Sequence[TensorDeclaration], *, hierarchical_allowed: bool,
                 whether_to_bucket: bool = True, max_atoms: int = 512, tolerance: float = 0.01) -> None:
        if not order:
            raise ValueError("the planner needs at least one tensor")
        if max_atoms < 1:
            raise ValueError(f"max_atoms must be >= 1, got {max_atoms}")
        self.order = tuple(order)
        self.hierarchical_allowed = hierarchical_allowed
        self.whether_to_bucket = whether_to_bucket
        self.max_atoms = max_atoms
        self.tolerance = tolerance
        self._index = {t.name: i for i, t in enumerate(self.order)}
        sizes = np.array([t.nbytes for t in self.order], dtype=float)
        self._end = np.cumsum(sizes)  # position of each tensor: cumulative bytes up to and including it
        self.total_bytes = float(self._end[-1])

    # -- fitting -----------------------------------------------------------------------------------
    def fit(self, samples: Sequence[Sample]) -> FittedModels:
        comm_points: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        ready_points: list[tuple[float, float]] = []
        backward = [s.backward_ms for s in samples if s.backward_ms > 0]
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
                    ready_points.append((float(max(positions)), timing.ready_ms))
        backward_ms = float(np.mean(backward)) if backward else max((ms for _, ms in ready_points), default=0.0)
        return FittedModels(
            comm={mode: fit_comm_model(points) for mode, points in comm_points.items()},
            measured_modes=frozenset(mode for mode, points in comm_points.items() if points),
            ready=ReadyModel(ready_points, self.total_bytes, backward_ms),
            backward_ms=backward_ms,
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

    def optimal_buckets(self, comm: CommModel, ready: ReadyModel) -> Buckets:
        """The cut minimising the communication finish time under ``comm`` and ``ready``."""
        if not self.whether_to_bucket:
            return self._ordered([tuple(g) for g in self._groups()], ready)
        buckets: list[tuple[TensorDeclaration, ...]] = []
        for group in self._groups():
            atoms = self._atoms(group)
            sizes = np.array([sum(t.nbytes for t in a) for a in atoms], dtype=float)
            ready_at = ready.ready_ms(np.array([self._end[self._index[a[-1].name]] for a in atoms]))
            prefix = np.concatenate([[0.0], np.cumsum(sizes)])
            finish = np.zeros(len(atoms) + 1)
            cut = np.zeros(len(atoms) + 1, dtype=int)
            for j in range(1, len(atoms) + 1):
                cand = np.maximum(ready_at[j - 1], finish[:j]) + comm.latency_ms \
                    + (prefix[j] - prefix[:j]) * comm.ms_per_byte
                best = int(np.argmin(cand))  # ties go to the earliest cut: fewer, larger buckets
                finish[j], cut[j] = cand[best], best
            bounds: list[tuple[int, int]] = []
            j = len(atoms)
            while j > 0:
                bounds.append((int(cut[j]), j))
                j = int(cut[j])
            for i, j in reversed(bounds):
                buckets.append(tuple(t for a in atoms[i:j] for t in a))
        return self._ordered(buckets, ready)

    def _ordered(self, buckets: list[tuple[TensorDeclaration, ...]], ready: ReadyModel) -> Buckets:
        # Across dtype groups, communicate buckets in the order they become ready.
        return tuple(sorted(buckets, key=lambda b: max(self._index[t.name] for t in b)))

    def predict_ms(self, buckets: Buckets, comm: CommModel, ready: ReadyModel) -> float:
        """Predicted communication finish time of ``buckets``, ms from the start of backward."""
        ends = np.array([max(self._end[self._index[t.name]] for t in b) for b in buckets])
        costs = [float(comm.cost_ms(sum(t.nbytes for t in b))) for b in buckets]
        finish, _ = simulate_overlap(list(ready.ready_ms(ends)), costs, 0.0)
        return finish

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

    def final(self, samples: Sequence[Sample], noise: float = 0.02) -> Sample:
        """Among samples scoring within ``noise`` of the best, the one the model predicts fastest.

        A single measurement cannot tell apart plans closer than its noise; the
        model, fitted on every bucket of every report, can.
        """
        if not samples:
            raise ValueError("no samples to choose from")
        top = max(s.score for s in samples)
        close = [s for s in samples if s.score >= top - noise * abs(top)]
        fitted = self.fit(samples)

        def predicted(sample: Sample) -> float:
            mode = sample.plan.is_hierarchical_reduce
            comm = fitted.comm[mode] or _one_point_model(samples, mode)
            return self.predict_ms(sample.plan.buckets, comm, fitted.ready) if comm else float("inf")

        return min(close, key=lambda s: (predicted(s), -s.score))

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
            buckets = self.optimal_buckets(comm, fitted.ready)
            options.append((self.predict_ms(buckets, comm, fitted.ready), self._plan(buckets, mode)))
        if not options:  # no timings at all: nothing to model
            best = max(samples, key=lambda s: s.score)
            return Proposal(plan=best.plan, converged=True, reason="no-timings")
        predicted, plan = min(options, key=lambda o: o[0])
        # 3. A mode never measured: try it once on the best plan of the other.
        for mode in modes:
            if mode not in fitted.measured_modes:
                return Proposal(plan=self._plan(plan.buckets, mode), reason="explore-mode",
                                predicted_ms=None)
        # Converged once the model predicts no plan clearly better (1%) than one already measured:
        # chasing smaller predicted gains would only follow the noise.
        measured_best = min(
            (self.predict_ms(s.plan.buckets, comm, fitted.ready) for s in samples
             for comm in [fitted.comm[s.plan.is_hierarchical_reduce] or _one_point_model(samples, s.plan.is_hierarchical_reduce)]
             if comm is not None),
            default=float("inf"),
        )
        converged = (plan.fingerprint(), plan.is_hierarchical_reduce) in measured \
            or predicted >= measured_best - self.tolerance * measured_best
        return Proposal(plan=plan, converged=converged, reason="model", predicted_ms=predicted)


def _one_point_model(samples: Sequence[Sample], mode: bool) -> CommModel | None:
    """Bandwidth-only model from one bucket size (no latency): the best guess when nothing varies."""
    points = [(t.bytes, t.comm_ms) for s in samples if s.plan.is_hierarchical_reduce == mode
              for t in s.bucket_timings if t.bytes > 0]
    if not points:
        return None
    per_byte = float(np.mean([c / b for b, c in points]))
    return CommModel(latency_ms=0.0, ms_per_byte=per_byte)
