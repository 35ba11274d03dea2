"""``powersgd``: gradient buckets reduced as low-rank approximations (Vogels et al., NeurIPS 2019).

Each gradient ``G`` of a bucket is viewed as a matrix ``n x m`` (its first dimension by the rest, as torch's
``powerSGD_hook`` does). One step of power iteration per training step approximates the average of the
ranks' matrices with rank ``r``::

    G += E                     # error feedback: what the last approximation left out, on this rank
    P  = G Q                   # Q: the last step's (warm start), orthogonalised; random at first
    allreduce(P); orthogonalise P
    Q  = G^T P
    allreduce(Q); Q /= world_size
    G' = P Q^T                 # every rank the same approximation of the average
    E  = G - G'                # (error feedback) kept for the next step

Only ``(n + m) r`` values per matrix cross the wire instead of ``n m``. A tensor that would not shrink by more
than ``min_compression_rate`` (torch's rule: compress when ``(n + m) r * min_compression_rate < n m``; vectors
and biases never do) is averaged at full precision, packed into the same allreduce as the ``P`` matrices,
so a bucket takes two allreduces (torch's hook takes three). For the first ``start_powerSGD_iter``
communicating backwards every bucket is a plain full-precision allreduce.

Hierarchical (the plan's ``is_hierarchical_reduce``, Bagua's meaning): the ranks of a node reduce to their
leader at full precision, the node leaders run PowerSGD among themselves (``CommContext``'s inter-node
group) on the node's average, and each leader broadcasts the result within its node; with one node
nothing is compressed (the node's allreduce is the whole reduction).

The bucket step is the engine's (a generator yielding each allreduce it needs finished): on CPU the ``P``
allreduce of one bucket is on the wire while the engine starts the next bucket, so consecutive buckets
overlap with each other and with backward.

State: the error buffers ``E`` (one per rank: each rank's own) and the ``Q`` matrices (the same on every rank),
kept per tensor name, so a new bucket plan (the autotuner's, or the ready-order cut after the first backward)
keeps them. :meth:`PowerSGDAlgorithm.state_dict` gathers every rank's errors (a collective: Lightning saves a
checkpoint on every rank), so a resumed job continues exactly where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError
from ..buckets import Bucket, BucketStep
from ..comm import CommContext
from ..parameters import trainable_parameters
from .base import register_algorithm
from .bucketed import GradientBucketAlgorithm
from .gradient_allreduce import allreduce_step

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...proto.plan import BucketPlan

log = logging.getLogger(__name__)

#: Gradient dtypes the low-rank step computes in (matrix products and orthogonalisation).
COMPRESSIBLE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_options(rank: object, start: object, rate: object, error_feedback: object, warm_start: object,
                   epsilon: object, seed: object) -> None:
    """ConfigurationError naming the first bad option and the fix."""
    for name, value in (("use_error_feedback", error_feedback), ("warm_start", warm_start)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"powersgd: {name}={value!r}; give True or False.")
    for name, value in (("matrix_approximation_rank", rank), ("start_powerSGD_iter", start), ("random_seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(f"powersgd: {name}={value!r} is not a whole number; give one, e.g. 1.")
    assert isinstance(rank, int) and isinstance(start, int) and isinstance(seed, int)
    if rank < 1:
        raise ConfigurationError(f"powersgd: matrix_approximation_rank={rank}; give a rank of at least 1 "
                                 "(1 sends the fewest bytes; 2-4 approximate better).")
    if start < 0:
        raise ConfigurationError(f"powersgd: start_powerSGD_iter={start}; give 0 or more full-precision steps.")
    if (error_feedback or warm_start) and start <= 1:
        raise ConfigurationError(
            f"powersgd: start_powerSGD_iter={start} with use_error_feedback={error_feedback} and "
            f"warm_start={warm_start}: error feedback and warm start need at least two full-precision steps "
            "first (torch's PowerSGDState refuses the same: the first backward's buckets are re-cut in "
            "gradient-ready order after it); give start_powerSGD_iter >= 2, or turn both off.")
    if not 0 <= seed < 2**32:
        raise ConfigurationError(f"powersgd: random_seed={seed}; give a seed in [0, 2**32).")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate >= 0:
        raise ConfigurationError(f"powersgd: min_compression_rate={rate!r}; give a number >= 0 (torch's default "
                                 "2: compress a matrix when it shrinks more than 2x).")
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not epsilon >= 0:
        raise ConfigurationError(f"powersgd: orthogonalization_epsilon={epsilon!r}; give a number >= 0 (e.g. "
                                 "1e-8 when whole gradients may vanish).")


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's ``min_compression_rate`` rule: compress when ``(rows + cols) * rank`` times the rate is below
    ``rows * cols`` (``rank`` already capped at ``min(rows, cols)``)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` (``n x r``, ``r <= n``) orthonormal, in place.

    Gram-Schmidt for rank 1 or 2 and for half precision (QR needs neither), QR otherwise, as torch's hook. A
    column of zeros stays zeros when ``epsilon`` is 0 (its norm is replaced by 1 instead of dividing by 0).
    """
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)
        return
    for i in range(rank):
        col = matrix[:, i:i + 1]
        norm = torch.linalg.vector_norm(col, dim=0, keepdim=True)
        if epsilon:
            col.div_(norm + epsilon)
        else:
            col.div_(torch.where(norm == 0, torch.ones_like(norm), norm))
        if i + 1 < rank:
            rest = matrix[:, i + 1:]
            rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)


@dataclass(slots=True)
class _Matrix:
    """One compressed tensor of a bucket: its matrix view and its slices of the bucket's buffers."""

    name: str
    m: torch.Tensor  # n x cols view of the bucket's flat buffer
    p: torch.Tensor  # n x r view of the P buffer
    q: torch.Tensor  # cols x r view of the Q buffer
    error: torch.Tensor | None  # n x cols view of the error buffer (error feedback)


@dataclass(slots=True)
class _Layout:
    """What one bucket's low-rank step works on, built at its first compressed step."""

    matrices: list[_Matrix]
    uncompressed: list[torch.Tensor]  # flat views of the bucket's tensors sent at full precision
    pu: torch.Tensor  # [every P | every uncompressed tensor]: the first allreduce
    u: torch.Tensor  # the uncompressed tail of ``pu``
    q: torch.Tensor  # every Q: the second allreduce
    errors: torch.Tensor | None
    q_ready: set[str] = field(default_factory=set)  # names whose Q holds a previous step's (warm start)


@register_algorithm(
    name="powersgd",
    description="gradients reduced as rank-r approximations with error feedback (PowerSGD)",
    bagua_name="PowerSGDAlgorithm",
)
class PowerSGDAlgorithm(GradientBucketAlgorithm):
    """PowerSGD over gradient buckets, overlapped with backward (torch's ``powerSGD_hook``, bucket by bucket).

    The options are named as torch's ``PowerSGDState``'s and mean the same; only the default of
    ``start_powerSGD_iter`` differs (torch: 1,000), so that a short job, or ``algorithm="auto"`` timing its
    candidates, sees the compressed step. Give ``start_powerSGD_iter=1000`` for torch's.

    Args:
        matrix_approximation_rank: the rank ``r`` of each approximation (>= 1).
        start_powerSGD_iter: communicating backwards averaged at full precision before compression starts
            (counted from the start of the job, or of the switch to this algorithm; >= 2 with error feedback
            or warm start, torch's rule).
        min_compression_rate: compress a tensor only when it shrinks more than this (``n m`` values against
            ``(n + m) r``); the others go at full precision.
        use_error_feedback: add what the last approximation left out to the next gradient (a rank's own).
        warm_start: start each step's power iteration from the last step's ``Q`` instead of a random one.
        orthogonalization_epsilon: added to each column's norm in Gram-Schmidt (0: none; a zero column stays 0).
        random_seed: seed of the random initial ``Q`` matrices (the same on every rank; torch's scheme, so the
            same seed gives the hook's matrices).
        hierarchical: full precision within each node, PowerSGD among node leaders, broadcast within the node.
        average: average the gradients (True) or sum them.
    """

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 10,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0, hierarchical: bool = False,
                 average: bool = True) -> None:
        _check_options(matrix_approximation_rank, start_powerSGD_iter, min_compression_rate, use_error_feedback,
                       warm_start, orthogonalization_epsilon, random_seed)
        super().__init__(hierarchical=hierarchical, average=average)
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = random_seed
        self._rng = np.random.RandomState(random_seed)
        self._iter: int | None = None  # communicating backwards so far (None: take the driver's step)
        self._compressing = False  # the backward under way compresses (fixed at its start)
        self._layouts: dict[int, _Layout] = {}
        self._buckets: object = None  # the engine's bucket list the layouts were built on
        # State by tensor name not (yet) in a layout: after a new plan or a checkpoint restore.
        self._saved_q: dict[str, torch.Tensor] = {}
        self._saved_errors: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ set-up and hooks

    def setup(self, module: nn.Module, comm: CommContext, plan: BucketPlan) -> None:
        for name, p in trainable_parameters(module):
            if p.dtype not in COMPRESSIBLE_DTYPES:
                raise ConfigurationError(
                    f"powersgd: parameter {name!r} is {p.dtype}, which a low-rank approximation cannot "
                    f"represent; powersgd compresses {[str(d) for d in COMPRESSIBLE_DTYPES]} gradients. Use "
                    "gradient_allreduce for this model, or exclude the parameter from training.")
        super().setup(module, comm, plan)

    @property
    def iteration(self) -> int:
        """Communicating backwards counted so far (compression runs from ``start_powerSGD_iter`` on)."""
        return self._iter or 0

    def on_backward_start(self, step: int) -> None:
        if self._iter is None:  # a fresh instance: count from the job's step (auto may start it mid-job)
            self._iter = step
        self._compressing = self._iter >= self.start_powerSGD_iter
        if self.engine.buckets is not self._buckets:  # a new plan (the autotuner's, or the ready-order cut)
            self._park_state()
            self._buckets = self.engine.buckets
        super().on_backward_start(step)  # the engine asks one_collective() now

    def on_backward_end(self, step: int) -> None:
        if self.engine.finish():
            self._iter = self.iteration + 1
            if self._iter == self.start_powerSGD_iter:
                log.info("powersgd: %d full-precision steps done; compressing to rank %d from the next one",
                         self._iter, self.matrix_approximation_rank)

    def one_collective(self) -> bool:
        return not self._compressing and not self.engine.plan.is_hierarchical_reduce

    # ------------------------------------------------------------------ the bucket step

    def reduce_bucket(self, bucket: Bucket, comm: CommContext, hierarchical: bool) -> BucketStep:
        if not self._compressing or comm.world_size == 1 or (hierarchical and comm.num_nodes == 1):
            yield from allreduce_step(bucket, comm, hierarchical=hierarchical, average=self.average)
            return
        if hierarchical and comm.local_size > 1:
            leader = comm.global_rank(comm.node_leader())
            yield dist.reduce(bucket.flat, dst=leader, group=comm.intra_group, async_op=True)
            if comm.is_leader:
                bucket.flat.div_(comm.local_size)  # the node's average: the leaders approximate its mean
                yield from self._low_rank_step(bucket, comm.leaders_group, comm.num_nodes)
            yield dist.broadcast(bucket.flat, src=leader, group=comm.intra_group, async_op=True)
        else:
            yield from self._low_rank_step(bucket, comm.group, comm.world_size)
        if not self.average:
            bucket.flat.mul_(comm.world_size)

    def _low_rank_step(self, bucket: Bucket, group: dist.ProcessGroup | None, size: int) -> BucketStep:
        """``bucket.flat`` becomes the rank-r approximation of its average over ``group``'s ``size`` ranks."""
        layout = self._layout(bucket)
        matrices = layout.matrices
        if layout.errors is not None and matrices:
            torch._foreach_add_([x.m for x in matrices], [x.error for x in matrices if x.error is not None])
        self._prepare_q(layout)
        for x in matrices:
            torch.mm(x.m, x.q, out=x.p)
        if layout.uncompressed:
            torch.cat(layout.uncompressed, out=layout.u)
        yield dist.all_reduce(layout.pu, group=group, async_op=True)
        if layout.uncompressed:
            layout.u.div_(size)
            offset = 0
            for t in layout.uncompressed:
                t.copy_(layout.u[offset:offset + t.numel()])
                offset += t.numel()
        for x in matrices:
            orthogonalize_(x.p, self.orthogonalization_epsilon)
            torch.mm(x.m.t(), x.p, out=x.q)
        yield dist.all_reduce(layout.q, group=group, async_op=True)
        layout.q.div_(size)
        for x in matrices:
            if x.error is not None:
                torch.addmm(x.m, x.p, x.q.t(), alpha=-1, out=x.error)  # what this rank's G' leaves out
            torch.mm(x.p, x.q.t(), out=x.m)
        if self.warm_start:
            layout.q_ready.update(x.name for x in matrices)

    def _prepare_q(self, layout: _Layout) -> None:
        """Orthogonalise the last step's Q (warm start), or draw random ones (torch's seeding: one seed per
        bucket that needs them, its matrices in first-seen order of their shapes)."""
        fresh = [x for x in layout.matrices if x.name not in layout.q_ready]
        for x in layout.matrices:
            if x.name in layout.q_ready:
                orthogonalize_(x.q, self.orthogonalization_epsilon)
        if not fresh:
            return
        generator = torch.Generator().manual_seed(int(self._rng.randint(1_000_000_000)))
        by_shape: dict[tuple[int, ...], list[_Matrix]] = {}
        for x in fresh:
            by_shape.setdefault(tuple(x.m.shape), []).append(x)
        for group in by_shape.values():
            for x in group:
                x.q.copy_(torch.randn(tuple(x.q.shape), generator=generator, dtype=x.q.dtype))
                orthogonalize_(x.q, self.orthogonalization_epsilon)

    def _layout(self, bucket: Bucket) -> _Layout:
        layout = self._layouts.get(bucket.index)
        if layout is None:
            layout = self._layouts[bucket.index] = self._make_layout(bucket)
        return layout

    def _make_layout(self, bucket: Bucket) -> _Layout:
        compress: list[tuple[str, torch.Tensor, int]] = []
        uncompressed: list[torch.Tensor] = []
        for name, view in zip(bucket.names, bucket.views, strict=True):
            if view.dim() >= 1 and view.numel() > 0:
                m = view.reshape(view.shape[0], -1)
                rank = min(*m.shape, self.matrix_approximation_rank)
                if should_compress(m.shape[0], m.shape[1], rank, self.min_compression_rate):
                    compress.append((name, m, rank))
                    continue
            uncompressed.append(view.reshape(-1))
        flat = bucket.flat
        p_numel = sum(m.shape[0] * r for _, m, r in compress)
        u_numel = sum(t.numel() for t in uncompressed)
        pu = torch.empty(p_numel + u_numel, dtype=flat.dtype, device=flat.device)
        q = torch.empty(sum(m.shape[1] * r for _, m, r in compress), dtype=flat.dtype, device=flat.device)
        errors = None
        if self.use_error_feedback:
            errors = torch.zeros(sum(m.numel() for _, m, _ in compress), dtype=flat.dtype, device=flat.device)
        matrices, po, qo, eo = [], 0, 0, 0
        for name, m, r in compress:
            n, cols = m.shape
            error = None if errors is None else errors[eo:eo + n * cols].view(n, cols)
            matrices.append(_Matrix(name, m, pu[po:po + n * r].view(n, r), q[qo:qo + cols * r].view(cols, r), error))
            po, qo, eo = po + n * r, qo + cols * r, eo + n * cols
        layout = _Layout(matrices, uncompressed, pu, pu[p_numel:], q, errors)
        for x in matrices:  # state kept from an earlier plan or a checkpoint
            saved_q = self._saved_q.pop(x.name, None)
            if saved_q is not None and saved_q.shape == x.q.shape:
                x.q.copy_(saved_q)
                layout.q_ready.add(x.name)
            saved_error = self._saved_errors.pop(x.name, None)
            if x.error is not None and saved_error is not None and saved_error.shape == x.error.shape:
                x.error.copy_(saved_error)
        return layout

    def _park_state(self) -> None:
        """Move every layout's state into the by-name dictionaries (before the buckets change)."""
        for layout in self._layouts.values():
            for x in layout.matrices:
                if x.name in layout.q_ready:
                    self._saved_q[x.name] = x.q.clone()
                if x.error is not None:
                    self._saved_errors[x.name] = x.error.clone()
        self._layouts.clear()

    def teardown(self) -> None:
        self._layouts.clear()
        super().teardown()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Q matrices, every rank's error buffers, the step count and the seed generator's state.

        A collective over the ranks (their error buffers differ): call it on every rank, as Lightning's
        checkpointing does. The buckets must be idle (between steps).
        """
        self._park_state()
        comm = self._set_up(self._comm)
        names = sorted(self._saved_errors)
        mine = (torch.cat([self._saved_errors[n].reshape(-1) for n in names]) if names
                else torch.zeros(0, dtype=torch.float32))
        errors = [mine]
        if comm.world_size > 1 and names:
            errors = [torch.empty_like(mine) for _ in range(comm.world_size)]
            dist.all_gather(errors, mine, group=comm.group)
        kind, keys, pos, has_gauss, cached = self._rng.get_state()
        return {
            "iteration": self.iteration,
            "q": {n: t.clone() for n, t in self._saved_q.items()},
            "error_names": names,
            "error_shapes": [list(self._saved_errors[n].shape) for n in names],
            "errors": errors,  # by rank
            "rng": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached), "kind": str(kind)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result: this rank's errors (none when the world size changed)."""
        self._layouts.clear()
        self._iter = int(state["iteration"])
        self._saved_q = {str(n): t.clone() for n, t in state["q"].items()}
        self._saved_errors = {}
        comm = self._set_up(self._comm)
        errors: Sequence[torch.Tensor] = state["errors"]
        names = [str(n) for n in state["error_names"]]
        if names and len(errors) == comm.world_size:
            flat, offset = errors[comm.rank], 0
            for name, shape in zip(names, state["error_shapes"], strict=True):
                numel = int(np.prod(shape))
                self._saved_errors[name] = flat[offset:offset + numel].view(*shape).clone()
                offset += numel
        elif names:
            log.warning("powersgd: the checkpoint holds the error buffers of %d ranks, this job has %d; "
                        "error feedback starts again from zero", len(errors), comm.world_size)
        rng = state["rng"]
        self._rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), int(rng["pos"]),
                             int(rng["has_gauss"]), float(rng["cached_gaussian"])))
