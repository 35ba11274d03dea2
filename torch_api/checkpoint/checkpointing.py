"""Checkpoints in Bagua's layout.

::

    CHECKPOINTS_PATH/
        latest_checkpointed_iteration.txt     the last saved iteration (or "release")
        iter_0000100/mp_rank_00_model_states.pt
        iter_0000200/mp_rank_00_model_states.pt
        release/mp_rank_00_model_states.pt    read when the tracker says "release"

Each ``*_model_states.pt`` holds ``{"iteration", "model", "optimizer"?, "lr_scheduler"?}``.

Which ranks write: rank 0 writes the states and then the tracker; every rank waits for it (a barrier)
before ``save_checkpoint`` returns. This is Bagua's rule for every algorithm: with replicated
algorithms (gradient allreduce, ByteGrad, QAdam) every rank holds the same weights; with algorithms
whose replicas differ between averagings (decentralized, low precision decentralized, async model
average) the checkpoint is rank 0's replica and its optimizer state, and after ``load_checkpoint``
every rank starts again from that same replica. Every rank reads the file, so ``checkpoints_path``
must be visible to every rank (a shared file system on several nodes).

A model wrapped by a DDP-style wrapper (``.module``) or ``torch.compile`` (``._orig_mod``) is saved
under its inner module's names, so a checkpoint loads into the wrapped or the plain model alike. Files
are loaded with ``torch.load(weights_only=True)``: nothing but tensors, numbers, strings and containers
is unpickled.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...core.errors import ConfigurationError
from .. import communication

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if not dist.is_initialized():
        return
    if communication.is_initialized():
        communication.barrier()
    else:
        dist.barrier()


def _model_file(checkpoints_path: str | os.PathLike[str], iteration: int, release: bool = False,
                mp_rank: int = 0) -> Path:
    directory = "release" if release else f"iter_{iteration:07d}"
    return Path(checkpoints_path) / directory / f"mp_rank_{mp_rank:02d}_model_states.pt"


def _tracker(checkpoints_path: str | os.PathLike[str]) -> Path:
    return Path(checkpoints_path) / TRACKER_FILE


def _read_tracker(path: Path) -> tuple[int, bool]:
    text = path.read_text().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise ConfigurationError(
            f"checkpoint tracker {path} holds {text!r}, not an iteration; fix or delete it"
        )
    return iteration, False


def _agree_on_tracker(tracker: Path) -> tuple[int, bool]:
    """Rank 0 reads the tracker and every rank takes its answer: ``(iteration, release)``, -1 when none.

    One reading for all ranks, so a tracker that appears or changes meanwhile cannot send ranks
    different ways (a rank that skipped the final barrier would leave the others waiting).
    """
    answer, error = [-1, 0], ""
    if _rank() == 0:
        if tracker.is_file():
            try:
                iteration, release = _read_tracker(tracker)
                answer = [iteration, int(release)]
            except ConfigurationError as e:
                answer, error = [-2, 0], str(e)
        else:
            log.warning("no checkpoint tracker %s; starting from iteration 0", tracker)
    if dist.is_initialized():
        on_gpu = dist.get_backend() == "nccl"
        shared = torch.tensor(answer, dtype=torch.int64,
                              device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
        dist.broadcast(shared, src=0)
        answer = shared.tolist()
    if answer[0] == -2:
        raise ConfigurationError(error or f"checkpoint tracker {tracker} is unreadable (see rank 0's error)")
    return answer[0], bool(answer[1])


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under DDP-style (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        keys = list(model.state_dict())
        if not keys or not all(k.startswith(_WRAPPER_PREFIXES) for k in keys):
            return model
        model = inner


def _strip_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without a wrapper prefix every key carries (a checkpoint saved from a wrapper's state_dict)."""
    for prefix in _WRAPPER_PREFIXES:
        while state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _compact(obj: Any) -> Any:
    """``obj`` with every tensor that views a larger storage (flattened buckets) copied out, so only it is saved."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
    if isinstance(obj, dict):
        return {k: _compact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_compact(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_compact(v) for v in obj)
    return obj


def _write_atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(iteration: int, checkpoints_path: str, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    lr_scheduler: Any | None = None) -> None:
    """Save the model (and optimizer, LR scheduler) at ``iteration``; call it on every rank.

    Args:
        iteration: the training iteration; names the folder and becomes the tracker's value.
        checkpoints_path: the checkpoints folder (created when missing).
        model: the model (wrapped with ``with_bagua``, a DDP-style wrapper, or plain).
        optimizer: its optimizer, or None.
        lr_scheduler: its LR scheduler, or None.

    Raises:
        ValueError: ``iteration`` is negative.
    """
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration={iteration!r} must be a non-negative integer")
    if _rank() == 0:
        log.info("saving checkpoint at iteration %7d to %s", iteration, checkpoints_path)
        state: dict[str, Any] = {"iteration": iteration, "model": _compact(_unwrap(model).state_dict())}
        if optimizer is not None:
            state["optimizer"] = _compact(optimizer.state_dict())
        if lr_scheduler is not None:
            state["lr_scheduler"] = _compact(lr_scheduler.state_dict())
        _write_atomic(_model_file(checkpoints_path, iteration), lambda p: torch.save(state, p))
        # The tracker moves only once the states are complete on disk.
        _write_atomic(_tracker(checkpoints_path), lambda p: p.write_text(str(iteration)))
    _barrier()


def load_checkpoint(checkpoints_path: str, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any | None = None,
                    strict: bool = True) -> int:
    """Load the latest checkpoint of ``checkpoints_path`` into the model (and optimizer, LR scheduler).

    Call it on every rank; every rank reads the same file.

    Args:
        checkpoints_path: the checkpoints folder.
        model: the model to load into (wrapped or plain).
        optimizer: the optimizer to load into, or None.
        lr_scheduler: the LR scheduler to load into, or None.
        strict: whether the checkpoint's keys must match the model's ``state_dict()`` keys exactly.

    Returns:
        The iteration loaded; 0 when there is no checkpoint (no tracker file) yet.

    Raises:
        ConfigurationError: the tracker is unreadable, or the checkpoint lacks the optimizer or LR
            scheduler state that was asked for, or holds objects ``weights_only`` loading refuses.
    """
    iteration, release = _agree_on_tracker(_tracker(checkpoints_path))
    if iteration < 0:
        return 0
    path = _model_file(checkpoints_path, iteration, release)
    log.info("loading checkpoint %s", path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ConfigurationError(
            f"{path} holds objects that weights_only loading refuses ({e}); if you trust the file, allow their "
            "classes with torch.serialization.add_safe_globals([...]) before load_checkpoint"
        ) from None
    _unwrap(model).load_state_dict(_strip_prefixes(state["model"]), strict=strict)
    for name, target in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        if target is None:
            continue
        if name not in state:
            raise ConfigurationError(f"{path} has no {name} state; it was saved without one")
        target.load_state_dict(state[name])
    _barrier()
    log.info("loaded checkpoint %s at iteration %d", path, iteration)
    return iteration
