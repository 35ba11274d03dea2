"""Bagua's ``bagua.torch_api.utils``: flattening helpers, dtype and reduce-op names, and time-window averages."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "StatisticalAverage",
    "align_size",
    "apply_flattened_call",
    "apply_flattened_call_all",
    "average_by_removing_extreme_values",
    "check_contiguous",
    "flatten",
    "get_flattened_tensor",
    "to_bagua_datatype",
    "to_bagua_reduce_op",
    "unflatten",
]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` one after the other (same dtype and device)."""
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten`)."""
    return tuple(_unflatten_dense_tensors(flat, list(tensors)))


def apply_flattened_call(bucket: Sequence[torch.Tensor], call: Callable[..., Any],
                         extra_args: Sequence[Any] | None = None) -> None:
    """Run ``call(flat, *extra_args)`` on the flattened ``bucket`` and copy the result back.

    ``dist.all_reduce`` as ``call`` averages (the sum is divided by the world size), as in Bagua.
    """
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args or ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for buf, synced in zip(bucket, unflatten(coalesced, bucket), strict=True):
        buf.copy_(synced)


def apply_flattened_call_all(tensors: Sequence[torch.Tensor], call: Callable[..., Any]) -> None:
    """:func:`apply_flattened_call` once per tensor type (dtype and device) in ``tensors``."""
    groups: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.type(), []).append(t)
    for group in groups.values():
        apply_flattened_call(group, call)


def align_size(size: int, align: int) -> int:
    """``size`` rounded up to a multiple of ``align``."""
    return -(-size // align) * align


def check_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` lie back to back in memory, in order."""
    end = None
    for t in tensors:
        if end is not None and t.data_ptr() != end:
            return False
        end = t.data_ptr() + t.numel() * t.element_size()
    return True


def get_flattened_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A new 1-D tensor with the elements of ``tensors`` one after the other (None for no tensors)."""
    if not tensors:
        return None
    return torch.cat([t.detach().reshape(-1) for t in tensors])


_BAGUA_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.int64: "i64"}


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """Bagua's name of a torch dtype (``"f32"``, ``"f16"``, ``"u8"``, ``"i64"``).

    Raises:
        ValueError: another dtype.
    """
    try:
        return _BAGUA_DTYPES[datatype]
    except KeyError:
        raise ValueError(f"unsupported data type {datatype}; use one of {list(_BAGUA_DTYPES)}") from None


def to_bagua_reduce_op(torch_reduce_op: Any) -> int:
    """Bagua's :class:`~bagua_lightning.torch_api.communication.ReduceOp` value of a ``torch.distributed.ReduceOp``.

    Raises:
        ValueError: an op Bagua has no value for.
    """
    table = [(dist.ReduceOp.SUM, 0), (dist.ReduceOp.PRODUCT, 1), (dist.ReduceOp.MIN, 2), (dist.ReduceOp.MAX, 3),
             (dist.ReduceOp.BOR, 7), (dist.ReduceOp.BAND, 8), (dist.ReduceOp.BXOR, 9), (dist.ReduceOp.AVG, 10)]
    for op, value in table:
        if torch_reduce_op == op:
            return value
    raise ValueError(f"unsupported reduce op {torch_reduce_op}")


def average_by_removing_extreme_values(raw_score_list: Sequence[float]) -> tuple[float, float, list[float]]:
    """Mean and standard deviation of scores after dropping the first third (warm-up) and outliers.

    Values more than one standard deviation from the mean are dropped, up to ten more times while the
    deviation is at least the mean. Returns ``(mean, std, kept scores)``.
    """
    scores = np.asarray(raw_score_list, dtype=float)
    scores = scores[len(scores) // 3:]

    def inliers(x: np.ndarray) -> np.ndarray:
        kept = x[np.abs(x - x.mean()) < x.std()]
        return kept if len(kept) else x

    scores = inliers(scores)
    for _ in range(10):
        if np.std(scores) < np.mean(scores):
            break
        scores = inliers(scores)
    return float(np.mean(scores)), float(np.std(scores)), scores.tolist()


class StatisticalAverage:
    """The average of a recorded value over the last ``t`` seconds, for any ``t``, in O(log t) memory.

    ``records[i]`` is the average over the ``2**i`` seconds before ``last_update_time``; ``record_tail`` is
    ``(seconds, average)`` of the period recorded beyond the last of those windows. Averages between two
    window lengths are interpolated linearly.

    Args:
        last_update_time: time of the last record (seconds since the epoch); None: now.
        records: the window averages (see above).
        record_tail: ``(length in seconds, average)`` of the tail.
    """

    def __init__(self, last_update_time: float | None = None, records: list[float] | None = None,
                 record_tail: tuple[float, float] = (0.0, 0.0)) -> None:
        self.last_update_time = time.time() if last_update_time is None else last_update_time
        self.records: list[float] = list(records or [])
        self.record_tail: tuple[float, float] = record_tail

    def record_seconds(self) -> float:
        """Length of the longest window, in seconds (0 with no windows)."""
        return 2.0 ** (len(self.records) - 1) if self.records else 0.0

    def total_recording_time(self) -> float:
        """Seconds covered by the windows and the tail."""
        return self.record_seconds() + self.record_tail[0]

    def get_records_mean(self, last_n_seconds: float) -> float:
        """The average over the ``last_n_seconds`` before ``last_update_time``."""
        if last_n_seconds <= 0.0:
            return 0.0
        tail_len, tail_mean = self.record_tail
        if not self.records:
            return tail_mean
        if last_n_seconds < 1.0:
            return self.records[0]
        span = self.record_seconds()
        if last_n_seconds <= span:
            i = max(0, math.floor(math.log2(last_n_seconds)))
            if i + 1 >= len(self.records):
                return self.records[i]
            lo = 2.0**i
            return _lerp(lo, self.records[i], 2 * lo, self.records[i + 1], last_n_seconds)
        if last_n_seconds <= span + tail_len:
            return _lerp(span, self.records[-1], span + tail_len, tail_mean, last_n_seconds)
        return tail_mean

    def record(self, val: float) -> None:
        """Record ``val`` as the value held since ``last_update_time``, up to now."""
        now = time.time()
        elapsed = now - self.last_update_time
        covered = self.total_recording_time()
        windows: list[float] = []
        tail = (0.0, 0.0)
        for i in range(64):
            length = 2.0**i
            if length <= elapsed:
                windows.append(val)
            elif length <= elapsed + covered:
                share = elapsed / length
                windows.append(val * share + self.get_records_mean(length - elapsed) * (1.0 - share))
            else:
                total = elapsed + covered
                if total <= 0.0:  # recorded twice in the same instant: nothing to weigh against
                    tail = (0.0, val)
                    break
                share = elapsed / total
                tail = (total - (2.0 ** (len(windows) - 1) if windows else 0.0),
                        val * share + self.get_records_mean(covered) * (1.0 - share))
                break
        self.last_update_time = now
        self.records = windows
        self.record_tail = tail

    def get(self, last_n_seconds: float) -> float:
        """The average over the ``last_n_seconds`` before now."""
        since = time.time() - self.last_update_time
        if last_n_seconds <= since:
            return self.records[0] if self.records else self.record_tail[1]
        return self.get_records_mean(last_n_seconds - since)

    def __str__(self) -> str:
        return str({"last_update_time": self.last_update_time, "records": self.records,
                    "record_tail": self.record_tail})


def _lerp(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
