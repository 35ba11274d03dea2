"""Fused optimizer: one update per run of contiguous parameters instead of one per parameter.

``fuse_optimizer`` moves every parameter group's parameters and parameter-shaped optimizer state into flat
buffers (one per group, dtype and device) and leaves the original tensors as views of them. ``fuse_step``
then finds the *runs*: parameters whose weights and every parameter-shaped state tensor sit next to each
other in memory, in the same order, and whose other state (``step`` counters and the like) is equal. Each
run becomes one flat parameter; the optimizer's own ``step`` runs once over those flat parameters (the
original optimizer object, its hyper-parameters and hooks: only ``param_groups[i]["params"]`` and ``state``
are swapped for the duration), so a group of 200 tensors costs a handful of kernels.

Gradients: where a run's gradients already lie side by side in the same order (e.g. in a communication
bucket) the fused gradient is a view of them. Otherwise the run has a gradient buffer: gradients autograd
allocated are moved into it (so a backward after ``zero_grad(set_to_none=False)`` writes there, no copy);
gradients that are views of someone else's buffer are copied in each step and left where they are.

Exactness: for update rules that are element-wise (SGD, Adam, AdamW, Adamax, RMSprop, Rprop, ASGD, Adadelta,
Adagrad, NAdam, RAdam, ...) the fused update does the same floating-point operations per element as the
unfused one, so the results are bitwise equal. Rules that look at a whole tensor (per-tensor norms such as
LAMB or LARS, Adafactor's factored moments, L-BFGS) change meaning on a flat tensor: the optimizers of torch
that are known to do so are never fused, and a user's own optimizer of that kind must not be fused.

The original optimizer stays usable: ``step()`` still works (per tensor, on the same views), ``state_dict()``
has the unfused layout and ``load_state_dict()`` puts the loaded state back into the flat buffers.
"""

from __future__ import annotations

import logging
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .flat_tensors import calculate_mutual_groups, flat_view, flatten_copies, is_standalone, split_like

__all__ = ["calculate_mutual_groups", "fuse_optimizer", "fuse_step", "is_fused_optimizer"]

log = logging.getLogger(__name__)

_ATTR = "_bagua_lightning_fused"

# Update rules that are not element-wise: fusing them would change the result.
_NOT_ELEMENTWISE: tuple[type, ...] = tuple(
    t for t in (getattr(torch.optim, "LBFGS", None), getattr(torch.optim, "Adafactor", None)) if t is not None
)


# ---------------------------------------------------------------------------------------------- the plan
def _is_elementwise_state(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _scalar_key(value: Any) -> Any:
    """A hashable stand-in for a non-element-wise state value; equal keys mean the values can be shared."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return ("tensor", value.dtype, value.device, tuple(value.shape), value.item())
        return ("tensor-id", id(value))
    try:
        hash(value)
    except TypeError:
        return ("object-id", id(value))
    return ("value", value)


@dataclass(slots=True)
class _Run:
    """One fused parameter and the original parameters (in memory order) whose storage it covers."""

    param: torch.nn.Parameter
    members: list[torch.Tensor]
    scalar_keys: list[str]
    pieces: list[torch.nn.Parameter]
    """What the optimizer steps: ``param`` itself, or consecutive slices of it (CPU: cache-sized)."""
    grad_views: list[torch.Tensor]
    """Per member, the view of ``param.grad`` its gradient must be in (copied there when it is not)."""
    owns_grads: bool
    """``param.grad`` is our buffer (True) or a view over gradients laid out by someone else (False)."""


@dataclass(slots=True)
class _GroupPlan:
    """How one parameter group is stepped: its fused runs plus the parameters left as they are."""

    params: list[torch.Tensor]
    data_ptrs: list[int]
    grads: list[torch.Tensor | None]
    step_params: list[torch.Tensor]
    runs: list[_Run]
    fused_tensors: int


@dataclass(slots=True)
class _FusedState:
    """Everything ``fuse_step`` keeps on a fused optimizer."""

    check_flatten: bool
    flattened: bool
    plans: list[_GroupPlan] | None = None
    fused_state: defaultdict[Any, dict[str, Any]] = field(default_factory=lambda: defaultdict(dict))
    in_fused_step: bool = False
    scalars_dirty: bool = False
    warned: bool = False
    fused_steps: int = 0


def _state_of(optimizer: torch.optim.Optimizer) -> _FusedState:
    st = getattr(optimizer, _ATTR, None)
    if st is None:
        raise TypeError(
            f"{type(optimizer).__name__} is not a fused optimizer; call fuse_optimizer(optimizer) before fuse_step."
        )
    return st


def _gather_grads(run: _Run) -> bool:
    """Copy members' gradients into the run's buffer where they are elsewhere; False when that is impossible.

    A gradient autograd allocated on its own is then replaced by its view in the buffer (the next backward
    accumulates there, no copy); a gradient that is a view of someone else's buffer is only copied.
    """
    dst, src = [], []
    for p, v in zip(run.members, run.grad_views, strict=True):
        g = p.grad
        if g is v:
            continue
        if g is None or not run.owns_grads or g.shape != v.shape or g.dtype != v.dtype:
            return False
        dst.append(v)
        src.append(g)
        if is_standalone(g):
            p.grad = v
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
    return True


# On CPU a flat tensor much larger than the caches makes every element-wise pass of a multi-pass rule (Adam:
# ~10 passes) stream from memory, while per-tensor steps stay in cache: pieces of 2**18 elements (1 MiB of
# float32 per buffer) measured ~8x faster than one 5M-element tensor for Adam, and far fewer than 290
# tensors. On GPUs a launch costs more than a pass: one piece.
CPU_PIECE_NUMEL = 1 << 18


def _chunk_numel(device: torch.device) -> int | None:
    return CPU_PIECE_NUMEL if device.type == "cpu" else None


def _pieces(fp: torch.nn.Parameter, chunk: int | None) -> list[torch.nn.Parameter]:
    if chunk is None or fp.numel() <= chunk:
        return [fp]
    pieces = []
    for offset in range(0, fp.numel(), chunk):
        n = min(chunk, fp.numel() - offset)
        piece = torch.nn.Parameter(fp.detach().narrow(0, offset, n), requires_grad=False)
        piece.grad = fp.grad.narrow(0, offset, n)  # type: ignore[union-attr]
        pieces.append(piece)
    return pieces


def _build_group_plan(optimizer: torch.optim.Optimizer, group: dict[str, Any], fused_state: Any) -> _GroupPlan:
    params: list[torch.Tensor] = list(group["params"])
    state = optimizer.state
    # Candidates: dense gradient, at least one dimension; classes share dtype, device and state layout.
    classes: dict[Any, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        g = p.grad
        if g is None or g.is_sparse or p.dim() == 0 or g.dtype != p.dtype:
            continue
        st = state.get(p, {})
        elementwise = tuple(sorted(k for k, v in st.items() if _is_elementwise_state(v, p)))
        scalars = tuple(sorted((k, _scalar_key(v)) for k, v in st.items() if not _is_elementwise_state(v, p)))
        classes[(p.dtype, p.device, elementwise, scalars)].append(i)
    runs: list[_Run] = []
    fused_ids: set[int] = set()
    for (_, _, ew_keys, scalars), idx in classes.items():
        if len(idx) < 2:
            continue
        members = [params[i] for i in idx]
        lists = [[p.detach() for p in members]]
        lists += [[state[p][k] for p in members] for k in ew_keys]
        for group_idx in calculate_mutual_groups(lists):
            run_members = [members[j] for j in group_idx]
            numel = sum(p.numel() for p in run_members)
            first = run_members[0]
            fp = torch.nn.Parameter(flat_view(first.detach(), numel), requires_grad=False)
            grads = [p.grad for p in run_members]
            in_order = calculate_mutual_groups([[p.detach() for p in run_members], grads])  # type: ignore[list-item]
            if in_order == [list(range(len(run_members)))]:
                # Gradients already side by side in the same order (ours, or a bucket's): step them in place.
                fp.grad = flat_view(grads[0], numel)  # type: ignore[arg-type]
                run = _Run(fp, run_members, [], [], list(grads), owns_grads=False)  # type: ignore[arg-type]
            else:
                fp.grad = torch.empty(numel, dtype=first.dtype, device=first.device)
                views = split_like(fp.grad, run_members)
                run = _Run(fp, run_members, [], [], views, owns_grads=True)
                _gather_grads(run)
            run.scalar_keys = [k for k, _ in scalars]
            run.pieces = _pieces(fp, _chunk_numel(fp.device))
            offset = 0
            for piece in run.pieces:
                fst = fused_state[piece]
                for k in ew_keys:
                    fst[k] = flat_view(state[first][k], numel).narrow(0, offset, piece.numel())
                for k in run.scalar_keys:
                    v = state[first][k]
                    fst[k] = v.clone() if isinstance(v, torch.Tensor) else v
                offset += piece.numel()
            runs.append(run)
            fused_ids.update(id(p) for p in run_members)
    step_params = [piece for r in runs for piece in r.pieces] + [p for p in params if id(p) not in fused_ids]
    return _GroupPlan(
        params=params,
        data_ptrs=[p.data_ptr() for p in params],
        grads=[p.grad for p in params],  # after gathering: what a step without a new backward finds
        step_params=step_params,
        runs=runs,
        fused_tensors=len(fused_ids),
    )


def _sync_scalars_back(optimizer: torch.optim.Optimizer, st: _FusedState) -> None:
    """Write each run's shared scalar state (``step`` and the like) into its members' own state."""
    if not st.scalars_dirty or st.plans is None:
        return
    for plan in st.plans:
        for run in plan.runs:
            fst = st.fused_state.get(run.pieces[0], {})
            for k in run.scalar_keys:
                if k not in fst:
                    continue
                v = fst[k]
                for p in run.members:
                    optimizer.state[p][k] = v.clone() if isinstance(v, torch.Tensor) else v
    st.scalars_dirty = False


def _adopt_new_state(optimizer: torch.optim.Optimizer, st: _FusedState) -> bool:
    """After a fused step created state for a run, give its members views of it; True when anything changed."""
    changed = False
    for plan in st.plans or ():
        for run in plan.runs:
            states = [st.fused_state.get(piece, {}) for piece in run.pieces]
            members_state = optimizer.state[run.members[0]]
            new_keys = [k for k in states[0] if k not in members_state]
            if not new_keys:
                continue
            changed = True
            for k in new_keys:
                values = [fst[k] for fst in states]
                v = values[0]
                if all(isinstance(x, torch.Tensor) and x.shape == piece.shape
                       for x, piece in zip(values, run.pieces, strict=True)):
                    # Per-piece buffers become one: the members' state is then contiguous like their weights.
                    flat = values[0] if len(values) == 1 else torch.cat(values)
                    for p, view in zip(run.members, split_like(flat, run.members), strict=True):
                        optimizer.state[p][k] = view
                else:
                    for p in run.members:
                        optimizer.state[p][k] = v.clone() if isinstance(v, torch.Tensor) else v
    return changed


def _valid_plans(optimizer: torch.optim.Optimizer, st: _FusedState) -> list[_GroupPlan]:
    """The cached plans when the layout still matches (gradients gathered); otherwise rebuilt."""
    plans = st.plans
    if plans is not None and len(plans) == len(optimizer.param_groups):
        ok = True
        for plan, group in zip(plans, optimizer.param_groups, strict=True):
            params = group["params"]
            if len(params) != len(plan.params) or any(a is not b for a, b in zip(params, plan.params, strict=True)) or [p.data_ptr() for p in params] != plan.data_ptrs or any((p.grad is None) != (g is None) for p, g in zip(params, plan.grads, strict=True)):
                ok = False
            else:
                # Gradients that are not (yet) in a run's buffer are copied there: fresh ones from
                # zero_grad(set_to_none=True) + backward, or views of someone else's buffer, every step.
                ok = all(_gather_grads(run) for run in plan.runs)
                plan.grads = [p.grad for p in params]
            if not ok:
                break
        if ok:
            return plans
    _sync_scalars_back(optimizer, st)
    st.fused_state = defaultdict(dict)
    st.plans = [_build_group_plan(optimizer, g, st.fused_state) for g in optimizer.param_groups]
    if st.check_flatten and not st.warned:
        fused = sum(p.fused_tensors for p in st.plans)
        total = sum(len(g["params"]) for g in optimizer.param_groups)
        if total > 1 and fused < total:
            st.warned = True
            log.warning(
                "fused optimizer: %d of %d parameter tensors are contiguous with their neighbours and state; the "
                "rest are stepped one by one (did something re-allocate parameters, e.g. with_bagua(do_flatten=True)?)",
                fused, total,
            )
    return st.plans


# ---------------------------------------------------------------------------------------------- flattening
def _groups_by_type(group: dict[str, Any]) -> list[list[torch.Tensor]]:
    by_type: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for p in group["params"]:
        if p.dim() > 0 and not p.is_sparse:
            by_type[(p.dtype, p.device)].append(p)
    return [ps for ps in by_type.values() if len(ps) > 1]


def _flatten_params_and_state(optimizer: torch.optim.Optimizer) -> None:
    state = optimizer.state
    for group in optimizer.param_groups:
        for params in _groups_by_type(group):
            with torch.no_grad():
                for p, v in zip(params, flatten_copies([p.detach() for p in params]), strict=True):
                    p.data = v
            _flatten_state(state, params)


def _flatten_state(state: Any, params: Sequence[torch.Tensor]) -> None:
    keys = set.intersection(*(set(state.get(p, {})) for p in params)) if params else set()
    for k in sorted(keys):
        values = [state[p][k] for p in params]
        if all(_is_elementwise_state(v, p) for v, p in zip(values, params, strict=True)) and len({v.dtype for v in values}) == 1:
            for p, v in zip(params, flatten_copies(values), strict=True):
                state[p][k] = v


# ---------------------------------------------------------------------------------------------- public API
def fuse_optimizer(
    optimizer: torch.optim.Optimizer, do_flatten: bool = True, check_flatten: bool = True
) -> torch.optim.Optimizer:
    """Convert any optimizer into a fused optimizer (in place) and return it.

    Args:
        optimizer: Any ``torch.optim.Optimizer`` with an element-wise update rule.
        do_flatten: Move each group's parameters, gradients and parameter-shaped state into flat buffers
            (the tensors become views of them; their values are unchanged). Without it, only what is already
            contiguous (e.g. laid out by ``with_bagua(do_flatten=True)``) is fused.
        check_flatten: Warn once when a ``fuse_step`` finds that tensors left the flat layout (something
            re-allocated them), since that step then updates them one by one.

    Returns:
        ``optimizer`` itself, with a ``fuse_step(closure=None)`` method.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or its update rule is not element-wise.
        RuntimeError: ``optimizer`` is already fused.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fuse_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if isinstance(optimizer, _NOT_ELEMENTWISE):
        raise TypeError(
            f"{type(optimizer).__name__} does not update each element independently; fusing its parameters would "
            "change its result. Use its own step()."
        )
    if is_fused_optimizer(optimizer):
        raise RuntimeError("this optimizer is already fused; call fuse_optimizer once per optimizer.")
    st = _FusedState(check_flatten=bool(do_flatten and check_flatten), flattened=bool(do_flatten))
    setattr(optimizer, _ATTR, st)
    # Bagua's counter, read by scripts and tests: parameter groups stepped with at least one fused run,
    # summed over fuse_step calls (0 when nothing was ever contiguous, e.g. the layout was broken up).
    optimizer._bagua_fused_count = 0  # type: ignore[attr-defined]
    if do_flatten:
        _flatten_params_and_state(optimizer)

    def _before_plain_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A per-tensor step() changes per-parameter scalar state: the fused copies are stale after it.
        if not st.in_fused_step:
            _sync_scalars_back(opt, st)
            st.plans = None

    def _before_state_dict(opt: torch.optim.Optimizer) -> None:
        _sync_scalars_back(opt, st)

    def _after_load_state_dict(opt: torch.optim.Optimizer) -> None:
        st.plans = None
        st.scalars_dirty = False
        if st.flattened:
            for group in opt.param_groups:
                for params in _groups_by_type(group):
                    _flatten_state(opt.state, params)

    optimizer.register_step_pre_hook(_before_plain_step)
    optimizer.register_state_dict_pre_hook(_before_state_dict)
    optimizer.register_load_state_dict_post_hook(_after_load_state_dict)
    optimizer.fuse_step = types.MethodType(fuse_step, optimizer)  # type: ignore[attr-defined]
    return optimizer


def is_fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` was converted by :func:`fuse_optimizer`."""
    return hasattr(optimizer, _ATTR)


def fuse_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """Perform one parameter update with every contiguous run of parameters updated as one tensor.

    Parameters that are not contiguous with their neighbours (or have no gradient) are updated one by one,
    exactly as ``optimizer.step()`` would; with nothing contiguous this is ``optimizer.step()``.

    Args:
        optimizer: A fused optimizer.
        closure: Re-evaluates the model and returns the loss; it runs once, before the update.

    Returns:
        The closure's loss, or None.

    Raises:
        TypeError: ``optimizer`` was not converted by :func:`fuse_optimizer`.
    """
    st = _state_of(optimizer)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    plans = _valid_plans(optimizer, st)
    saved_params = [g["params"] for g in optimizer.param_groups]
    saved_state = optimizer.state
    st.in_fused_step = True
    try:
        for group, plan in zip(optimizer.param_groups, plans, strict=True):
            group["params"] = plan.step_params
        step_state: defaultdict[Any, dict[str, Any]] = st.fused_state
        for plan in plans:
            for p in plan.step_params:
                if p not in step_state and p in saved_state:
                    step_state[p] = saved_state[p]  # unfused parameters keep their own state dict
        optimizer.state = step_state
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, saved_params, strict=True):
            group["params"] = params
        optimizer.state = saved_state
        st.in_fused_step = False
    # Unfused parameters stepped for the first time: their new state lives in the fused dict; copy it over.
    for plan in plans:
        fused_ids = {id(piece) for r in plan.runs for piece in r.pieces}
        for p in plan.step_params:
            if id(p) not in fused_ids and p in st.fused_state and p not in saved_state:
                saved_state[p] = st.fused_state[p]
    st.fused_steps += 1
    optimizer._bagua_fused_count += sum(1 for plan in plans if plan.runs)  # type: ignore[attr-defined]
    if _adopt_new_state(optimizer, st):
        st.plans = None  # rebuilt next step with the state the runs now have
    # Scalar state (``step``) back into the members now: QAdam's algorithm reads it before the next backward.
    st.scalars_dirty = True
    _sync_scalars_back(optimizer, st)
    return loss
